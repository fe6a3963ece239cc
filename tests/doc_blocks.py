"""The fenced code blocks of README.md and docs/*.md, each with the marker that says how it is
tested: tests/test_docs_examples.py runs or checks every one.

A marker is an HTML comment on the line right above the fence:
`<!-- example: not run (REASON) -->`, `<!-- example: synopsis -->` (a usage summary) or
`<!-- example: POST /route -->` (a JSON block that is that route's request body).
"""

from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOC_FILES = (REPO / "README.md", *sorted((REPO / "docs").glob("*.md")))
DOC_URL = "http://127.0.0.1:8080"  # where the docs say the daemon listens

_FENCE = re.compile(r"^\s*(```+|~~~+)\s*([^\s`]*)\s*$")
_MARKER = re.compile(r"^\s*<!-- example: (.+?) -->\s*$")
_NOT_RUN = re.compile(r"not run \((.+)\)")


@dataclass(frozen=True)
class Block:
    path: Path
    index: int  # its place among its file's blocks, from 0
    line: int  # the line of its opening fence, from 1
    lang: str  # what the fence names ("" for none)
    text: str
    marker: str  # what `<!-- example: ... -->` right above the fence says ("" for none)

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(REPO)}-{self.index}"

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}"

    @property
    def not_run(self) -> str | None:
        """The reason a `not run (REASON)` marker gives, else None."""
        m = _NOT_RUN.fullmatch(self.marker)
        return m.group(1) if m else None


def blocks_of(path: Path) -> list[Block]:
    lines = path.read_text().splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        fence, lang = opening.groups()
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == fence), None)
        if end is None:
            raise ValueError(f"{path}:{i + 1}: a code block that is never closed")
        marker = _MARKER.match(lines[i - 1]) if i > 0 else None
        text = textwrap.dedent("\n".join(lines[i + 1 : end]) + "\n")  # a list item's, indented
        found.append(Block(path, len(found), i + 1, lang, text, marker.group(1) if marker else ""))
        i = end + 1
    return found


def all_blocks() -> list[Block]:
    return [b for path in DOC_FILES for b in blocks_of(path)]
