"""The transcript widget: the conversation as one document, answers tinted by provenance.

One `QTextBrowser` shows the whole conversation (its object name is
`transcriptView`; its viewport, where the tokens are drawn and hovered, is
`tokenView`). Three helpers do the work: `TranscriptWriter` writes finished
messages, `LiveAnswer` keeps the streaming answer up to date (redrawn at
most every `LIVE_REFRESH_MS`, only what changed), and `TokenIndex` maps document
positions back to tokens for tooltips.

Writing never holds the UI thread for long: every document change is a job that
runs in slices of about `SLICE_MS` from the event loop (the first slice at once,
so short documents appear immediately). Opening a long conversation, switching
themes or finishing a long answer therefore never freezes the window; jobs run in
the order they were asked for, and `renderingFinished` says when all are done.
"""

from __future__ import annotations

import html
import time
from collections import deque
from collections.abc import Iterator, Sequence

from PySide6.QtCore import QEvent, QPoint, Qt, QTimer, QUrl, Signal
from PySide6.QtGui import QTextCursor, QTextDocument, QTextFragment
from PySide6.QtWidgets import QTextBrowser, QToolTip, QWidget

from .conversations import StoredMessage, StoredToken
from .highlight import Highlighter
from .live_answer import LiveAnswer
from .theme import Tints
from .token_index import TokenIndex
from .transcript_writer import TOKEN_SOURCE, TranscriptWriter, Work, WriterStyle

__all__ = ["LIVE_REFRESH_MS", "SLICE_MS", "TOKEN_SOURCE", "TokenView", "token_tooltip"]

LIVE_REFRESH_MS = 40  # ~25 redraws a second look smooth and leave the UI thread idle
# Writing per event-loop turn. Qt's layout at the end of the slice and the paint after it
# add as much again at times, and a turn must stay well under the bound a user notices
# (docs/app.md#a-transcript-that-never-stalls).
SLICE_MS = 8

SOURCE_WORDS = {
    "accepted": "accepted draft token: the target agreed with the draft",
    "corrected": "correction: the target replaced a rejected draft token",
    "bonus": "bonus token: the target's extra token after a fully accepted draft",
    "target": "target token: a plain target step, no speculation",
    "unknown": "served token: the server does not say whether a draft proposed it",
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
    renderingFinished = Signal()  # every requested change is in the document

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("transcriptView")
        self.viewport().setObjectName("tokenView")
        self.setOpenLinks(False)
        self.setOpenExternalLinks(False)
        self.anchorClicked.connect(self._on_anchor)
        self.viewport().setMouseTracking(True)
        self._index = TokenIndex()
        self._writer = TranscriptWriter(self._index, WriterStyle(point_size=self.font().pointSizeF()))
        self._live = LiveAnswer(self.document(), self._writer)
        self._fresh_document()
        self._messages: list[StoredMessage] = []
        self._streaming = False  # an answer is streaming (its header may still be queued)
        self._placeholder = ""
        self._placeholder_shown = False
        self._jobs: deque[Work] = deque()
        self._pumping = False
        self._follow = False  # scroll to the end when the queued writing is done
        self._pump_timer = QTimer(self, singleShot=True, interval=0)
        self._pump_timer.timeout.connect(self._pump)
        self._live_timer = QTimer(self, singleShot=True, interval=LIVE_REFRESH_MS)
        self._live_timer.timeout.connect(self._redraw_live)
        self._restyle()

    # -- configuration ------------------------------------------------------------------
    def set_tints(self, tints: Tints) -> None:
        self._writer.style.tints = tints
        self._writer.style.highlighter = Highlighter(tints.theme)
        self._restyle()
        self.render_messages(self._messages)

    def set_provenance(self, on: bool) -> None:
        self._writer.style.provenance = on
        self.render_messages(self._messages)

    def provenance(self) -> bool:
        return self._writer.style.provenance

    def set_placeholder(self, text: str) -> None:
        """Shown when the conversation is empty (what to do next)."""
        self._placeholder = text
        if not self._messages and not self._streaming:
            self.render_messages([])

    def _fresh_document(self) -> None:
        """Start over on a fresh, empty document without an undo stack; the old one is
        freed in an event-loop turn of its own, away from the first slice of what
        replaces it."""
        old = self.document()
        ours = old.parent() is self  # not the widget's first one, which setDocument deletes
        document = QTextDocument(self)
        document.setDocumentMargin(14)
        document.setUndoRedoEnabled(False)  # read-only: an undo stack would only grow
        document.setDefaultStyleSheet(old.defaultStyleSheet())
        self.setDocument(document)
        self._live.document = document
        if ours:
            old.deleteLater()

    def _restyle(self) -> None:
        style = self._writer.style
        style.link_color = self.palette().link().color()
        code_bg = style.tints.code_background.name()
        self.document().setDefaultStyleSheet(
            f"pre {{ background-color: {code_bg}; font-family: monospace; }}"
            f" code {{ background-color: {code_bg}; font-family: monospace; }}"
            " table { border-collapse: collapse; } th, td { padding: 3px 8px; }"
        )

    # -- what to show ---------------------------------------------------------------------
    def render_messages(self, messages: Sequence[StoredMessage]) -> None:
        """Show exactly `messages` (and the streaming answer, if any), written in slices."""
        self._messages = list(messages)
        self._jobs.clear()
        self._live_timer.stop()
        self._fresh_document()
        self._index.clear()
        self._live.active = False
        self._placeholder_shown = False
        if not self._messages and not self._streaming and self._placeholder:
            self._writer.write_placeholder(QTextCursor(self.document()), self._placeholder)
            self._placeholder_shown = True
            return
        self._enqueue(self._write_messages(list(enumerate(self._messages))))
        if self._streaming:
            self._enqueue(self._open_live())
        self._follow = True

    def append_message(self, message: StoredMessage) -> None:
        """Add one finished message at the end without redrawing the others."""
        self._messages.append(message)
        self._enqueue(self._write_messages([(len(self._messages) - 1, message)]), follow=True)

    def begin_live(self, header: str) -> None:
        """Start the streaming answer at the end of the transcript."""
        self._streaming = True
        self._live.header = header
        self._live.set_tokens([])
        self._enqueue(self._open_live(), follow=True)

    def update_live(self, tokens: Sequence[StoredToken]) -> None:
        """The streaming answer's tokens so far; redrawn soon (coalesced), not at once."""
        self._live.set_tokens(tokens)
        if not self._live_timer.isActive():
            self._live_timer.start()

    def finish_live(self, message: StoredMessage) -> None:
        """The streamed answer is done: what is drawn becomes the finished message in place."""
        self._live_timer.stop()
        if not self._streaming:
            self.append_message(message)
            return
        self._streaming = False
        self._messages.append(message)
        self._enqueue(self._live.finish(len(self._messages) - 1, message), follow=self._at_bottom())

    def end_live(self) -> None:
        """The answer failed: forget it (the caller renders the messages again)."""
        self._live_timer.stop()
        self._streaming = False
        self._live.reset()

    def message_count(self) -> int:
        return len(self._messages)

    def live_tokens(self) -> list[StoredToken]:
        return list(self._live.tokens)

    def is_rendering(self) -> bool:
        """Some requested change is not in the document yet."""
        return bool(self._jobs)

    # -- jobs -------------------------------------------------------------------------------
    def _write_messages(self, numbered: list[tuple[int, StoredMessage]]) -> Work:
        cursor = QTextCursor(self.document())
        for index, message in numbered:
            yield from self._writer.write_message(cursor, index, message)

    def _open_live(self) -> Work:
        self._live.begin(self._live.header)
        yield
        yield from self._live.catch_up()

    def _enqueue(self, job: Work, follow: bool = False) -> None:
        self._follow = self._follow or follow
        if self._placeholder_shown:
            self.document().clear()
            self._placeholder_shown = False
        self._jobs.append(job)
        self._pump()

    def _pump(self) -> None:
        """Run queued writing for one slice; the rest continues on the next event-loop turn."""
        if self._pumping:
            return
        self._pumping = True
        deadline = time.perf_counter() + SLICE_MS / 1000
        # One edit block per slice: Qt lays the document out once for it, not per insertion.
        cursor = QTextCursor(self.document())
        cursor.beginEditBlock()
        try:
            while self._jobs and time.perf_counter() < deadline:
                try:
                    next(self._jobs[0])
                except StopIteration:
                    self._jobs.popleft()
        finally:
            cursor.endEditBlock()
            self._pumping = False
        if self._follow:
            self._scroll_to_end()
        if self._jobs:
            self._pump_timer.start()
        else:
            self._follow = False
            self.renderingFinished.emit()

    def _redraw_live(self) -> None:
        if self._jobs:
            return  # the live answer.s own job draws the tokens when it runs
        at_bottom = self._at_bottom()
        cursor = QTextCursor(self.document())
        cursor.beginEditBlock()
        self._live.redraw()
        cursor.endEditBlock()
        if at_bottom:
            self._scroll_to_end()

    # -- reading back (hover, tests) ------------------------------------------------------
    def token_at(self, point: QPoint) -> StoredToken | None:
        """The token under a viewport position, or None."""
        offset = QPoint(self.horizontalScrollBar().value(), self.verticalScrollBar().value())
        position = self.document().documentLayout().hitTest(point + offset, Qt.HitTestAccuracy.ExactHit)
        return self._index.at(position) if position >= 0 else None

    def rendered_sources(self) -> dict[str, int]:
        """How many characters of each provenance the document shows (for tests and checks)."""
        counts: dict[str, int] = {}
        for fragment in self.fragments():
            source = fragment.charFormat().property(TOKEN_SOURCE)
            if isinstance(source, str):
                counts[source] = counts.get(source, 0) + fragment.length()
        return counts

    def tinted_backgrounds(self) -> set[str]:
        """Background colours of token fragments (empty when provenance is off)."""
        colors: set[str] = set()
        for fragment in self.fragments():
            fmt = fragment.charFormat()
            if fmt.hasProperty(TOKEN_SOURCE) and fmt.background().style() != Qt.BrushStyle.NoBrush:
                colors.add(fmt.background().color().name())
        return colors

    def fragments(self) -> Iterator[QTextFragment]:
        """Every text fragment of the document, in order (for checks and tests)."""
        block = self.document().begin()
        while block.isValid():
            it = block.begin()
            while not it.atEnd():
                yield it.fragment()
                it += 1
            block = block.next()

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
