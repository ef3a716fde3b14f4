"""The docs' relative links: every file, figure and heading a link names exists.

A link is `[text](target)` or `![alt](target)` outside fenced code. Links to other sites
(`scheme:`) are not followed. A `#anchor` must name a heading of its target, spelled as
GitHub spells heading anchors.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

_FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.MULTILINE)
_SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def _prose(text: str) -> str:
    return _FENCE.sub("", text)


def _links(text: str) -> list[str]:
    return [target for target in _LINK.findall(_prose(text)) if not _SCHEME.match(target)]


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(markdown: Path) -> set[str]:
    seen: dict[str, int] = {}
    anchors = set()
    for heading in _HEADING.findall(_prose(markdown.read_text(encoding="utf-8"))):
        base = _anchor(heading)
        count = seen.get(base, 0)
        seen[base] = count + 1
        anchors.add(base if count == 0 else f"{base}-{count}")
    return anchors


def broken_links(doc: Path) -> list[str]:
    """The links of `doc` whose file, or heading in a Markdown file, does not exist."""
    broken = []
    for target in _links(doc.read_text(encoding="utf-8")):
        path_part, _, anchor = target.partition("#")
        path = (doc.parent / path_part).resolve() if path_part else doc
        if not path.exists() or (anchor and path.suffix == ".md" and anchor not in _anchors(path)):
            broken.append(target)
    return broken


@pytest.mark.parametrize("doc", DOCS, ids=lambda doc: str(doc.relative_to(ROOT)))
def test_every_relative_link_in_the_docs_points_at_something_that_exists(doc: Path) -> None:
    assert broken_links(doc) == []


def test_a_link_to_a_missing_file_or_heading_is_reported(tmp_path: Path) -> None:
    (tmp_path / "other.md").write_text("# A heading (`with_code`)\n\ntext\n", encoding="utf-8")
    (tmp_path / "figure.png").write_bytes(b"")
    doc = tmp_path / "doc.md"
    doc.write_text(
        "# Top\n"
        "[ok](other.md#a-heading-with_code) ![ok](figure.png) [ok](#top) [web](https://example.org/x)\n"
        "[gone](missing.md#top) ![gone](bench-results/gone.json) [bad anchor](other.md#nowhere) [bad](#none)\n"
        "```\n[in code](not-a-link.md)\n```\n",
        encoding="utf-8",
    )
    assert broken_links(doc) == ["missing.md#top", "bench-results/gone.json", "other.md#nowhere", "#none"]


def test_repeated_headings_take_numbered_anchors(tmp_path: Path) -> None:
    doc = tmp_path / "doc.md"
    doc.write_text("## Beside a busy process\n\n## Beside a busy process\n", encoding="utf-8")
    assert _anchors(doc) == {"beside-a-busy-process", "beside-a-busy-process-1"}
