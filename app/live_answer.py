"""The end of the transcript, where a streaming answer is drawn.

Redraws touch only what changed: the layout is redone from the answer's last
incomplete line (`markup.LiveLayout`), blocks before it are never rewritten, and
a block that only grew gets its new runs appended. When the answer is done, what
is drawn stays — its tokens are the finished message's tokens — and gets the
footer and action links: finishing costs the same at any length. Nothing is
written after the live answer while it streams, so it always ends the document.
"""

from __future__ import annotations

from collections.abc import Sequence

from PySide6.QtGui import QTextCursor, QTextDocument

from .conversations import StoredMessage, StoredToken
from .markup import Block, LiveLayout, is_fenced, markdown_sections, section_parts
from .transcript_writer import TranscriptWriter, Work, run_all


class LiveAnswer:
    def __init__(self, document: QTextDocument, writer: TranscriptWriter) -> None:
        self.document = document
        self._writer = writer
        self.active = False  # its header is in the document
        self.header = ""
        self.tokens: list[StoredToken] = []
        self._layout = LiveLayout()
        self._drawn: list[Block] | list[Block | str] = []  # what is drawn: blocks, or plain parts
        self._starts: list[int] = []  # document position where each drawn part starts
        self._stable = 0  # leading drawn parts that can no longer change
        self._final_sections: dict[str, list[Block | str]] = {}  # plain view: laid out once
        self._code: tuple[int, LiveLayout] | None = None  # plain view: the code block being written

    def begin(self, header: str) -> None:
        """Write the header at the end of the document (the tokens are kept, see `set_tokens`)."""
        self.header = header
        self._writer.write_header(self._end_cursor(), header)
        self.active = True
        self._layout = LiveLayout()
        self._final_sections = {}
        self._code = None
        self._drawn, self._starts, self._stable = [], [], 0

    def set_tokens(self, tokens: Sequence[StoredToken]) -> None:
        """The answer's tokens so far (drawn at the next `redraw`)."""
        known = len(self.tokens)
        if len(tokens) < known or (known and tokens[known - 1] is not self.tokens[-1]):
            self._layout = LiveLayout()  # not a continuation of what is drawn: lay out afresh
            self._stable = 0
            self._code = None
        self.tokens = list(tokens)

    def reset(self) -> None:
        self.active = False
        self.tokens = []
        self._layout = LiveLayout()
        self._final_sections = {}
        self._code = None
        self._drawn, self._starts, self._stable = [], [], 0

    def redraw(self) -> None:
        """Draw the tokens not drawn yet (a streaming redraw: a few dozen of them)."""
        run_all(self.catch_up(step=len(self.tokens) or 1))

    def catch_up(self, step: int = 64) -> Work:
        """Draw the undrawn tokens `step` at a time, yielding in between (a long answer
        redrawn after a theme switch, or a fast one finishing between two redraws)."""
        while self.active and self._layout.token_count < len(self.tokens):
            done = self._layout.token_count
            self._layout.extend([t.text for t in self.tokens[done : done + step]])
            if self._writer.style.provenance:
                self._update(self._layout.blocks(), self._layout.stable_count)
            else:
                self._update(*self._plain_parts())
            yield

    def _plain_parts(self) -> tuple[list[Block | str], int]:
        """The parts without tints, and how many are final: every section but the last is,
        and its parts are kept instead of being laid out again. A code block still being
        written (the last section) is laid out incrementally, like the tinted view."""
        text = self._layout.text
        sections = markdown_sections(text)
        parts: list[Block | str] = []
        for section in sections[:-1]:
            if section not in self._final_sections:
                self._final_sections[section] = self._finish_code(section) or section_parts(section)
            parts += self._final_sections[section]
        stable = len(parts)
        if not sections:
            return parts, stable
        last = sections[-1]
        if not is_fenced(last):
            return [*parts, last], stable
        start = text.rindex(last)
        if self._code is None or self._code[0] != start or not last.startswith(self._code[1].text):
            self._code = (start, LiveLayout(tokens=False))
        code = self._code[1]
        code.extend([text[start + len(code.text) : start + len(last)]])
        return parts + list(code.blocks()), stable

    def _finish_code(self, section: str) -> list[Block | str]:
        """The blocks of the code block that was being written, if `section` is it (its
        last lines may have come with the text after it)."""
        code, self._code = self._code, None
        if code is None or not code[1].text or not section.startswith(code[1].text):
            return []
        code[1].extend([section[len(code[1].text) :]])
        return list(code[1].blocks())

    def finish(self, index: int, message: StoredMessage) -> Work:
        """Draw what is left, then the footer and links of message `index`; the drawing stays."""
        self.set_tokens(message.tokens)
        yield from self.catch_up()
        if self.active:
            self._writer.write_message_end(self._end_cursor(), index, message)
        self.reset()
        yield

    # -- drawing the difference ---------------------------------------------------------------
    def _update(self, parts: list[Block] | list[Block | str], stable: int) -> None:
        old = self._drawn
        same = min(self._stable, len(old), len(parts))
        while same < min(len(old), len(parts)) and old[same] == parts[same]:
            same += 1
        self._stable = min(stable, same)
        if same == len(old) == len(parts):
            return
        first_new = same
        grown = same < len(old) and same < len(parts) and _grew(old[same], parts[same])
        if grown:
            block, before = parts[same], old[same]
            assert isinstance(block, Block) and isinstance(before, Block)
            new_runs = block.runs[len(before.runs) :]
            run_all(self._writer.write_runs(self._end_cursor(), block, new_runs, self.tokens))
            first_new = same + 1
        else:
            self._remove_from(same)
        cursor = self._end_cursor()
        del self._starts[first_new:]
        for part in parts[first_new:]:
            if isinstance(part, Block):
                run_all(self._writer.write_block(cursor, part, self.tokens, self._starts))
            else:
                self._writer.write_markdown(cursor, part, self._starts)
        self._drawn = list(parts)

    def _end_cursor(self) -> QTextCursor:
        cursor = QTextCursor(self.document)
        cursor.movePosition(QTextCursor.MoveOperation.End)
        return cursor

    def _remove_from(self, part: int) -> None:
        """Remove what is drawn from part `part` on (it all ends the document)."""
        if part >= len(self._starts):
            return  # nothing is drawn from there on
        start, end = self._starts[part], self._end_cursor().position()
        # start == end is an empty last block (a code fence whose first line has not come):
        # its separator must still go.
        cursor = QTextCursor(self.document)
        # A block start is preceded by its block separator: remove that too, so that the
        # next insertBlock() does not leave an empty line behind.
        cursor.setPosition(start - 1)  # the header block always comes first, so start > its start
        cursor.setPosition(end, QTextCursor.MoveMode.KeepAnchor)
        cursor.removeSelectedText()
        self._writer.index.cut(cursor.position())
        del self._starts[part:]


def _grew(old: Block | str, new: Block | str) -> bool:
    """`new` is `old` with more runs after it (the streaming case); code lines are redrawn
    whole instead, because a longer line can change the syntax colour of its start."""
    if not isinstance(old, Block) or not isinstance(new, Block) or new.kind == "code":
        return False
    return (
        (old.kind, old.level, old.number, old.language, old.first_in_group)
        == (new.kind, new.level, new.number, new.language, new.first_in_group)
        and len(new.runs) > len(old.runs)
        and new.runs[: len(old.runs)] == old.runs
    )
