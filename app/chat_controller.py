"""The conversation and its live answer: send, stop, regenerate, edit-and-resend, switch chats.

The one owner of the chat state: the open `Conversation`, the answer in flight
(its request and tokens), and the message being edited. Every message is saved
the moment it exists. Generation is asked of the `EngineWorker` through
`generateRequested`; tokens, gauges and the end come back through its signals.
The controller never blocks: the transcript renders long documents in slices.
"""

from __future__ import annotations

from PySide6.QtCore import QObject, Signal
from PySide6.QtGui import QGuiApplication

from specdec_core import DoneEvent, Message, PrefillEvent, ReadingEvent, StepEvent, TokenEvent

from .conversation_library import ConversationLibrary
from .conversation_sidebar import ConversationSidebar
from .conversations import (
    Conversation,
    ConversationError,
    ConversationStore,
    StoredMessage,
    StoredToken,
    title_from,
)
from .model_controller import ModelController
from .read_ahead import ReadAhead
from .settings import AppSettings
from .side_panel import SidePanel, answer_footer
from .token_view import TokenView
from .widgets import EditBanner, PromptBox
from .worker import EngineWorker, GenerateRequest, ReadAheadRequest, StreamBatch


class ChatController(QObject):
    generateRequested = Signal(object)  # GenerateRequest, to the worker
    answerProgressed = Signal(int)  # tokens of the streaming answer received so far
    answerFinished = Signal(object)  # StoredMessage
    generatingChanged = Signal(bool)
    errorRaised = Signal(str)
    statusChanged = Signal(str, int)  # message, timeout in ms (0: until replaced)
    conversationOpened = Signal(str)  # conversation id, shown in the transcript (rendering in slices)

    def __init__(
        self,
        settings: AppSettings,
        store: ConversationStore,
        models: ModelController,
        parts: tuple[TokenView, PromptBox, EditBanner, ConversationSidebar, SidePanel],
        parent: QObject | None = None,
    ) -> None:
        super().__init__(parent)
        self.settings = settings
        self.library = ConversationLibrary(store, self)
        self.library.listed.connect(self.refresh_list)
        self.library.loaded.connect(self._on_loaded)
        self.library.failed.connect(self.errorRaised)
        self._opening: int | None = None  # the load request whose conversation to show
        self.models = models
        self.view, self.prompt_box, self.edit_banner, self.sidebar, self.side = parts
        self.conversation = Conversation.new(settings.system_prompt)
        self._generation: GenerateRequest | None = None
        self._stop_asked = False  # Stop was pressed for the answer in flight: "Stopping…" stays
        self._live: list[TokenEvent] = []  # every committed token, end-of-turn included
        self._live_shown: list[StoredToken] = []  # the ones the transcript shows
        self._editing: int | None = None
        self._send_when_ready = False
        self._worker: EngineWorker | None = None
        prompt = self.prompt_box.edit
        prompt.submitted.connect(self.send)
        prompt.escaped.connect(self.cancel_edit)
        self.prompt_box.send_button.clicked.connect(self.send)
        self.prompt_box.stop_button.clicked.connect(self.stop)
        self.view.actionRequested.connect(self._on_message_action)
        self.sidebar.newRequested.connect(self.new_chat)
        self.sidebar.openRequested.connect(self._on_conversation_clicked)
        self.sidebar.renameRequested.connect(self.rename_conversation)
        self.sidebar.deleteRequested.connect(self.delete_conversation)
        models.loadStarting.connect(self.stop)
        models.modelReady.connect(self._on_model_ready)
        models.stateChanged.connect(self.update_controls)
        self.read_ahead = ReadAhead(prompt, self._read_ahead_request, self)
        models.loadStarting.connect(self.read_ahead.stop)  # the load waits behind a running read
        self.generatingChanged.connect(self._on_generating_changed)

    def attach(self, worker: EngineWorker) -> None:
        """Wire this controller to the worker (before the worker's thread starts)."""
        self._worker = worker
        self.generateRequested.connect(worker.generate)
        worker.reading.connect(self._on_reading)
        worker.prefilled.connect(self._on_prefilled)
        worker.streamed.connect(self._on_streamed)
        worker.answerDone.connect(self._on_answer_done)
        worker.generationFailed.connect(self._on_generation_failed)
        self.read_ahead.attach(worker)

    @property
    def generating(self) -> bool:
        return self._generation is not None

    def can_send(self) -> bool:
        return self.models.ready and self._generation is None

    def live_token_ids(self) -> list[int]:
        """Token ids of the answer being (or last) generated, end-of-turn included."""
        return [t.token_id for t in self._live]

    # -- sending ----------------------------------------------------------------------------
    def send(self) -> None:
        text = self.prompt_box.edit.toPlainText().strip()
        if text and self.models.loading and self._generation is None:
            # Typed before the model was ready: send it as soon as loading ends.
            self._send_when_ready = True
            self.statusChanged.emit("Will send when the model is ready…", 0)
            return
        if not text or not self.can_send():
            return
        conversation = self.conversation
        edited = self._editing is not None
        if self._editing is not None:
            del conversation.messages[self._editing :]
            self.cancel_edit()
        message = StoredMessage("user", text)
        conversation.messages.append(message)
        if conversation.title == "New chat":
            conversation.title = title_from(text)
        self._save()
        self.prompt_box.edit.clear()
        if not edited and self.view.message_count() == len(conversation.messages) - 1:
            self.view.append_message(message)  # the usual case: no redraw of what is shown
        else:
            self.view.render_messages(conversation.messages)
        self._start_generation()

    def _read_ahead_request(self) -> ReadAheadRequest | None:
        """What Send would read now, for a read ahead; None where nothing would be sent or
        the engine is a server's (it reads after Send)."""
        text = self.prompt_box.edit.toPlainText().strip()
        pair = self.models.pair
        if not text or not self.can_send() or pair is None or pair.server is not None:
            return None
        kept = self.conversation.messages[: self._editing]  # Send replaces an edited message onwards
        history = tuple(Message(m.role, m.content) for m in kept)
        return ReadAheadRequest(history, text, self.conversation.system_prompt or None)

    def _on_generating_changed(self, generating: bool) -> None:
        if not generating:
            self.read_ahead.resume()

    def regenerate(self, index: int | None = None) -> None:
        """Answer again from the user message before answer `index` (default: the last answer)."""
        messages = self.conversation.messages
        if not self.can_send() or not messages:
            return
        if index is None:
            index = len(messages) - 1 if messages[-1].role == "assistant" else len(messages)
        if messages[index - 1].role != "user":
            return
        del messages[index:]
        self._save()
        self.view.render_messages(messages)
        self._start_generation()

    def _start_generation(self) -> None:
        history = tuple(Message(m.role, m.content) for m in self.conversation.messages)
        generation = self.side.generation
        request = GenerateRequest(history, self.conversation.system_prompt or None, generation.params())
        self._generation, self._stop_asked = request, False
        self._live, self._live_shown = [], []
        self.side.gauges.reset()
        pair = self.models.pair
        self.view.begin_live("Assistant" if pair is None else f"Assistant · {pair.target_name}")
        self.statusChanged.emit("Generating…", 0)
        self.read_ahead.stop()  # a read still running ends at its next chunk; the answer reuses it
        self.update_controls()
        self.generateRequested.emit(request)

    def stop(self) -> None:
        if self._generation is not None and self._worker is not None:
            self._worker.stop(self._generation)
            self._stop_asked = True
            self.statusChanged.emit("Stopping…", 0)
            self.prompt_box.stop_button.setEnabled(False)

    def _on_model_ready(self) -> None:
        if self._send_when_ready:
            self._send_when_ready = False
            self.send()

    # -- the live answer --------------------------------------------------------------------
    def _on_reading(self, event: ReadingEvent) -> None:
        if self._generation is not None and not self._stop_asked:
            self.statusChanged.emit(f"Reading the prompt: {event.read:,} of {event.total:,} tokens…", 0)

    def _on_prefilled(self, event: PrefillEvent) -> None:
        if self._generation is not None and not self._stop_asked:
            self.statusChanged.emit("Generating…", 0)

    def _on_streamed(self, batch: StreamBatch) -> None:
        if self._generation is None or self._worker is None:
            return
        self._live.extend(e for e in batch if isinstance(e, TokenEvent))
        self._live_shown.extend(
            StoredToken(e.text, e.source.value, e.step, e.target_prob, e.draft_prob)
            for e in batch
            if isinstance(e, TokenEvent) and not e.is_stop
        )
        self.view.update_live(self._live_shown)
        self.answerProgressed.emit(len(self._live))
        steps = [e for e in batch if isinstance(e, StepEvent)]
        if steps:
            pinned_k = self.side.generation.pinned_k()
            self.side.gauges.show_update(steps[-1], pinned_k, self._worker.speculation_enabled)

    def _on_answer_done(self, done: DoneEvent) -> None:
        if self._generation is None:
            return
        stats = done.stats
        pair = self.models.pair
        footer = answer_footer(stats, pair.draft_name if pair and stats.drafter != "none" else "none")
        message = StoredMessage(
            "assistant",
            done.text,
            tokens=list(self._live_shown),
            footer=footer,
            stopped=stats.stop_reason == "cancelled",
        )
        self._generation = None
        self.conversation.messages.append(message)
        self._save()
        self.view.finish_live(message)
        self.side.gauges.show_final(stats, footer)
        self.statusChanged.emit(footer, 0)
        self.update_controls()
        self.answerFinished.emit(message)

    def _on_generation_failed(self, message: str) -> None:
        self._generation = None
        self.view.end_live()
        self.view.render_messages(self.conversation.messages)
        self.errorRaised.emit(message)
        self.update_controls()

    # -- message actions ----------------------------------------------------------------------
    def _on_message_action(self, action: str, index: int) -> None:
        if index >= len(self.conversation.messages):
            return
        message = self.conversation.messages[index]
        if action == "copy":
            QGuiApplication.clipboard().setText(message.content)
            self.statusChanged.emit("Copied", 2000)
        elif action == "edit" and message.role == "user":
            self.start_edit(index)
        elif action == "regenerate" and message.role == "assistant":
            self.regenerate(index)

    def start_edit(self, index: int) -> None:
        """Edit-and-resend: the prompt takes the message; sending replaces it and what followed."""
        self._editing = index
        self.prompt_box.edit.setPlainText(self.conversation.messages[index].content)
        self.prompt_box.edit.setFocus()
        self.edit_banner.show()

    def cancel_edit(self) -> None:
        if self._editing is not None:
            self._editing = None
            self.edit_banner.hide()

    def copy_last_answer(self) -> None:
        answers = [m for m in self.conversation.messages if m.role == "assistant"]
        if answers:
            QGuiApplication.clipboard().setText(answers[-1].content)

    def set_system_prompt(self, text: str) -> None:
        """For this conversation, and the default for new ones."""
        self.conversation.system_prompt = text
        self.settings.system_prompt = text
        if self.conversation.messages:
            self._save()

    # -- conversations ----------------------------------------------------------------------
    def _busy(self) -> bool:
        if self._generation is not None:
            self.statusChanged.emit("Stop the answer first", 3000)
        return self._generation is not None

    def new_chat(self) -> None:
        if self._busy():
            return
        self.cancel_edit()
        self._opening = None
        self.conversation = Conversation.new(self.settings.system_prompt)
        self.view.render_messages([])
        self.side.gauges.reset()
        self.side.gauges.footer.setText("")
        self.refresh_list()
        self.prompt_box.edit.setFocus()

    def open_conversation(self, conversation_id: str) -> None:
        """Read it in the background; `conversationOpened` says when it is shown."""
        if self._busy():
            self.refresh_list()
            return
        self._opening = self.library.load(conversation_id)

    def _on_loaded(self, conversation: Conversation, request: int) -> None:
        if request != self._opening or self._generation is not None:
            return  # superseded by a later choice, or the user started a new answer meanwhile
        self._opening = None
        self._show(conversation)

    def _show(self, conversation: Conversation) -> None:
        self.conversation = conversation
        self.cancel_edit()
        self.settings.last_conversation = conversation.id
        self.view.render_messages(conversation.messages)
        footers = [m.footer for m in conversation.messages if m.footer]
        self.side.gauges.reset()
        self.side.gauges.footer.setText(footers[-1] if footers else "")
        self.refresh_list()
        self.conversationOpened.emit(conversation.id)

    def _on_conversation_clicked(self, conversation_id: str) -> None:
        if conversation_id != self.conversation.id:
            self.open_conversation(conversation_id)

    def rename_conversation(self, conversation_id: str, title: str) -> None:
        title = title.strip()
        if not title:
            return
        if conversation_id == self.conversation.id:
            self.conversation.title = title
            if self.conversation.messages:
                self._save()
            return
        self.library.rename(conversation_id, title)

    def delete_conversation(self, conversation_id: str) -> None:
        self.library.delete(conversation_id)
        if conversation_id == self.conversation.id:
            self.new_chat()

    def reopen_last_conversation(self) -> None:
        """At start, before the window shows: list the folder and reopen the last chat."""
        self.library.scan()
        last = self.settings.last_conversation
        if not last or not self.library.exists(last):
            return
        try:
            self._show(self.library.store.load(last))
        except ConversationError as exc:
            self.errorRaised.emit(f"cannot open that conversation: {exc}")

    def _save(self) -> None:
        self.library.save(self.conversation)  # lists it at once, writes it in the background
        self.settings.last_conversation = self.conversation.id

    def refresh_list(self) -> None:
        library = self.library
        self.sidebar.show_conversations(library.summaries(), self.conversation.id, library.unreadable())

    def shutdown(self) -> None:
        """Closing: write what is still being saved."""
        self.library.close()

    # -- controls ---------------------------------------------------------------------------
    def update_controls(self) -> None:
        generating = self._generation is not None
        box = self.prompt_box
        box.send_button.setEnabled(self.can_send() or (self.models.loading and not generating))
        box.send_button.setToolTip("" if self.models.pair else "Waiting for a model to load")
        box.stop_button.setEnabled(generating)
        self.generatingChanged.emit(generating)
