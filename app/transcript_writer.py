"""Writes messages into the transcript's QTextDocument: headers, Markdown, tints.

Every writing method is a generator that yields between small pieces of work (a
block, a few dozen runs), so `TokenView` can spread a long conversation over many
event-loop turns and the UI thread never waits on a whole document. With
provenance on, an answer is laid out by `markup` (each character keeps its token:
tinted background, syntax colour in code, recorded in the `TokenIndex` for
hovering); with provenance off it is rendered by markdown-it, a section at a time.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from markdown_it import MarkdownIt
from PySide6.QtCore import Qt
from PySide6.QtGui import (
    QBrush,
    QColor,
    QFont,
    QFontDatabase,
    QTextBlockFormat,
    QTextCharFormat,
    QTextCursor,
    QTextFormat,
)

from .conversations import StoredMessage, StoredToken
from .highlight import Highlighter, Span
from .markup import Block, LiveLayout, Run, iter_plain_parts
from .theme import LIGHT_TINTS, Tints
from .token_index import TokenIndex

TOKEN_SOURCE = QTextFormat.Property.UserProperty + 1  # "accepted" | "corrected" | "bonus" | "target"
RUNS_PER_SLICE = 48  # a block with more runs than this yields in between
LINES_PER_SLICE = 200  # the same for the lines of a long user message
TOKENS_PER_LAYOUT = 256  # an answer is laid out this many tokens at a time
PAD = 10  # inset of a message's text from the edges (and of the user's bubble)
MESSAGE_GAP = 14  # space under each message (a margin: the user's bubble does not cover it)

Work = Iterator[None]  # a piece of writing, advanced one slice per next()


def run_all(work: Iterable[None]) -> None:
    """Do a piece of work at once (small ones: a header, a live redraw)."""
    for _ in work:
        pass


@dataclass
class WriterStyle:
    """What the writer needs to know about the look: tints, fonts, link colour, provenance."""

    tints: Tints = LIGHT_TINTS
    provenance: bool = True
    point_size: float = 10.0
    link_color: QColor = field(default_factory=lambda: QColor("#1d4ed8"))
    mono: QFont = field(default_factory=lambda: QFontDatabase.systemFont(QFontDatabase.SystemFont.FixedFont))
    highlighter: Highlighter = field(default_factory=Highlighter)


class TranscriptWriter:
    def __init__(self, index: TokenIndex, style: WriterStyle | None = None) -> None:
        self.index = index
        self.style = style or WriterStyle()
        self._markdown = MarkdownIt("commonmark", {"html": False}).enable("table")

    # -- messages -------------------------------------------------------------------------
    def write_message(self, cursor: QTextCursor, index: int, message: StoredMessage) -> Work:
        """Message `index` at the end of the document: header, body, footer, links.

        Messages are runs of blocks in the document's root frame, not frames of their
        own: Qt lays out a child frame whole after every change inside it, which made
        writing an answer cost quadratic time in its length."""
        cursor.movePosition(QTextCursor.MoveOperation.End)
        if message.role == "user":
            bubble = self.style.tints.user_bubble
            self.write_header(cursor, "You", bubble)
            for n, line in enumerate(message.content.split("\n"), 1):
                self.new_block(cursor, self._bubble_format(bubble))
                cursor.insertText(line, QTextCharFormat())
                if n % LINES_PER_SLICE == 0:
                    yield
        else:
            self.write_header(cursor, "Assistant" + (" (stopped)" if message.stopped else ""))
            yield from self.write_answer(cursor, message.tokens, message.content)
        self.write_message_end(cursor, index, message)
        cursor.movePosition(QTextCursor.MoveOperation.End)
        yield

    def write_answer(self, cursor: QTextCursor, tokens: Sequence[StoredToken], text: str) -> Work:
        if not self.style.provenance or not tokens:
            for part in iter_plain_parts(text):
                if isinstance(part, Block):
                    yield from self.write_block(cursor, part, ())
                else:
                    self.write_markdown(cursor, part)
                yield
            return
        # Laid out a chunk of tokens at a time: an answer of any length costs each slice
        # about the same.
        live = LiveLayout()
        written = 0
        for start in range(0, len(tokens), TOKENS_PER_LAYOUT):
            live.extend([t.text for t in tokens[start : start + TOKENS_PER_LAYOUT]])
            stable = live.stable_blocks()
            for block in stable[written:]:
                yield from self.write_block(cursor, block, tokens)
                yield
            written = len(stable)
        for block in live.tail_blocks():
            yield from self.write_block(cursor, block, tokens)

    def write_message_end(self, cursor: QTextCursor, index: int, message: StoredMessage) -> None:
        """The footer (answers) and the action links under a message."""
        if message.role == "user":
            actions = [("copy", "Copy"), ("edit", "Edit and resend")]
            self.write_actions(cursor, index, actions, self.style.tints.user_bubble)
            return
        if message.footer:
            self.write_muted(cursor, message.footer)
        self.write_actions(cursor, index, [("copy", "Copy"), ("regenerate", "Regenerate")])

    @staticmethod
    def _bubble_format(bubble: QColor | None) -> QTextBlockFormat:
        fmt = QTextBlockFormat()
        if bubble is not None:
            fmt.setBackground(bubble)
        return fmt

    # -- small blocks ---------------------------------------------------------------------
    def new_block(self, cursor: QTextCursor, block: QTextBlockFormat) -> None:
        """Start a block (inset by PAD), reusing the empty one a fresh document starts with."""
        block.setLeftMargin(block.leftMargin() + PAD)
        block.setRightMargin(PAD)
        if cursor.block().length() <= 1 and cursor.atBlockStart() and cursor.block().userState() == -1:
            cursor.setBlockFormat(block)
        else:
            cursor.insertBlock(block)
        cursor.block().setUserState(1)

    def write_header(self, cursor: QTextCursor, text: str, bubble: QColor | None = None) -> None:
        block = self._bubble_format(bubble)
        if bubble is None:  # inside the bubble, margins would show as unpainted stripes
            block.setBottomMargin(4)
        self.new_block(cursor, block)
        fmt = QTextCharFormat()
        fmt.setFontWeight(QFont.Weight.DemiBold)
        fmt.setForeground(self.style.tints.muted_text)
        cursor.insertText(text, fmt)

    def write_muted(self, cursor: QTextCursor, text: str) -> None:
        block = QTextBlockFormat()
        block.setTopMargin(6)
        self.new_block(cursor, block)
        fmt = QTextCharFormat()
        fmt.setForeground(self.style.tints.muted_text)
        fmt.setFontPointSize(max(7.0, self.style.point_size * 0.9))
        cursor.insertText(text, fmt)

    def write_actions(
        self, cursor: QTextCursor, index: int, actions: list[tuple[str, str]], bubble: QColor | None = None
    ) -> None:
        block = self._bubble_format(bubble)
        if bubble is None:
            block.setTopMargin(4)
        block.setBottomMargin(MESSAGE_GAP)
        self.new_block(cursor, block)
        for n, (action, label) in enumerate(actions):
            if n:
                cursor.insertText("   ", QTextCharFormat())
            fmt = QTextCharFormat()
            fmt.setAnchor(True)
            fmt.setAnchorHref(f"action:{action}:{index}")
            fmt.setForeground(self.style.link_color)
            fmt.setFontPointSize(max(7.0, self.style.point_size * 0.9))
            cursor.insertText(label, fmt)

    def write_placeholder(self, cursor: QTextCursor, text: str) -> None:
        fmt = QTextCharFormat()
        fmt.setForeground(self.style.tints.muted_text)
        block = QTextBlockFormat()
        block.setAlignment(Qt.AlignmentFlag.AlignCenter)
        block.setTopMargin(60)
        cursor.setBlockFormat(block)
        cursor.insertText(text, fmt)

    def write_markdown(self, cursor: QTextCursor, section: str, starts: list[int] | None = None) -> None:
        """One section of an answer (see markup.markdown_sections), rendered as HTML."""
        self.new_block(cursor, QTextBlockFormat())
        if starts is not None:
            starts.append(cursor.block().position())
        cursor.insertHtml(self._markdown.render(section))

    # -- answer blocks (provenance on) ----------------------------------------------------
    def write_block(
        self,
        cursor: QTextCursor,
        block: Block,
        tokens: Sequence[StoredToken],
        starts: list[int] | None = None,
    ) -> Work:
        """One laid-out block; its start position goes to `starts` when given (the live answer)."""
        self.new_block(cursor, self._block_format(block))
        if starts is not None:
            starts.append(cursor.block().position())
        if block.kind in ("bullet", "ordered"):
            prefix = "•  " if block.kind == "bullet" else f"{block.number}.  "
            cursor.insertText(prefix, self._base_format(block))
        yield from self.write_runs(cursor, block, block.runs, tokens)

    def write_runs(
        self, cursor: QTextCursor, block: Block, runs: Sequence[Run], tokens: Sequence[StoredToken]
    ) -> Work:
        """`runs` of `block` at the cursor (the whole block, or the runs it grew by)."""
        spans: list[Span] = []
        offset = 0
        if block.kind == "code":
            spans = self.style.highlighter.spans(block.language, block.text)
            offset = len(block.text) - sum(len(r.text) for r in runs)  # where `runs` start in the line
        for n, run in enumerate(runs, 1):
            self._insert_run(cursor, block, run, tokens, spans, offset)
            offset += len(run.text)
            if n % RUNS_PER_SLICE == 0:
                yield

    def _block_format(self, block: Block) -> QTextBlockFormat:
        fmt = QTextBlockFormat()
        if block.kind == "code":
            fmt.setBackground(self.style.tints.code_background)
            fmt.setLeftMargin(4)
            fmt.setTopMargin(6 if block.first_in_group else 0)
            fmt.setNonBreakableLines(True)
        elif block.kind == "heading":
            fmt.setTopMargin(10)
            fmt.setBottomMargin(4)
        elif block.kind in ("bullet", "ordered"):
            fmt.setLeftMargin(14 + 18 * block.level)
            fmt.setTopMargin(2)
        elif block.kind == "quote":
            fmt.setLeftMargin(16)
        elif block.kind == "rule":
            fmt.setProperty(QTextFormat.Property.BlockTrailingHorizontalRulerWidth, 1)
        else:
            fmt.setTopMargin(8 if block.first_in_group else 0)
        return fmt

    def _base_format(self, block: Block) -> QTextCharFormat:
        base = QTextCharFormat()
        if block.kind == "code":
            base.setFont(self.style.mono)
        elif block.kind == "heading":
            base.setFontWeight(QFont.Weight.Bold)
            base.setFontPointSize(self.style.point_size * (1.5 - 0.1 * min(block.level, 5)))
        elif block.kind == "quote":
            base.setForeground(self.style.tints.muted_text)
        return base

    def _insert_run(
        self,
        cursor: QTextCursor,
        block: Block,
        run: Run,
        tokens: Sequence[StoredToken],
        spans: Sequence[Span],
        offset: int,
    ) -> None:
        char = self._base_format(block)
        if run.code:
            char.setFont(self.style.mono)
            if block.kind != "code":
                char.setBackground(self.style.tints.code_background)
        if run.bold:
            char.setFontWeight(QFont.Weight.Bold)
        if run.italic:
            char.setFontItalic(True)
        token = tokens[run.token] if run.token is not None and run.token < len(tokens) else None
        if token is not None:
            self._tint(char, token)
        start = cursor.position()
        if spans:
            self._insert_colored(cursor, run.text, char, spans, offset)
        else:
            cursor.insertText(run.text, char)
        if token is not None:
            self.index.add(start, cursor.position(), token)

    @staticmethod
    def _insert_colored(
        cursor: QTextCursor, text: str, char: QTextCharFormat, spans: Sequence[Span], offset: int
    ) -> None:
        """`text` (at `offset` in its code line) cut where the syntax colour changes."""
        end = offset + len(text)
        position = offset
        for start, stop, color in spans:
            if stop <= position or start >= end:
                continue
            if start > position:
                cursor.insertText(text[position - offset : start - offset], char)
                position = start
            piece = QTextCharFormat(char)
            piece.setForeground(QColor(color))
            cursor.insertText(text[position - offset : min(stop, end) - offset], piece)
            position = min(stop, end)
        if position < end:
            cursor.insertText(text[position - offset :], char)

    def _tint(self, char: QTextCharFormat, token: StoredToken) -> None:
        tints = self.style.tints
        char.setProperty(TOKEN_SOURCE, token.source)
        color = tints.for_source(token.source)
        if color is not None:
            char.setBackground(QBrush(color))
        if token.source == "corrected":
            # Not by colour alone: corrections are also underlined.
            char.setUnderlineStyle(QTextCharFormat.UnderlineStyle.SingleUnderline)
            char.setUnderlineColor(tints.corrected_line)
