"""The fenced blocks of the user-facing docs, as tests read them to run them as written."""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

SOURCE = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^```(\w*)\s*$")


@dataclass(frozen=True)
class DocBlock:
    """One fenced block: the document (relative to the source tree), its opening line, language and text."""

    doc: str
    line: int
    lang: str
    text: str

    @property
    def first_line(self) -> str:
        return self.text.splitlines()[0] if self.text else ""


def user_docs() -> list[str]:
    """The documents whose command blocks users copy: README, the workflow guides, every example's README."""
    examples = sorted(str(p.relative_to(SOURCE)) for p in (SOURCE / "examples").glob("*/README.md"))
    return ["README.md", "docs/snakemake.md", "docs/parsl.md", *examples]


def blocks_of(doc: str) -> list[DocBlock]:
    """Every fenced block of ``doc`` in order; an unclosed fence is an error in the document."""
    found, opened, lines = [], None, []
    for number, line in enumerate((SOURCE / doc).read_text().splitlines(), 1):
        fence = FENCE.match(line)
        if opened is None and fence:
            opened, lines = (number, fence.group(1)), []
        elif opened is not None and line.strip() == "```":
            found.append(DocBlock(doc, opened[0], opened[1], "\n".join(lines) + "\n"))
            opened = None
        elif opened is not None:
            lines.append(line)
    assert opened is None, f"{doc}:{opened[0]}: the fenced block is never closed"
    return found


def doc_block(doc: str, first_line: str) -> DocBlock:
    """The block of ``doc`` whose first line starts with ``first_line`` (the test fails if the docs lost it)."""
    matches = [block for block in blocks_of(doc) if block.first_line.startswith(first_line)]
    assert len(matches) == 1, f"{doc}: expected one block starting {first_line!r}, found {len(matches)}"
    return matches[0]
