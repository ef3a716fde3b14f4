"""Markdown laid out as blocks of runs that remember which token each character came from.

The provenance view tints every token, so it cannot hand the answer to a Markdown
to HTML converter (which forgets where characters came from). Instead this small
line-based layout keeps, for every visible character, the index of the token that
produced it. It covers what chat answers use: fenced code (an unclosed fence while
streaming is code to the end), headings, bullet and numbered lists, quotes, rules,
paragraphs, and inline `code`, **bold** and *italic*. Markup characters are hidden.
Qt-free so it can be tested on plain strings; `token_view` turns it into a document.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

_FENCE = re.compile(r"^\s{0,3}(`{3,}|~{3,})\s*([\w+#.-]*)")
_HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+")
_BULLET = re.compile(r"^(\s*)[-*+]\s+")
_ORDERED = re.compile(r"^(\s*)(\d{1,9})[.)]\s+")
_QUOTE = re.compile(r"^\s{0,3}>\s?")
_RULE = re.compile(r"^\s{0,3}([-*_])(\s*\1){2,}\s*$")
# Inline spans, tried in this order at each position: code wins over emphasis.
_INLINE = re.compile(
    r"(`+)(.+?)\1|\*\*(.+?)\*\*|__(.+?)__|\*(?!\s)(.+?)(?<!\s)\*|(?<!\w)_(?!\s)(.+?)(?<!\s)_(?!\w)"
)


@dataclass(frozen=True)
class Run:
    """Consecutive characters with one token and one style."""

    text: str
    token: int | None  # index of the token the characters came from
    code: bool = False
    bold: bool = False
    italic: bool = False


@dataclass
class Block:
    kind: str  # paragraph | heading | code | bullet | ordered | quote | rule
    runs: list[Run] = field(default_factory=list)
    level: int = 0  # heading level, or list nesting depth
    number: int = 0  # ordered list item number
    language: str = ""  # code fence info
    first_in_group: bool = True  # False for the 2nd+ line of a paragraph or code block

    @property
    def text(self) -> str:
        return "".join(r.text for r in self.runs)


def owners(token_texts: Sequence[str]) -> list[int]:
    """For each character of the concatenated text, the index of its token."""
    out: list[int] = []
    for i, text in enumerate(token_texts):
        out.extend([i] * len(text))
    return out


def layout(text: str, owner: Sequence[int] | None = None) -> list[Block]:
    """Blocks of runs for `text`; `owner[i]` is the token of character i (None: no tokens)."""
    blocks: list[Block] = []
    fence: str | None = None
    previous_kind = ""
    pos = 0
    for line in text.split("\n"):
        start, end = pos, pos + len(line)
        pos = end + 1
        if fence is not None:
            if line.strip().startswith(fence) and set(line.strip()) <= set(fence[0]):
                fence = None
                previous_kind = "fence-end"
                continue
            blocks.append(Block("code", _plain(text, owner, start, end, code=True), first_in_group=False))
            previous_kind = "code"
            continue
        match = _FENCE.match(line)
        if match:
            fence = match.group(1)
            blocks.append(Block("fence", [], language=match.group(2)))  # the fence line itself
            previous_kind = "code-open"
            continue
        if not line.strip():
            previous_kind = ""
            continue
        block = _line_block(text, owner, line, start, end, previous_kind)
        blocks.append(block)
        previous_kind = block.kind
    # Drop the empty opening line of a fence that got content: it only carried the language.
    return _merge_fence_openers(blocks)


def _merge_fence_openers(blocks: list[Block]) -> list[Block]:
    out: list[Block] = []
    for i, block in enumerate(blocks):
        nxt = blocks[i + 1] if i + 1 < len(blocks) else None
        if block.kind == "fence":
            if nxt is not None and nxt.kind == "code" and not nxt.first_in_group:
                nxt.first_in_group = True
                nxt.language = block.language
                continue
            block.kind = "code"  # an empty code block (or one whose first line is streaming in)
        out.append(block)
    return out


def _line_block(
    text: str, owner: Sequence[int] | None, line: str, start: int, end: int, previous_kind: str
) -> Block:
    if _RULE.match(line):
        return Block("rule")
    match = _HEADING.match(line)
    if match:
        return Block("heading", _inline(text, owner, start + match.end(), end), level=len(match.group(1)))
    match = _BULLET.match(line)
    if match:
        depth = len(match.group(1).expandtabs(4)) // 2
        return Block("bullet", _inline(text, owner, start + match.end(), end), level=depth)
    match = _ORDERED.match(line)
    if match:
        depth = len(match.group(1).expandtabs(4)) // 2
        runs = _inline(text, owner, start + match.end(), end)
        return Block("ordered", runs, level=depth, number=int(match.group(2)))
    match = _QUOTE.match(line)
    if match:
        return Block("quote", _inline(text, owner, start + match.end(), end))
    stripped = len(line) - len(line.lstrip())
    continues = previous_kind == "paragraph"
    return Block("paragraph", _inline(text, owner, start + stripped, end), first_in_group=not continues)


def _plain(
    text: str,
    owner: Sequence[int] | None,
    start: int,
    end: int,
    *,
    code: bool = False,
    bold: bool = False,
    italic: bool = False,
) -> list[Run]:
    """text[start:end] cut into runs wherever the owning token changes."""
    runs: list[Run] = []
    i = start
    while i < end:
        token = owner[i] if owner is not None and i < len(owner) else None
        j = i + 1
        while j < end and (owner[j] if owner is not None and j < len(owner) else None) == token:
            j += 1
        runs.append(Run(text[i:j], token, code=code, bold=bold, italic=italic))
        i = j
    return runs


def _inline(text: str, owner: Sequence[int] | None, start: int, end: int) -> list[Run]:
    runs: list[Run] = []
    segment = text[start:end]
    cursor = 0
    for match in _INLINE.finditer(segment):
        runs += _plain(text, owner, start + cursor, start + match.start())
        group = next(g for g in range(2, 7) if match.group(g) is not None)
        inner_start, inner_end = start + match.start(group), start + match.end(group)
        style = {2: "code", 3: "bold", 4: "bold", 5: "italic", 6: "italic"}[group]
        runs += _plain(text, owner, inner_start, inner_end, **{style: True})
        cursor = match.end()
    runs += _plain(text, owner, start + cursor, end)
    return runs
