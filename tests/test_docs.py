"""The migration guide's examples run, on two ranks, exactly as written."""

from __future__ import annotations

import pathlib
import re

import pytest

from tests._world import World

GUIDE = pathlib.Path(__file__).parent.parent / "docs" / "migrating-from-ddp.md"


def _blocks(text: str) -> list[tuple[str, str]]:
    """(heading, code) for each python block, the heading being the nearest one above."""
    out, heading = [], ""
    pattern = r"(^#{2,3} [^\n]*$|^```python\n.*?^```$)"
    for part in re.split(pattern, text, flags=re.M | re.S):
        if part.startswith("#"):
            heading = part.lstrip("#").strip()
        elif part.startswith("```python"):
            out.append((heading, part.removeprefix("```python\n").removesuffix("```")))
    return out


_TEXT = GUIDE.read_text()
_PREAMBLE, *_EXAMPLES = _blocks(_TEXT)


def _on_rank_snippet(preamble: str, code: str) -> None:
    namespace: dict = {"__name__": "docs_example"}
    exec(compile(preamble, "preamble", "exec"), namespace)
    exec(compile(code, "example", "exec"), namespace)


@pytest.mark.parametrize("world", [2], indirect=True)
@pytest.mark.parametrize(("heading", "code"), _EXAMPLES, ids=[h for h, _ in _EXAMPLES])
def test_example_runs(world: World, heading, code):
    world.run(_on_rank_snippet, _PREAMBLE[1], code, timeout=300)


def test_every_row_links_to_an_example():
    anchors = {h.lower().replace(" ", "-") for h, _ in _EXAMPLES}
    links = set(re.findall(r"\]\(#([a-z-]+)\)", _TEXT))
    assert links and links <= anchors, links - anchors
    rows = [
        line for line in _TEXT.splitlines() if line.startswith("| `") or line.startswith("| sparse")
    ]
    assert len(rows) >= 25
