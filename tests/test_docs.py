"""The guides' examples run, on two ranks, exactly as written.

``docs/migrating-from-ddp.md`` opens with a preamble that every example on the
page runs after. ``docs/hooks.md`` has no preamble of its own: its snippets use
``params`` and ``grads`` from the guide's text, which :data:`_HOOKS_PREAMBLE`
provides (the migration guide's preamble and one step's gradients).
"""

from __future__ import annotations

import inspect
import pathlib
import re

import pytest
from torch.nn.parallel import DistributedDataParallel

from tests._world import World

DOCS = pathlib.Path(__file__).parent.parent / "docs"
GUIDE = DOCS / "migrating-from-ddp.md"
HOOKS = DOCS / "hooks.md"


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


_TEXT = GUIDE.read_text()
_PREAMBLE, *_EXAMPLES = _blocks(_TEXT)

# hooks.md blocks that are not code to run, by their first line, with the reason.
_HOOKS_FRAGMENTS = {
    "class Hook(NamedTuple):": "the Hook type's signature, for reading (State is not a name)",
}
_HOOKS_PREAMBLE = _PREAMBLE[1] + "grads = grad_fn(params, batch())\n"
_HOOKS_EXAMPLES = [
    (heading, code)
    for heading, code in _blocks(HOOKS.read_text())
    if code.splitlines()[0] not in _HOOKS_FRAGMENTS
]


def _on_rank_snippet(preamble: str, code: str) -> None:
    namespace: dict = {"__name__": "docs_example"}
    exec(compile(preamble, "preamble", "exec"), namespace)
    exec(compile(code, "example", "exec"), namespace)


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
    ("heading", "code"),
    _HOOKS_EXAMPLES,
    ids=[f"{i}-{_slug(h)[:40]}" for i, (h, _) in enumerate(_HOOKS_EXAMPLES)],
)
def test_hooks_guide_snippet_runs(world: World, heading, code):
    world.run(_on_rank_snippet, _HOOKS_PREAMBLE, code, timeout=300)


def test_hooks_guide_fragments_exist():
    first_lines = {code.splitlines()[0] for _, code in _blocks(HOOKS.read_text())}
    assert set(_HOOKS_FRAGMENTS) <= first_lines  # a skip that matches nothing is stale
    assert len(_HOOKS_EXAMPLES) >= 8


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
