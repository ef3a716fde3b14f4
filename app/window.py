"""The main window: assembles the parts and wires them to the engine worker.

Left, `ConversationSidebar`; in the middle the transcript (`TokenView`) under the
error banner and load panel, with the prompt box below; right, the gauges and
generation settings (`SidePanel`); on top the `ModelToolbar`. State lives in two
controllers: `ModelController` (what is loaded or loading) and `ChatController`
(the conversation and its live answer). The window itself keeps only the theme,
the geometry and the application-wide actions and menus.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import qtawesome as qta
from PySide6.QtCore import QByteArray, Signal
from PySide6.QtGui import QAction, QActionGroup, QCloseEvent, QGuiApplication, QKeySequence
from PySide6.QtWidgets import (
    QApplication,
    QDialog,
    QHBoxLayout,
    QLabel,
    QMainWindow,
    QMessageBox,
    QSplitter,
    QVBoxLayout,
    QWidget,
)

from specdec_core import SessionInfo

from . import catalog_info, highlight, theme
from .chat_controller import ChatController
from .conversation_sidebar import ConversationSidebar
from .conversations import Conversation, ConversationStore
from .model_controller import ModelController
from .model_toolbar import ModelToolbar
from .settings import AppSettings
from .side_panel import EXACTNESS_TIP, SidePanel
from .token_view import TokenView
from .widgets import EditBanner, ErrorBanner, LoadPanel, PromptBox, ProvenanceLegend, SystemPromptDialog
from .worker import EngineThread, EngineWorker

SPECULATION_TIP = (
    "Speculative decoding on/off (Ctrl+Shift+S); applies from the next step of the running answer"
)


@dataclass(frozen=True)
class ChatOptions:
    """What `specdec chat` was asked for; empty strings mean "the last used, else the default"."""

    target: str = ""
    draft: str = ""
    device: str = ""
    precision: str = ""
    theme: str = ""
    offload: bool = False  # this run only, like trust_remote_code: never remembered
    trust_remote_code: bool = False


def initial_models(options: ChatOptions, settings: AppSettings) -> tuple[str, str, str, str]:
    """(target, draft, device, precision) to load first: the asked for, else the last used,
    else the catalog's default pair; a new target gets its recommended draft."""
    device = options.device or settings.device
    precision = options.precision or settings.precision
    target = options.target or settings.target or catalog_info.default_target()
    if options.draft:
        return target, options.draft, device, precision
    if not options.target or target == settings.target:
        return target, settings.draft or catalog_info.default_draft(), device, precision
    entry = catalog_info.entry(target)
    draft = entry.recommended_drafts[0] if entry and entry.recommended_drafts else "ngram"
    return target, draft, device, precision


class MainWindow(QMainWindow):
    # What happened, for tests and anyone embedding the window.
    modelReady = Signal(object)  # SessionInfo
    draftMenuUpdated = Signal()
    answerProgressed = Signal(int)  # tokens of the streaming answer received so far
    answerFinished = Signal(object)  # StoredMessage
    errorShown = Signal(str)
    conversationOpened = Signal(str)  # conversation id

    def __init__(self, options: ChatOptions, settings: AppSettings | None = None) -> None:
        super().__init__()
        self.settings = settings or AppSettings()
        self._closing = False
        self._theme_choice = options.theme or self.settings.theme
        self.setWindowTitle("specdec")
        self.setWindowIcon(theme.app_icon())
        highlight.warm_up()
        self._build_parts(initial_models(options, self.settings))
        self.models.offload, self.models.trust_remote_code = options.offload, options.trust_remote_code
        self._build_actions()
        self._build_menus()
        self._layout()
        self._connect_parts()
        self._make_worker()
        self._apply_theme()
        QGuiApplication.styleHints().colorSchemeChanged.connect(self._on_system_scheme)
        self._restore_geometry()
        self.chat.reopen_last_conversation()
        self.models.request_load()  # queued: the worker takes it once its thread runs
        # Last: a window that failed to build must not leave a running thread behind.
        self.engine_thread.start()

    # ================================================================ construction
    def _build_parts(self, models: tuple[str, str, str, str]) -> None:
        self.toolbar = ModelToolbar(models[2], models[3], self)
        self.addToolBar(self.toolbar)
        self.sidebar = ConversationSidebar()
        self.error_banner = ErrorBanner()
        self.load_panel = LoadPanel()
        self.view = TokenView()
        self.view.set_provenance(self.settings.provenance)
        self.view.set_placeholder("Ask anything. Enter sends, Shift+Enter starts a new line.")
        self.legend = ProvenanceLegend()
        self.edit_banner = EditBanner()
        self.prompt_box = PromptBox()
        self.side = SidePanel(self.settings)
        self.models = ModelController(self.settings, self.toolbar, self.load_panel, models, self)
        parts = (self.view, self.prompt_box, self.edit_banner, self.sidebar, self.side)
        self.chat = ChatController(self.settings, ConversationStore(), self.models, parts, self)
        # The seams tests and embedders use.
        self.prompt = self.prompt_box.edit
        self.send_button = self.prompt_box.send_button
        self.stop_button = self.prompt_box.stop_button
        self.error_text = self.error_banner.text
        self.conversation_list = self.sidebar.list
        self.read_ahead_label = QLabel(objectName="readAheadLabel")  # how far the box was read ahead
        self.gauges = self.side.gauges
        self.draft_menu = self.toolbar.draft_menu

    def _build_actions(self) -> None:
        self.speculation_action = self._action("Speculation", "mdi6.lightning-bolt", "Ctrl+Shift+S")
        self.speculation_action.setObjectName("speculationToggle")
        self.speculation_action.setCheckable(True)
        self.speculation_action.setChecked(self.settings.speculation)
        self.speculation_action.setToolTip(SPECULATION_TIP)
        self.provenance_action = self._action("Show provenance", "mdi6.palette-outline", "Ctrl+Shift+P")
        self.provenance_action.setObjectName("provenanceToggle")
        self.provenance_action.setCheckable(True)
        self.provenance_action.setChecked(self.settings.provenance)
        self.provenance_action.setToolTip("Tint each token by where it came from (Ctrl+Shift+P)")
        self.speculation_action.toggled.connect(self._on_speculation_toggled)
        self.provenance_action.toggled.connect(self._on_provenance_toggled)
        self.new_chat_action = self._action(
            "New chat", "mdi6.plus", QKeySequence.StandardKey.New, self.chat.new_chat
        )
        self.regenerate_action = self._action(
            "Regenerate", "mdi6.refresh", "Ctrl+R", lambda: self.chat.regenerate()
        )
        self.stop_action = self._action("Stop", "mdi6.stop", "Ctrl+.", self.chat.stop)
        self.copy_answer_action = self._action(
            "Copy last answer", "mdi6.content-copy", "Ctrl+Shift+C", self.chat.copy_last_answer
        )
        self.system_prompt_action = self._action("System prompt…", None, None, self.edit_system_prompt)
        self.quit_action = self._action("Quit", None, QKeySequence.StandardKey.Quit, self.close)
        self.toolbar.add_toggles(self.speculation_action, self.provenance_action)

    def _action(
        self,
        text: str,
        icon: str | None = None,
        shortcut: str | QKeySequence.StandardKey | None = None,
        slot: Callable[[], object] | None = None,
    ) -> QAction:
        action = QAction(qta.icon(icon), text, self) if icon else QAction(text, self)
        if shortcut is not None:
            action.setShortcut(QKeySequence(shortcut))
        if slot is not None:
            action.triggered.connect(slot)
        return action

    def _build_menus(self) -> None:
        bar = self.menuBar()
        file_menu = bar.addMenu("&File")
        file_menu.addAction(self.new_chat_action)
        file_menu.addSeparator()
        file_menu.addAction(self.quit_action)
        chat_menu = bar.addMenu("&Chat")
        for action in (self.regenerate_action, self.stop_action, self.copy_answer_action):
            chat_menu.addAction(action)
        chat_menu.addSeparator()
        chat_menu.addAction(self.system_prompt_action)
        chat_menu.addAction(self.speculation_action)
        view_menu = bar.addMenu("&View")
        view_menu.addAction(self.provenance_action)
        theme_menu = view_menu.addMenu("Theme")
        self.theme_group = QActionGroup(self)
        for name in ("system", "light", "dark"):
            action = QAction(name.capitalize(), self, checkable=True)
            action.setData(name)
            action.setChecked(name == self._theme_choice)
            action.triggered.connect(lambda _=False, n=name: self.set_theme(n))
            self.theme_group.addAction(action)
            theme_menu.addAction(action)
        bar.addMenu("&Help").addAction(self._action("About specdec", slot=self._about))

    def _layout(self) -> None:
        chat = QWidget()
        chat_layout = QVBoxLayout(chat)
        chat_layout.setContentsMargins(0, 0, 0, 8)
        chat_layout.setSpacing(4)
        chat_layout.addWidget(self.error_banner)
        chat_layout.addWidget(self.load_panel)
        chat_layout.addWidget(self.view, 1)
        legend_row = QHBoxLayout()
        legend_row.setContentsMargins(12, 0, 12, 0)
        legend_row.addWidget(self.legend)
        legend_row.addStretch(1)
        chat_layout.addLayout(legend_row)
        chat_layout.addWidget(self.edit_banner)
        chat_layout.addWidget(self.prompt_box)
        self.splitter = QSplitter(objectName="mainSplitter")
        self.splitter.addWidget(self.sidebar)
        self.splitter.addWidget(chat)
        self.splitter.addWidget(self.side)
        self.splitter.setStretchFactor(1, 1)
        self.splitter.setSizes([210, 760, 290])
        self.setCentralWidget(self.splitter)
        self.statusBar().addPermanentWidget(self.read_ahead_label)
        self.statusBar().showMessage("Starting…")

    def _connect_parts(self) -> None:
        models, chat = self.models, self.chat
        models.modelReady.connect(self._show_exactness)
        models.modelReady.connect(self.modelReady)
        models.draftMenuUpdated.connect(self.draftMenuUpdated)
        models.errorRaised.connect(self.show_error)
        models.statusChanged.connect(self.statusBar().showMessage)
        chat.answerProgressed.connect(self.answerProgressed)
        chat.answerFinished.connect(self.answerFinished)
        chat.conversationOpened.connect(self.conversationOpened)
        chat.errorRaised.connect(self.show_error)
        chat.statusChanged.connect(self.statusBar().showMessage)
        chat.read_ahead.shown.connect(self.read_ahead_label.setText)
        chat.generatingChanged.connect(self._on_generating_changed)
        self.side.generation.systemPromptRequested.connect(self.edit_system_prompt)
        chat.refresh_list()
        chat.update_controls()

    def _make_worker(self) -> None:
        self.worker = EngineWorker()
        self.engine_thread = EngineThread(self.worker)
        self.models.attach(self.worker)
        self.chat.attach(self.worker)
        self.worker.set_speculation(self.speculation_action.isChecked())

    # ================================================================ the seams tests and embedders use
    @property
    def pair(self) -> SessionInfo | None:
        return self.models.pair

    @property
    def conversation(self) -> Conversation:
        return self.chat.conversation

    def live_token_ids(self) -> list[int]:
        return self.chat.live_token_ids()

    def draft_menu_entries(self) -> list[tuple[str, str, bool, str]]:
        return self.toolbar.draft_menu_entries()

    def send(self) -> None:
        self.chat.send()

    def stop(self) -> None:
        self.chat.stop()

    def rename_conversation(self, conversation_id: str, title: str) -> None:
        self.chat.rename_conversation(conversation_id, title)

    def delete_conversation(self, conversation_id: str) -> None:
        self.chat.delete_conversation(conversation_id)

    def open_conversation(self, conversation_id: str) -> None:
        self.chat.open_conversation(conversation_id)

    # ================================================================ toggles, theme, errors
    def _on_generating_changed(self, generating: bool) -> None:
        self.stop_action.setEnabled(generating)
        self.regenerate_action.setEnabled(self.chat.can_send() and bool(self.chat.conversation.messages))
        self.toolbar.set_menus_enabled(not generating)

    def _show_exactness(self, info: SessionInfo) -> None:
        """The self-check's verdict on the loaded pair, under the gauges and on the toggle."""
        if info.server is not None:  # what the server promises; the self-check is in-process only
            label = f"Exactness: {info.server.exactness} ({info.server.kind} server)"
        else:
            label = f"Exactness: {info.exactness.summary() if info.exactness else 'not checked'}"
        self.side.gauges.exactness.setText(label)
        step = f"\nStep: {info.step}" if info.step else ""  # CUDA: how the forwards run
        self.side.gauges.exactness.setToolTip(f"{EXACTNESS_TIP}{step}")
        self.speculation_action.setToolTip(f"{SPECULATION_TIP}\n{label}{step}")

    def _on_speculation_toggled(self, on: bool) -> None:
        self.worker.set_speculation(on)  # thread-safe: read by the engine at its next step
        self.settings.speculation = on
        self.statusBar().showMessage("Speculation on" if on else "Speculation off: the target alone", 3000)

    def _on_provenance_toggled(self, on: bool) -> None:
        self.settings.provenance = on
        self.view.set_provenance(on)
        self.legend.setVisible(on)

    def edit_system_prompt(self) -> None:
        dialog = SystemPromptDialog(self.chat.conversation.system_prompt, self)
        if dialog.exec() == QDialog.DialogCode.Accepted:
            self.chat.set_system_prompt(dialog.editor.toPlainText().strip())

    def set_theme(self, name: str) -> None:
        self._theme_choice = name
        self.settings.theme = name
        self._apply_theme()

    def _on_system_scheme(self) -> None:
        if self._theme_choice == "system":
            self._apply_theme()

    def _apply_theme(self) -> None:
        app = QApplication.instance()
        resolved = theme.apply(app, self._theme_choice) if isinstance(app, QApplication) else "light"
        tints = theme.tints(resolved)
        self.view.set_tints(tints)  # redraws the transcript (in slices) in the new colours
        self.legend.set_tints(tints)
        self.legend.setVisible(self.provenance_action.isChecked())

    def show_error(self, message: str) -> None:
        self.error_banner.show_message(message)
        self.errorShown.emit(message)

    def _about(self) -> None:
        QMessageBox.about(
            self,
            "About specdec",
            "specdec: chat with local models, made fast by exact speculative decoding.\n"
            "The answer is exactly what the target alone would write; tints show which tokens the draft got right.",
        )

    # ================================================================ geometry and closing
    def _restore_geometry(self) -> None:
        geometry = self.settings.geometry
        if not geometry.isEmpty():
            self.restoreGeometry(geometry)
        else:
            self.resize(1280, 800)
        state = self.settings.window_state
        if not state.isEmpty():
            self.restoreState(state)

    def closeEvent(self, event: QCloseEvent) -> None:
        if not self._closing:
            self._closing = True
            self.settings.geometry = QByteArray(self.saveGeometry())
            self.settings.window_state = QByteArray(self.saveState())
            self.settings.sync()
            self.hide()
            self.shutdown()
        super().closeEvent(event)

    def shutdown(self) -> None:
        """Cancel whatever runs and let the engine thread end on its own: never waits long."""
        self.engine_thread.wind_down()
        self.chat.shutdown()
