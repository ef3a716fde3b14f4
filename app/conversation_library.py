"""The saved conversations as the window sees them: a listing kept in memory, and
saving, loading, renaming and deleting done off the UI thread.

Saving a long conversation (JSON with indent and an fsync) and loading it take far
longer than a UI-thread turn may, and listing the folder reads every file
(docs/app.md#a-transcript-that-never-stalls; scripts/transcript-timings measures them).
The window saves after every message, so none of that may run on the UI thread at the
end of an answer. Here the folder is read once, when the
window starts; afterwards the listing is updated in memory, and the file work
runs in one background thread, in the order asked (a delete never races a save).
Results come back as signals, delivered on the UI thread.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from PySide6.QtCore import QObject, Signal

from .conversations import Conversation, ConversationError, ConversationStore, Unreadable


@dataclass(frozen=True)
class ConversationSummary:
    """What the sidebar lists about a conversation."""

    id: str
    title: str
    updated: float
    message_count: int

    @classmethod
    def of(cls, conversation: Conversation) -> ConversationSummary:
        return cls(conversation.id, conversation.title, conversation.updated, len(conversation.messages))


class ConversationLibrary(QObject):
    listed = Signal()  # the listing changed
    loaded = Signal(object, int)  # Conversation, the number `load` returned
    saved = Signal(str)  # conversation id: its file is written
    failed = Signal(str)  # one line: what could not be done and why

    def __init__(self, store: ConversationStore, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.store = store
        self._summaries: dict[str, ConversationSummary] = {}
        self._unreadable: tuple[Unreadable, ...] = ()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="specdec-conversations")
        self._requests = 0

    # -- the listing (memory only) ------------------------------------------------------------
    def scan(self) -> None:
        """Read the folder now, on the calling thread (once, before the window shows)."""
        listing = self.store.scan()
        self._summaries = {c.id: ConversationSummary.of(c) for c in listing.conversations}
        self._unreadable = listing.unreadable
        self.listed.emit()

    def summaries(self) -> list[ConversationSummary]:
        """Readable conversations, most recently updated first."""
        return sorted(self._summaries.values(), key=lambda s: s.updated, reverse=True)

    def unreadable(self) -> tuple[Unreadable, ...]:
        return self._unreadable

    def exists(self, conversation_id: str) -> bool:
        return conversation_id in self._summaries or self.store.exists(conversation_id)

    # -- file work (background) ---------------------------------------------------------------
    def save(self, conversation: Conversation) -> None:
        """Save what `conversation` holds now; the listing shows it at once."""
        conversation.updated = time.time()
        self._summaries[conversation.id] = ConversationSummary.of(conversation)
        self._unreadable = tuple(u for u in self._unreadable if u.conversation_id != conversation.id)
        self.listed.emit()
        # Messages are never changed once added (edits remove and append), so a copy of
        # the list is a snapshot the UI thread can go on changing.
        snapshot = dataclasses.replace(conversation, messages=list(conversation.messages))
        self._run(lambda: self._save_now(snapshot), "cannot save the conversation")

    def _save_now(self, snapshot: Conversation) -> None:
        self.store.save(snapshot)
        self.saved.emit(snapshot.id)

    def load(self, conversation_id: str) -> int:
        """Start reading a conversation; `loaded` brings it with the returned number."""
        self._requests += 1
        request = self._requests
        self._run(
            lambda: self.loaded.emit(self.store.load(conversation_id), request),
            "cannot open that conversation",
        )
        return request

    def rename(self, conversation_id: str, title: str) -> None:
        """Rename a conversation that is not open (the open one is renamed and saved)."""
        summary = self._summaries.get(conversation_id)
        if summary is not None:
            self._summaries[conversation_id] = dataclasses.replace(summary, title=title)
            self.listed.emit()

        def rename_now() -> None:
            conversation = self.store.load(conversation_id)
            conversation.title = title
            self._save_now(conversation)

        self._run(rename_now, "cannot rename that conversation")

    def delete(self, conversation_id: str) -> None:
        self._summaries.pop(conversation_id, None)
        self._unreadable = tuple(u for u in self._unreadable if u.conversation_id != conversation_id)
        self.listed.emit()
        self._run(lambda: self.store.delete(conversation_id), "cannot delete that conversation")

    def close(self) -> None:
        """Finish the file work asked for (closing the window loses nothing), then stop."""
        self._pool.shutdown(wait=True)

    def wait(self) -> None:
        """Block until the work asked for so far is done (tests, closing)."""
        self._pool.submit(lambda: None).result()

    def _run(self, work: Callable[[], None], what: str) -> Future[None]:
        def guarded() -> None:
            try:
                work()
            except (ConversationError, OSError) as exc:
                self.failed.emit(f"{what}: {exc}")

        return self._pool.submit(guarded)
