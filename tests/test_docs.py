"""Every snippet in the docs runs, on two ranks, exactly as written.

Each ```` ```python ```` block of every page under ``docs/`` runs on a 2-rank gloo world
(every page's snippets sync, so none runs single-process), except the pages in
:data:`_NOT_RUN_HERE` and the fragments in :data:`_FRAGMENTS`, each with its reason:

- ``docs/migrating-from-ddp.md`` opens with a preamble that every example on the page
  runs after.
- ``docs/getting-started.md`` is one script (the page says so): its blocks run in order in
  one namespace, as ``torchrun`` runs the file. Its ``init_process_group("gloo")`` finds
  the world's group already joined, as it would find torchrun's environment.
- The other guides use names their prose takes as given (``params``, ``loss_fn``,
  ``batch``, one step's ``grads``, an optimizer's ``update`` and ``opt_state``), which
  :data:`_CONTEXT` provides: the migration guide's preamble, and one step of it.
"""

from __future__ import annotations

import inspect
import pathlib
import re
import sys
import types

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from tests._world import World

DOCS = pathlib.Path(__file__).parent.parent / "docs"
GUIDE = DOCS / "migrating-from-ddp.md"
GETTING_STARTED = DOCS / "getting-started.md"
ZERO_GUIDE = DOCS / "zero.md"  # run as one script, after the guides' preamble


def _blocks(text: str) -> list[tuple[str, str]]:
    """(heading, code) for each python block, the heading being the nearest one above."""
    out, heading = [], ""
    pattern = r"(^#{1,3} [^\n]*$|^```python\n.*?^```$)"
    for part in re.split(pattern, text, flags=re.M | re.S):
        if part.startswith("#"):
            heading = part.lstrip("#").strip()
        elif part.startswith("```python"):
            out.append((heading, part.removeprefix("```python\n").removesuffix("```")))
    return out


def _slug(heading: str) -> str:
    """The anchor mkdocs gives a heading (for the headings these pages use)."""
    return re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", heading.lower()).strip())


# Pages whose python blocks this file does not run, with the reason.
_NOT_RUN_HERE = {
    "api.md": "mkdocstrings directives only; the docstrings' examples run as doctests",
    "checkpoints.md": (
        "its recipe needs a directory every rank sees: tests/test_checkpoint.py runs it on "
        "1 to 4 ranks"
    ),
    "fault-tolerance.md": (
        "needs a lighthouse and replica processes: its step is examples/fault_tolerance.py's, "
        "which tests/test_examples.py runs with a replica killed"
    ),
}
# Blocks that are not code to run, by page and first line, with the reason.
_FRAGMENTS = {
    ("hooks.md", "class Hook(NamedTuple):"): (
        "the Hook type's signature, for reading (State is not a name)"
    ),
}

_TEXT = GUIDE.read_text()
_PREAMBLE, *_EXAMPLES = _blocks(_TEXT)
_CONTEXT = _PREAMBLE[1] + (
    "\n"
    "grads = grad_fn(params, batch())\n"
    "optimizer = fsync.optim.sgd(0.1)\n"
    "update, opt_state = optimizer.update, optimizer.init(params)\n"
    "batch = batch()  # from here on, this rank's batch\n"
)
# Pages run with _CONTEXT as their preamble.
_GUIDES = ("hooks.md", "compile.md", "torchrun.md", "index.md", "hierarchical.md", "diloco.md")
_SNIPPETS = [
    (page, heading, code)
    for page in _GUIDES
    for heading, code in _blocks((DOCS / page).read_text())
    if (page, code.splitlines()[0]) not in _FRAGMENTS
]


def _namespace() -> dict:
    """The globals of an example: a module of its own, importable as a script's
    ``__main__`` is (``torch.compile`` looks a function's module up by name)."""
    module = types.ModuleType("docs_example")
    sys.modules[module.__name__] = module
    return module.__dict__


def _on_rank_snippet(preamble: str, code: str, where: str = "example") -> None:
    namespace = _namespace()
    exec(compile(preamble, "preamble", "exec"), namespace)
    exec(compile(code, where, "exec"), namespace)


def _on_rank_script(page: str, blocks: list[tuple[str, str]]) -> None:
    """Runs a page's blocks in order in one namespace, as torchrun runs one file."""
    import torch.distributed as dist

    init_process_group = dist.init_process_group

    def joined(backend: str | None = None, *args, **kwargs) -> None:
        # torchrun's environment: here, the world's group, already joined.
        assert dist.is_initialized() and backend in (None, dist.get_backend()), backend

    dist.init_process_group = joined
    try:
        namespace = _namespace()
        for heading, code in blocks:
            exec(compile(code, f"{page}, {heading}", "exec"), namespace)
    finally:
        dist.init_process_group = init_process_group


@pytest.mark.parametrize("world", [2], indirect=True)
@pytest.mark.parametrize(("heading", "code"), _EXAMPLES, ids=[h for h, _ in _EXAMPLES])
def test_example_runs(world: World, heading, code):
    if "batched_grad_copy=" in code and (
        "batched_grad_copy" not in inspect.signature(DistributedDataParallel).parameters
    ):
        pytest.skip("this torch's DDP has no batched_grad_copy argument")
    world.run(_on_rank_snippet, _PREAMBLE[1], code, timeout=300)


@pytest.mark.parametrize("world", [2], indirect=True)
@pytest.mark.parametrize(
    ("page", "heading", "code"),
    _SNIPPETS,
    ids=[f"{p.removesuffix('.md')}-{i}-{_slug(h)[:40]}" for i, (p, h, _) in enumerate(_SNIPPETS)],
)
def test_guide_snippet_runs(world: World, page, heading, code):
    world.run(_on_rank_snippet, _CONTEXT, code, f"{page}, {heading}", timeout=300)


@pytest.mark.parametrize("world", [2], indirect=True)
def test_zero_guide_runs_as_one_script(world: World):
    blocks = _blocks(ZERO_GUIDE.read_text())
    assert len(blocks) >= 5
    world.run(_on_rank_script, ZERO_GUIDE.name, [("preamble", _CONTEXT), *blocks], timeout=300)


@pytest.mark.parametrize("world", [2], indirect=True)
def test_getting_started_runs_as_one_script(world: World):
    blocks = _blocks(GETTING_STARTED.read_text())
    assert len(blocks) >= 4
    world.run(_on_rank_script, GETTING_STARTED.name, blocks, timeout=300)


def test_getting_started_quotes_torchs_batchnorm_error():
    """The error the BatchNorm section quotes is the one torch.func raises without buffers."""
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    params = {n: p.detach() for n, p in model.named_parameters()}

    def loss_fn(params, x):
        return torch.func.functional_call(model, params, (x,)).sum()

    with pytest.raises(RuntimeError) as raised:
        torch.func.grad(loss_fn)(params, torch.randn(3, 4))
    section = GETTING_STARTED.read_text().split("## Models with buffers", 1)[1]
    quoted = re.search(r'\*"(.+?)"\*', section, flags=re.S)
    assert quoted and " ".join(quoted.group(1).split()) in str(raised.value)


def test_every_page_is_run():
    with_code = {page.name for page in DOCS.glob("*.md") if _blocks(page.read_text())}
    run = {GUIDE.name, GETTING_STARTED.name, ZERO_GUIDE.name, *_GUIDES}
    assert with_code - set(_NOT_RUN_HERE) <= run, "a page whose snippets no test runs"
    assert not run & set(_NOT_RUN_HERE)
    for page in _GUIDES:
        assert any(p == page for p, _, _ in _SNIPPETS), f"{page} has no snippet to run"


def test_fragments_exist():
    for page, first_line in _FRAGMENTS:  # a skip that matches nothing is stale
        assert first_line in {
            code.splitlines()[0] for _, code in _blocks((DOCS / page).read_text())
        }
    assert sum(p == "hooks.md" for p, _, _ in _SNIPPETS) >= 8


def test_every_row_links_to_an_example():
    anchors = {_slug(h) for h, _ in _EXAMPLES}
    table = _TEXT.split("## The table", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("| ")][1:]  # no header
    assert len(rows) >= 30
    for row in rows:
        example = row.rstrip(" |").rsplit("|", 1)[1]
        links = re.findall(r"\]\(#([\w-]+)\)", example)
        assert links, f"row without an example: {row}"
        assert set(links) <= anchors, (row, set(links) - anchors)


def test_docstrings_cross_reference_the_way_the_docs_site_renders():
    """mkdocstrings renders ``[fsync.x][]`` links; Sphinx roles would show as raw text."""
    package = pathlib.Path(__file__).parent.parent / "fsync"
    roles = re.compile(r":(func|class|meth|attr|data|mod|exc):`")
    found = [
        f"{path.relative_to(package.parent)}:{n}"
        for path in sorted(package.rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), start=1)
        if roles.search(line)
    ]
    assert not found, f"Sphinx roles in docstrings (write [fsync.name][] instead): {found}"
