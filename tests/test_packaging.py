"""The package as shipped: a non-editable install works, and the module boundaries hold."""

from __future__ import annotations

import ast
import importlib.metadata
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

import fsync

ROOT = pathlib.Path(__file__).parent.parent
PACKAGE = ROOT / "fsync"

# Build outputs and caches a fresh clone does not have (the .gitignore's entries).
_NOT_IN_A_CLONE = shutil.ignore_patterns(
    ".git", "build", "dist", "*.egg-info", "__pycache__", ".*_cache", ".hypothesis", "site"
)


@pytest.mark.timeout(300)
def test_non_editable_install_works(tmp_path):
    # A copy of the checkout, so that the build's own outputs (build/, *.egg-info) land
    # beside the copy and not in the tree others work in.
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=_NOT_IN_A_CLONE)
    target = tmp_path / "site"
    # Offline: no index, and the installed setuptools as the build backend (the "test"
    # extra pins it to what pyproject's build-system asks for). About 3 s.
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation",
         "--no-index", "--disable-pip-version-check", "--target", str(target), str(src)],
        capture_output=True, text=True, timeout=180, check=True,
    )  # fmt: skip

    installed = sorted(p.relative_to(target).as_posix() for p in target.rglob("*.py"))
    shipped = sorted(p.relative_to(ROOT).as_posix() for p in PACKAGE.rglob("*.py"))
    assert installed == shipped, "the install lacks modules or ships more than fsync/"
    assert (target / "fsync" / "py.typed").is_file()
    (dist,) = importlib.metadata.distributions(path=[str(target)])
    assert dist.metadata["Name"] == "fsync" and dist.version == fsync.__version__
    assert any(req.startswith("torch") for req in dist.requires or [])

    # Outside the checkout, with only the install on the path (ahead of the editable
    # install of the dev environment, whose finder comes after sys.path).
    env = {**os.environ, "PYTHONPATH": str(target)}
    run = tmp_path / "elsewhere"
    run.mkdir()
    probe = "import fsync, fsync.ops, fsync.optim; print(fsync.__file__); print(fsync.__version__)"
    out = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=run, env=env, capture_output=True, text=True, timeout=120, check=True,
    ).stdout.splitlines()  # fmt: skip
    assert pathlib.Path(out[0]) == target / "fsync" / "__init__.py"
    assert out[1] == fsync.__version__
    cli = subprocess.run(
        [sys.executable, "-m", "fsync"],
        cwd=run, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert cli.returncode == 0, cli.stdout + cli.stderr
    assert cli.stdout.splitlines()[0] == f"fsync {fsync.__version__}"
    assert "self-check ok:" in cli.stdout


# Modules allowed to use torch.distributed besides fsync/_comm/__init__.py, and why.
_DISTRIBUTED_ALLOWED = {
    "fsync/_comm/__init__.py": "the communication boundary, the one place that talks to c10d",
    # The CLI self-check lists the available backends and starts (and destroys) a
    # one-rank gloo process group to run sync_grads; it is not library code.
    "fsync/__main__.py": "the `python -m fsync` self-check",
}


def _distributed_uses(tree: ast.Module) -> list[str]:
    """Every place a module imports or touches ``torch.distributed``."""
    uses = []
    for node in ast.walk(tree):
        where = f"line {getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Import):
            uses += [f"{where}: import {a.name}" for a in node.names if _is_dist(a.name)]
        elif isinstance(node, ast.ImportFrom) and node.module is not None:
            names = [f"{node.module}.{a.name}" for a in node.names]
            if _is_dist(node.module) or any(_is_dist(n) for n in names):
                uses.append(f"{where}: from {node.module} import ...")
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if (node.value.id, node.attr) == ("torch", "distributed") or node.value.id == "dist":
                uses.append(f"{where}: {node.value.id}.{node.attr}")
        # importlib.import_module("torch.distributed...") and the like; docstrings
        # mention the name in prose, with spaces or backquotes around it.
        elif isinstance(node, ast.Constant) and _is_dist(str(node.value).strip()):
            uses.append(f"{where}: {node.value!r}")
    return uses


def _is_dist(name: str) -> bool:
    return name == "torch.distributed" or name.startswith("torch.distributed.")


def test_only_comm_uses_torch_distributed():
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(ROOT).as_posix()
        uses = _distributed_uses(ast.parse(path.read_text(), filename=relative))
        if uses:
            found[relative] = uses
    assert "fsync/_comm/__init__.py" in found, "the scan found nothing in _comm: it is broken"
    offenders = {path: uses for path, uses in found.items() if path not in _DISTRIBUTED_ALLOWED}
    assert offenders == {}, "only fsync/_comm/__init__.py may talk to torch.distributed (DESIGN.md)"


# The entry points' modules, each imported first (before fsync/__init__.py has run its own
# order): an arrow up into a package that imports back down (fsync.ops re-exports the ZeRO
# step, whose modules import the reduce) shows as a circular import only in some orders.
_ENTRY_MODULES = (
    "fsync._sync", "fsync._grad", "fsync._zero", "fsync._accumulate", "fsync._diloco",
    "fsync.checkpoint", "fsync.ops",
)  # fmt: skip
_FIRST = """
import importlib, sys, types
package = types.ModuleType("fsync")
package.__path__ = [sys.argv[1]]
sys.modules["fsync"] = package  # fsync/__init__.py not run: the module is the first
importlib.import_module(sys.argv[2])
"""


@pytest.mark.timeout(120)
def test_each_entry_module_imports_first():
    runs = {
        name: subprocess.Popen(
            [sys.executable, "-c", _FIRST, str(PACKAGE), name],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for name in _ENTRY_MODULES
    }
    failed = {}
    for name, run in runs.items():
        output, _ = run.communicate(timeout=100)
        if run.returncode != 0:
            failed[name] = output.strip().splitlines()[-1]
    assert failed == {}
