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

import copy
import re
from collections.abc import Iterator, Sequence
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
    language: str = ""  # code fence info (on every line of a code block)
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
    return list(iter_layout(text, owner))


def iter_layout(text: str, owner: Sequence[int] | None = None) -> Iterator[Block]:
    """`layout` one block at a time, so a long answer can be drawn in slices."""
    layouter = Layouter()
    pos = 0
    for line in text.split("\n"):
        yield from layouter.feed(text, owner, pos, pos + len(line))
        pos += len(line) + 1
    yield from layouter.finish()


class Layouter:
    """Turns lines into blocks, one line at a time; `finish()` after the last line.

    The state carried from line to line is small: an open fence, the previous line's
    kind (a paragraph's next line continues it), and a fence line whose block waits
    for the next line (its language goes to the first code line; with no code after
    it, it is an empty code block). `copy.copy` of a layouter is a cheap snapshot.
    """

    def __init__(self) -> None:
        self.fence: str | None = None
        self.language = ""  # of the open fence: every line of a code block carries it
        self.previous_kind = ""
        self.pending_fence: Block | None = None

    def feed(self, text: str, owner: Sequence[int] | None, start: int, end: int) -> list[Block]:
        """The blocks text[start:end] (one line, no newline) completes."""
        line = text[start:end]
        if self.fence is not None:
            if line.strip().startswith(self.fence) and set(line.strip()) <= set(self.fence[0]):
                self.fence = None
                self.previous_kind = "fence-end"
                return self.finish()
            runs = _plain(text, owner, start, end, code=True)
            block = Block("code", runs, language=self.language, first_in_group=False)
            self.previous_kind = "code"
            if self.pending_fence is not None:
                block.first_in_group = True
                self.pending_fence = None
            return [block]
        out = self.finish()
        match = _FENCE.match(line)
        if match:
            self.fence, self.language = match.group(1), match.group(2)
            self.pending_fence = Block("fence", [], language=self.language)
            self.previous_kind = "code-open"
        elif not line.strip():
            self.previous_kind = ""
        else:
            block = _line_block(text, owner, line, start, end, self.previous_kind)
            self.previous_kind = block.kind
            out.append(block)
        return out

    def finish(self) -> list[Block]:
        """A fence line with no code after it is an empty code block (or one streaming in)."""
        pending, self.pending_fence = self.pending_fence, None
        return [] if pending is None else [Block("code", [], language=pending.language)]


class LiveLayout:
    """The layout of a streaming answer, redone only from its last incomplete line.

    Complete lines are laid out once (their blocks never change again); each call of
    `blocks()` lays out just the tail, on a snapshot of the layouter, so a redraw of a
    long answer costs about the new tokens, not the whole answer.
    """

    def __init__(self, *, tokens: bool = True) -> None:
        self.text = ""
        self.owner: list[int] | None = [] if tokens else None  # None: plain text, no token runs
        self.token_count = 0
        self._layouter = Layouter()
        self._stable: list[Block] = []
        self._line_start = 0  # where the first not yet complete line starts

    @property
    def stable_count(self) -> int:
        """How many leading blocks of `blocks()` are final."""
        return len(self._stable)

    def extend(self, token_texts: Sequence[str]) -> None:
        for text in token_texts:
            if self.owner is not None:
                self.owner.extend([self.token_count] * len(text))
            self.text += text
            self.token_count += 1

    def stable_blocks(self) -> list[Block]:
        """The blocks that can no longer change (those of the complete lines so far)."""
        text, owner = self.text, self.owner
        end = text.rfind("\n")
        while self._line_start <= end:
            line_end = text.index("\n", self._line_start)
            self._stable += self._layouter.feed(text, owner, self._line_start, line_end)
            self._line_start = line_end + 1
        return self._stable

    def tail_blocks(self) -> list[Block]:
        """The blocks of the last, incomplete line, as if the text ended there."""
        tail = copy.copy(self._layouter)
        return tail.feed(self.text, self.owner, self._line_start, len(self.text)) + tail.finish()

    def blocks(self) -> list[Block]:
        return self.stable_blocks() + self.tail_blocks()


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


def markdown_sections(text: str) -> list[str]:
    """`text` cut at blank lines outside fenced code and around each fenced block, so that
    each part can be rendered (and a streaming answer re-rendered) on its own; a fence
    interrupts a paragraph in Markdown, so cutting there changes nothing."""
    sections: list[str] = []
    current: list[str] = []
    fence: str | None = None

    def cut() -> None:
        if current:
            sections.append("\n".join(current))
            current.clear()

    for line in text.split("\n"):
        if fence is not None:
            current.append(line)
            if line.strip().startswith(fence) and set(line.strip()) <= set(fence[0]):
                fence = None
                cut()
            continue
        match = _FENCE.match(line)
        if match:
            cut()
            fence = match.group(1)
            current.append(line)
        elif not line.strip():
            cut()
        else:
            current.append(line)
    cut()
    return sections


def is_fenced(section: str) -> bool:
    """A section of `markdown_sections` that is a fenced code block."""
    return _FENCE.match(section) is not None


def section_parts(section: str) -> list[Block | str]:
    """One Markdown section without token tints: fenced code is laid out as code blocks
    (one per line, syntax-coloured like the tinted view, so a streaming code block
    redraws only its last line); anything else stays Markdown for markdown-it."""
    return layout(section) if _FENCE.match(section) else [section]


def iter_plain_parts(text: str) -> Iterator[Block | str]:
    for section in markdown_sections(text):
        if _FENCE.match(section):
            yield from iter_layout(section)
        else:
            yield section
