"""``python -m fsync``, the public names and their documentation."""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import itertools
import pathlib
import re
import subprocess
import sys
import textwrap
import types

import pytest

import fsync
import fsync.ft
import fsync.ops
import fsync.optim

ROOT = pathlib.Path(__file__).parent.parent
MODULES = (fsync, fsync.ops, fsync.optim, fsync.ft, fsync.checkpoint)


def test_python_m_fsync_reports_and_self_checks():
    out = subprocess.run(
        [sys.executable, "-m", "fsync"], capture_output=True, text=True, timeout=120, check=True
    ).stdout.splitlines()
    assert out[0] == f"fsync {fsync.__version__}"
    assert out[1].startswith("torch ") and "optree" in out[1]
    assert "gloo" in out[2]
    assert out[3].startswith("self-check ok:")
    assert out[4] == "torch.compile: ok"  # CI's torch 2.13 traces any optree


def test_python_m_fsync_says_when_this_torch_cannot_compile_fsync(monkeypatch):
    from fsync import __main__ as cli
    from fsync import _tree

    found = _tree.compile_problem("2.11.0+cu130", "0.20.0")
    monkeypatch.setattr(_tree, "compile_problem", lambda: found)
    assert cli._compile_check() == (False, f"torch.compile: FAILS here: {found}")


def _public() -> list[tuple[str, object]]:
    """``(qualified name, object)`` for every name in the three ``__all__`` lists."""
    return [
        (f"{module.__name__}.{name}", getattr(module, name))
        for module in MODULES
        for name in module.__all__
        if not name.startswith("__")
    ]


PUBLIC = _public()
PUBLIC_CLASSES = [(name, obj) for name, obj in PUBLIC if isinstance(obj, type)]


def test_every_public_name_is_in_the_api_reference():
    api = (ROOT / "docs" / "api.md").read_text()
    documented = set(re.findall(r"^::: (fsync[\w.]*)$", api, flags=re.M))
    public = {name for name, obj in PUBLIC if not isinstance(obj, types.ModuleType)}
    assert public - documented == set(), "add these to docs/api.md"
    assert documented - public == set(), "docs/api.md names something that is not public"


def test_all_lists_only_what_the_module_has():
    for module in MODULES:
        assert len(set(module.__all__)) == len(module.__all__), module.__name__
        for name in module.__all__:
            assert hasattr(module, name), f"{module.__name__}.__all__ names missing {name!r}"


def _own_doc(obj: object) -> str | None:
    # A class's own docstring: inspect.getdoc would inherit one from a base class.
    return vars(obj).get("__doc__") if isinstance(obj, type) else obj.__doc__


@pytest.mark.parametrize(("name", "obj"), PUBLIC, ids=[name for name, _ in PUBLIC])
def test_public_name_has_a_docstring(name, obj):
    doc = _own_doc(obj)
    assert doc and doc.strip(), f"{name} has no docstring"
    # NamedTuples and dataclasses without a docstring get one made by Python from their
    # signature, "LeafSpec(path, shape, ...)": that is no documentation.
    if isinstance(obj, type):
        assert not doc.startswith(f"{obj.__name__}("), f"{name} has only Python's generated doc"


def _attributes_section(doc: str) -> set[str]:
    """The names a Google-style ``Attributes:`` section documents."""
    names: set[str] = set()
    lines = inspect.cleandoc(doc).splitlines()
    for i, line in enumerate(lines):
        if line.strip() != "Attributes:":
            continue
        indent = len(line) - len(line.lstrip())
        for entry in lines[i + 1 :]:
            if entry.strip() and len(entry) - len(entry.lstrip()) <= indent:
                break  # the next section
            match = re.match(rf"^ {{{indent + 4}}}(\w+)(?: \([^)]*\))?: \S", entry)
            if match:
                names.add(match.group(1))
    return names


def _class_tree(cls: type) -> ast.ClassDef:
    node = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0]
    assert isinstance(node, ast.ClassDef)
    return node


def _attribute_docstrings(node: ast.ClassDef) -> set[str]:
    """Names followed by a string in the class body (PEP 257 attribute docstrings,
    which mkdocstrings renders)."""
    names = set()
    for stmt, after in itertools.pairwise(node.body):
        target = stmt.target if isinstance(stmt, ast.AnnAssign) else None
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1:
            target = stmt.targets[0]
        if (
            isinstance(target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            names.add(target.id)
    return names


def _instance_attributes(node: ast.ClassDef) -> set[str]:
    """Public ``self.name = ...`` assignments in ``__init__``."""
    names = set()
    for stmt in node.body:
        if isinstance(stmt, ast.FunctionDef) and stmt.name == "__init__":
            for sub in ast.walk(stmt):
                targets = [sub.target] if isinstance(sub, ast.AnnAssign) else []
                targets += sub.targets if isinstance(sub, ast.Assign) else []
                for target in targets:
                    if (
                        isinstance(target, ast.Attribute)
                        and isinstance(target.value, ast.Name)
                        and target.value.id == "self"
                        and not target.attr.startswith("_")
                    ):
                        names.add(target.attr)
    return names


@pytest.mark.parametrize(("name", "cls"), PUBLIC_CLASSES, ids=[name for name, _ in PUBLIC_CLASSES])
def test_public_members_are_documented(name, cls):
    """Methods and properties have docstrings; fields and attributes are documented in
    the class's ``Attributes:`` section or by an attribute docstring."""
    node = _class_tree(cls)
    section = _attributes_section(_own_doc(cls) or "")
    documented = section | _attribute_docstrings(node)
    fields = set(getattr(cls, "_fields", ()))  # NamedTuple
    if dataclasses.is_dataclass(cls):
        fields |= {field.name for field in dataclasses.fields(cls)}
    attributes = {f for f in fields | _instance_attributes(node) if not f.startswith("_")}
    missing = [f"attribute {a}" for a in sorted(attributes - documented)]
    members = set()
    for attr, value in vars(cls).items():
        if attr.startswith("_") or attr in fields:
            continue
        members.add(attr)
        if isinstance(value, (staticmethod, classmethod)):
            value = value.__func__
        if isinstance(value, (property, functools.cached_property)) or inspect.isroutine(value):
            if not (value.__doc__ or "").strip():
                missing.append(f"member {attr}")
        elif attr not in documented:  # a class-level constant
            missing.append(f"attribute {attr}")
    assert not missing, f"{name}: document {missing}"
    stale = section - attributes - members
    assert not stale, f"{name}'s Attributes section names {stale}, which it does not have"


def _readme_table() -> list[str]:
    text = (ROOT / "README.md").read_text()
    table = text.split("## What there is", 1)[1].split("\n## ", 1)[0]
    return [line for line in table.splitlines() if line.startswith("| `")]


def test_readme_api_table_matches_the_code():
    """Every ``fsync...(...)`` in the table names a public object and only parameters it
    has, in its order, with every required one; every public name is in the table."""
    public = dict(PUBLIC)
    seen = set()
    for row in _readme_table():
        for span in re.findall(r"`([^`]+)`", row):
            match = re.fullmatch(r"(fsync(?:\.\w+)+)(?:\((.*)\))?", span)
            if match is None:
                continue  # a method, such as `.init(params) -> state`
            qualname, args = match.groups()
            assert qualname in public, f"README names {qualname}, which is not public"
            seen.add(qualname)
            if args is None:
                continue
            obj = public[qualname]
            params = inspect.signature(obj).parameters
            written = [a.split("=")[0].strip().lstrip("*") for a in args.split(",") if a.strip()]
            written = [a for a in written if a not in ("", "/", "...")]
            assert set(written) <= set(params), f"{span}: {set(written) - set(params)} unknown"
            required = {
                p.name
                for p in params.values()
                if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
            }
            assert required <= set(written), f"{span} leaves out {required - set(written)}"
            assert written == [p for p in params if p in written], f"{span}: order"
    unlisted = {n for n, o in PUBLIC if not isinstance(o, types.ModuleType)} - seen
    assert unlisted == set(), "add these to the README's table"
