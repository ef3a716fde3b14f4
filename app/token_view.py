"""The transcript: messages rendered as Markdown, answer tokens tinted by provenance.

One `QTextBrowser` shows the whole conversation (its object name is
`transcriptView`; its viewport, where the tokens are drawn and hovered, is
`tokenView`). Finished messages are rendered once; while an answer streams only
its own frame at the end is redrawn, at most every `LIVE_REFRESH_MS`, so a long
conversation costs the UI thread the same per update as a short one.

With provenance on, answers are laid out by `markup.layout`, which keeps each
character's token so it can be tinted and hovered; every token's char format
carries its message and token index. With provenance off, answers go through
markdown-it (tables, links, nested lists) as plain rendered Markdown.
"""

from __future__ import annotations

import bisect
import html
from collections.abc import Sequence

from markdown_it import MarkdownIt
from PySide6.QtCore import QEvent, QPoint, Qt, QTimer, QUrl, Signal
from PySide6.QtGui import (
    QBrush,
    QFont,
    QFontDatabase,
    QTextBlockFormat,
    QTextCharFormat,
    QTextCursor,
    QTextDocument,
    QTextFormat,
    QTextFrame,
    QTextFrameFormat,
)
from PySide6.QtWidgets import QTextBrowser, QToolTip, QWidget

from .conversations import StoredMessage, StoredToken
from .markup import Block, Run, layout, owners
from .theme import LIGHT_TINTS, Tints

LIVE_REFRESH_MS = 40  # ~25 redraws a second look smooth and leave the UI thread idle
TOKEN_SOURCE = QTextFormat.Property.UserProperty + 1  # "accepted" | "corrected" | "bonus" | "target"
_REF_BASE = 2**20  # a token ref is message index * _REF_BASE + token index (negative: live answer)

SOURCE_WORDS = {
    "accepted": "accepted draft token: the target agreed with the draft",
    "corrected": "correction: the target replaced a rejected draft token",
    "bonus": "bonus token: the target's extra token after a fully accepted draft",
    "target": "target token: a plain target step, no speculation",
}


def token_tooltip(token: StoredToken) -> str:
    """What hovering a token shows: its text, step, source and probabilities when known."""
    lines = [
        f"<b>{html.escape(repr(token.text))}</b>",
        f"step {token.step} · {html.escape(SOURCE_WORDS.get(token.source, token.source))}",
    ]
    probs = []
    if token.target_prob is not None:
        probs.append(f"target p = {token.target_prob:.3f}")
    if token.draft_prob is not None:
        probs.append(f"draft p = {token.draft_prob:.3f}")
    if probs:
        lines.append(" · ".join(probs))
    return "<br>".join(lines)


class TokenView(QTextBrowser):
    """The conversation, with links for message actions and per-token tooltips."""

    actionRequested = Signal(str, int)  # ("copy" | "edit" | "regenerate", message index)

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("transcriptView")
        self.viewport().setObjectName("tokenView")
        self.setOpenLinks(False)
        self.setOpenExternalLinks(False)
        self.anchorClicked.connect(self._on_anchor)
        self.viewport().setMouseTracking(True)
        self._tints: Tints = LIGHT_TINTS
        self._provenance = True
        self._messages: list[StoredMessage] = []
        self._live_tokens: list[StoredToken] = []
        self._live_frame: QTextFrame | None = None
        self._live_header = ""
        self._live_blocks: list[Block] = []  # what the live frame shows, block by block
        self._live_block_starts: list[int] = []  # document position where each of them starts
        # (start, end, token ref) of every tinted run, in document order. Token identity lives
        # here, not in the char formats: a format per token would make every format unique
        # and the document's format table (and layout time) grow with every redraw.
        self._runs: list[tuple[int, int, int]] = []
        self._live_timer = QTimer(self)
        self._live_timer.setSingleShot(True)
        self._live_timer.setInterval(LIVE_REFRESH_MS)
        self._live_timer.timeout.connect(self._redraw_live)
        self._markdown = MarkdownIt("commonmark", {"html": False}).enable("table")
        self._mono = QFontDatabase.systemFont(QFontDatabase.SystemFont.FixedFont)
        self._placeholder = ""
        self.document().setDocumentMargin(14)

    # -- configuration ------------------------------------------------------------------
    def set_tints(self, tints: Tints) -> None:
        self._tints = tints
        self._apply_stylesheet()
        self.render_messages(self._messages)

    def set_provenance(self, on: bool) -> None:
        self._provenance = on
        self.render_messages(self._messages)

    def provenance(self) -> bool:
        return self._provenance

    def set_placeholder(self, text: str) -> None:
        """Shown when the conversation is empty (what to do next)."""
        self._placeholder = text
        if not self._messages and self._live_frame is None:
            self.render_messages([])

    # -- rendering ------------------------------------------------------------------------
    def render_messages(self, messages: Sequence[StoredMessage]) -> None:
        """Rebuild the document from the finished messages (and the live answer, if any)."""
        self._messages = list(messages)
        live = self._live_frame is not None
        self.document().clear()
        self._apply_stylesheet()
        self._live_frame = None
        self._runs = []
        cursor = QTextCursor(self.document())
        if not self._messages and not live and self._placeholder:
            fmt = QTextCharFormat()
            fmt.setForeground(self._tints.muted_text)
            block = QTextBlockFormat()
            block.setAlignment(Qt.AlignmentFlag.AlignCenter)
            block.setTopMargin(60)
            cursor.setBlockFormat(block)
            cursor.insertText(self._placeholder, fmt)
            return
        for index, message in enumerate(self._messages):
            self._insert_message(cursor, index, message)
        if live:
            self.begin_live(self._live_header, keep_tokens=True)
        self._scroll_to_end()

    def begin_live(self, header: str, keep_tokens: bool = False) -> None:
        """Open the frame the streaming answer is drawn into."""
        self._live_header = header
        if not keep_tokens:
            self._live_tokens = []
        if not self._messages and self._placeholder and self._live_frame is None:
            self.document().clear()
        cursor = QTextCursor(self.document())
        cursor.movePosition(QTextCursor.MoveOperation.End)
        self._live_frame = cursor.insertFrame(self._message_frame_format("assistant"))
        self._live_blocks, self._live_block_starts = [], []
        self._write_header(cursor, self._live_header, first=True)
        self._redraw_live()
        self._scroll_to_end()

    def append_message(self, message: StoredMessage) -> None:
        """Add one finished message at the end without redrawing the others."""
        if not self._messages and self._live_frame is None:
            self.document().clear()
            self._runs = []
        self._messages.append(message)
        cursor = QTextCursor(self.document())
        self._insert_message(cursor, len(self._messages) - 1, message)
        self._scroll_to_end()

    def finish_live(self, message: StoredMessage) -> None:
        """The streamed answer is done: its frame becomes the finished message in place."""
        self._live_tokens = list(message.tokens)
        self._live_timer.stop()
        frame = self._live_frame
        if frame is None:
            self.append_message(message)
            return
        self._redraw_live()
        index = len(self._messages)
        self._runs = [(a, b, index * _REF_BASE + (-1 - ref) if ref < 0 else ref) for a, b, ref in self._runs]
        cursor = QTextCursor(self.document())
        cursor.setPosition(frame.lastPosition())
        self._write_message_end(cursor, index, message)
        self._messages.append(message)
        self.end_live()

    def update_live(self, tokens: Sequence[StoredToken]) -> None:
        """The streaming answer's tokens so far; redrawn soon (coalesced), not at once."""
        self._live_tokens = list(tokens)
        if not self._live_timer.isActive():
            self._live_timer.start()

    def end_live(self) -> None:
        self._live_timer.stop()
        self._live_frame = None
        self._live_tokens = []
        self._live_blocks, self._live_block_starts = [], []

    def message_count(self) -> int:
        return len(self._messages)

    def live_tokens(self) -> list[StoredToken]:
        return list(self._live_tokens)

    def _redraw_live(self) -> None:
        """Bring the live frame up to date, touching only what changed since the last redraw.

        Earlier blocks of a growing answer almost never change, and the last one usually
        only grows, so each redraw costs about the new tokens, not the whole answer.
        """
        frame = self._live_frame
        if frame is None:
            return
        at_bottom = self._at_bottom()
        tokens = self._live_tokens
        text = "".join(t.text for t in tokens)
        if not self._provenance:
            self._replace_live_from(0, frame)
            cursor = QTextCursor(self.document())
            cursor.setPosition(frame.lastPosition())
            self._live_block_starts = [cursor.position() + 1]  # after the separator _new_block adds
            self._write_answer(cursor, -1, tokens, text)
        else:
            self._update_live_blocks(frame, layout(text, owners([t.text for t in tokens])))
        if at_bottom:
            self._scroll_to_end()

    def _update_live_blocks(self, frame: QTextFrame, blocks: list[Block]) -> None:
        old = self._live_blocks
        same = 0
        while same < min(len(old), len(blocks)) and old[same] == blocks[same]:
            same += 1
        cursor = QTextCursor(self.document())
        if same == len(old) and same == len(blocks):
            return
        if same < len(old) and same < len(blocks) and _extends(old[same], blocks[same]):
            # The last block grew: append its new runs only.
            cursor.setPosition(frame.lastPosition())
            for run in blocks[same].runs[len(old[same].runs) :]:
                self._insert_run(cursor, -1, blocks[same], run, self._live_tokens)
            start = same + 1
        else:
            self._replace_live_from(same, frame)
            start = same
        cursor.setPosition(frame.lastPosition())
        del self._live_block_starts[start:]
        for block in blocks[start:]:
            self._write_block(cursor, -1, block, self._live_tokens)
        self._live_blocks = blocks

    def _replace_live_from(self, block_index: int, frame: QTextFrame) -> None:
        """Remove the live frame's content from its block `block_index` on (0: all of the answer)."""
        if block_index < len(self._live_block_starts):
            start = self._live_block_starts[block_index]
        else:
            start = frame.lastPosition()
        if start >= frame.lastPosition():
            return
        cursor = QTextCursor(self.document())
        # A block start is preceded by its block separator: remove that too, so that the
        # next insertBlock() does not leave an empty line behind.
        cursor.setPosition(start - 1)  # the header block always comes first, so start > frame start
        cursor.setPosition(frame.lastPosition(), QTextCursor.MoveMode.KeepAnchor)
        cursor.removeSelectedText()
        self._runs = [r for r in self._runs if r[0] < cursor.position()]
        del self._live_block_starts[block_index:]
        self._live_blocks = self._live_blocks[:block_index]

    def _insert_message(self, cursor: QTextCursor, index: int, message: StoredMessage) -> None:
        cursor.movePosition(QTextCursor.MoveOperation.End)
        cursor.insertFrame(self._message_frame_format(message.role))
        if message.role == "user":
            self._write_header(cursor, "You", first=True)
            for line in message.content.split("\n"):
                self._new_block(cursor, QTextBlockFormat())
                cursor.insertText(line, QTextCharFormat())
        else:
            self._write_header(cursor, "Assistant" + (" (stopped)" if message.stopped else ""), first=True)
            self._write_answer(cursor, index, message.tokens, message.content)
        self._write_message_end(cursor, index, message)
        cursor.movePosition(QTextCursor.MoveOperation.End)

    def _write_message_end(self, cursor: QTextCursor, index: int, message: StoredMessage) -> None:
        """The footer (answers) and the action links under a message."""
        if message.role == "user":
            actions = [("copy", "Copy"), ("edit", "Edit and resend")]
        else:
            if message.footer:
                self._write_muted(cursor, message.footer)
            actions = [("copy", "Copy"), ("regenerate", "Regenerate")]
        self._write_actions(cursor, index, actions)

    def _message_frame_format(self, role: str) -> QTextFrameFormat:
        fmt = QTextFrameFormat()
        fmt.setPadding(10)
        fmt.setTopMargin(4)
        fmt.setBottomMargin(8)
        if role == "user":
            fmt.setBackground(self._tints.user_bubble)
        return fmt

    def _new_block(self, cursor: QTextCursor, block: QTextBlockFormat) -> None:
        """Start a block, reusing the empty one a fresh frame comes with."""
        if cursor.block().length() <= 1 and cursor.atBlockStart() and cursor.block().userState() == -1:
            cursor.setBlockFormat(block)
            cursor.block().setUserState(1)
        else:
            cursor.insertBlock(block)
            cursor.block().setUserState(1)

    def _write_header(self, cursor: QTextCursor, text: str, first: bool) -> None:
        block = QTextBlockFormat()
        block.setBottomMargin(4)
        self._new_block(cursor, block)
        fmt = QTextCharFormat()
        fmt.setFontWeight(QFont.Weight.DemiBold)
        fmt.setForeground(self._tints.muted_text)
        cursor.insertText(text, fmt)

    def _write_muted(self, cursor: QTextCursor, text: str) -> None:
        block = QTextBlockFormat()
        block.setTopMargin(6)
        self._new_block(cursor, block)
        fmt = QTextCharFormat()
        fmt.setForeground(self._tints.muted_text)
        fmt.setFontPointSize(max(7.0, self.font().pointSizeF() * 0.9))
        cursor.insertText(text, fmt)

    def _write_actions(self, cursor: QTextCursor, index: int, actions: list[tuple[str, str]]) -> None:
        block = QTextBlockFormat()
        block.setTopMargin(4)
        self._new_block(cursor, block)
        for n, (action, label) in enumerate(actions):
            if n:
                cursor.insertText("   ", QTextCharFormat())
            fmt = QTextCharFormat()
            fmt.setAnchor(True)
            fmt.setAnchorHref(f"action:{action}:{index}")
            fmt.setForeground(self.palette().link().color())
            fmt.setFontPointSize(max(7.0, self.font().pointSizeF() * 0.9))
            cursor.insertText(label, fmt)

    def _write_answer(
        self, cursor: QTextCursor, index: int, tokens: Sequence[StoredToken], text: str
    ) -> None:
        if not self._provenance or not tokens:
            if text:
                self._new_block(cursor, QTextBlockFormat())
                cursor.insertHtml(self._markdown.render(text))
            return
        joined = "".join(t.text for t in tokens)
        for block in layout(joined, owners([t.text for t in tokens])):
            self._write_block(cursor, index, block, tokens)

    def _write_block(
        self, cursor: QTextCursor, index: int, block: Block, tokens: Sequence[StoredToken]
    ) -> None:
        fmt = QTextBlockFormat()
        prefix = ""
        if block.kind == "code":
            fmt.setBackground(self._tints.code_background)
            fmt.setLeftMargin(4)
            fmt.setTopMargin(6 if block.first_in_group else 0)
            fmt.setNonBreakableLines(True)
        elif block.kind == "heading":
            fmt.setTopMargin(10)
            fmt.setBottomMargin(4)
        elif block.kind in ("bullet", "ordered"):
            fmt.setLeftMargin(14 + 18 * block.level)
            fmt.setTopMargin(2)
            prefix = "•  " if block.kind == "bullet" else f"{block.number}.  "
        elif block.kind == "quote":
            fmt.setLeftMargin(16)
        elif block.kind == "rule":
            fmt.setProperty(QTextFormat.Property.BlockTrailingHorizontalRulerWidth, 1)
        else:
            fmt.setTopMargin(8 if block.first_in_group else 0)
        self._new_block(cursor, fmt)
        if index < 0:
            self._live_block_starts.append(cursor.block().position())
        if prefix:
            cursor.insertText(prefix, self._base_format(block))
        for run in block.runs:
            self._insert_run(cursor, index, block, run, tokens)

    def _base_format(self, block: Block) -> QTextCharFormat:
        base = QTextCharFormat()
        if block.kind == "code":
            base.setFont(self._mono)
        elif block.kind == "heading":
            base.setFontWeight(QFont.Weight.Bold)
            base.setFontPointSize(self.font().pointSizeF() * (1.5 - 0.1 * min(block.level, 5)))
        elif block.kind == "quote":
            base.setForeground(self._tints.muted_text)
        return base

    def _insert_run(
        self, cursor: QTextCursor, index: int, block: Block, run: Run, tokens: Sequence[StoredToken]
    ) -> None:
        char = self._base_format(block)
        if run.code:
            char.setFont(self._mono)
            if block.kind != "code":
                char.setBackground(self._tints.code_background)
        if run.bold:
            char.setFontWeight(QFont.Weight.Bold)
        if run.italic:
            char.setFontItalic(True)
        start = cursor.position()
        if run.token is not None and run.token < len(tokens):
            self._tint(char, tokens[run.token])
        cursor.insertText(run.text, char)
        if run.token is not None:
            ref = index * _REF_BASE + run.token if index >= 0 else -1 - run.token
            self._runs.append((start, cursor.position(), ref))

    def _tint(self, char: QTextCharFormat, token: StoredToken) -> None:
        char.setProperty(TOKEN_SOURCE, token.source)
        color = self._tints.for_source(token.source)
        if color is not None:
            char.setBackground(QBrush(color))
        if token.source == "corrected":
            # Not by colour alone: corrections are also underlined.
            char.setUnderlineStyle(QTextCharFormat.UnderlineStyle.SingleUnderline)
            char.setUnderlineColor(self._tints.corrected_line)

    def _apply_stylesheet(self) -> None:
        code_bg = self._tints.code_background.name()
        self.document().setDefaultStyleSheet(
            f"pre {{ background-color: {code_bg}; font-family: monospace; }}"
            f" code {{ background-color: {code_bg}; font-family: monospace; }}"
            " table { border-collapse: collapse; } th, td { padding: 3px 8px; }"
        )

    # -- reading back (hover, tests) ------------------------------------------------------
    def token_at(self, point: QPoint) -> StoredToken | None:
        """The token under a viewport position, or None."""
        offset = QPoint(self.horizontalScrollBar().value(), self.verticalScrollBar().value())
        position = self.document().documentLayout().hitTest(point + offset, Qt.HitTestAccuracy.ExactHit)
        if position < 0:
            return None
        i = bisect.bisect_right(self._runs, (position, 2**62, 0)) - 1
        if i >= 0 and self._runs[i][0] <= position < self._runs[i][1]:
            return self._token_for_ref(self._runs[i][2])
        return None

    def _token_for_ref(self, ref: object) -> StoredToken | None:
        if not isinstance(ref, int):
            return None
        if ref < 0:
            i = -1 - ref
            return self._live_tokens[i] if i < len(self._live_tokens) else None
        message, i = divmod(ref, _REF_BASE)
        if message < len(self._messages) and i < len(self._messages[message].tokens):
            return self._messages[message].tokens[i]
        return None

    def rendered_sources(self) -> dict[str, int]:
        """How many characters of each provenance the document shows (for tests and checks)."""
        counts: dict[str, int] = {}
        block = self.document().begin()
        while block.isValid():
            it = block.begin()
            while not it.atEnd():
                fragment = it.fragment()
                source = fragment.charFormat().property(TOKEN_SOURCE)
                if isinstance(source, str):
                    counts[source] = counts.get(source, 0) + fragment.length()
                it += 1
            block = block.next()
        return counts

    def tinted_backgrounds(self) -> set[str]:
        """Background colours of token fragments (empty when provenance is off)."""
        colors: set[str] = set()
        block = self.document().begin()
        while block.isValid():
            it = block.begin()
            while not it.atEnd():
                fmt = it.fragment().charFormat()
                if fmt.hasProperty(TOKEN_SOURCE) and fmt.background().style() != Qt.BrushStyle.NoBrush:
                    colors.add(fmt.background().color().name())
                it += 1
            block = block.next()
        return colors

    # -- events -----------------------------------------------------------------------------
    def viewportEvent(self, event: QEvent) -> bool:
        if event.type() == QEvent.Type.ToolTip:
            token = self.token_at(event.pos())
            if token is not None:
                QToolTip.showText(event.globalPos(), token_tooltip(token), self.viewport())
            else:
                QToolTip.hideText()
                event.ignore()
            return True
        return super().viewportEvent(event)

    def _on_anchor(self, url: QUrl) -> None:
        parts = url.toString().split(":")
        if len(parts) == 3 and parts[0] == "action" and parts[2].isdigit():
            self.actionRequested.emit(parts[1], int(parts[2]))

    def _at_bottom(self) -> bool:
        bar = self.verticalScrollBar()
        return bar.value() >= bar.maximum() - 24

    def _scroll_to_end(self) -> None:
        bar = self.verticalScrollBar()
        bar.setValue(bar.maximum())

    def setSource(
        self, name: QUrl, type: QTextDocument.ResourceType = QTextDocument.ResourceType.UnknownResource
    ) -> None:
        # Links never navigate the transcript away; actions arrive through anchorClicked.
        return


def _extends(old: Block, new: Block) -> bool:
    """`new` is `old` with more runs after it (the streaming case)."""
    return (
        (old.kind, old.level, old.number, old.language, old.first_in_group)
        == (new.kind, new.level, new.number, new.language, new.first_in_group)
        and len(new.runs) > len(old.runs)
        and new.runs[: len(old.runs)] == old.runs
    )
