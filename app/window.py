"""The main window: sidebar of conversations, the transcript, the prompt, gauges and settings.

State lives here and nowhere else: the loaded pair (`PairInfo`), the load in
progress, the generation in progress and the open conversation. Model work is
asked of the `EngineWorker` through signals; its answers come back as signals
(see worker.py). Every message is saved the moment it exists.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import qtawesome as qta
from PySide6.QtCore import QByteArray, Qt, QThread, Signal
from PySide6.QtGui import QAction, QActionGroup, QCloseEvent, QGuiApplication, QKeyEvent, QKeySequence
from PySide6.QtWidgets import (
    QAbstractItemView,
    QApplication,
    QComboBox,
    QDialog,
    QDialogButtonBox,
    QFileDialog,
    QFrame,
    QHBoxLayout,
    QInputDialog,
    QLabel,
    QListWidget,
    QListWidgetItem,
    QMainWindow,
    QMenu,
    QMessageBox,
    QPlainTextEdit,
    QProgressBar,
    QPushButton,
    QSplitter,
    QToolBar,
    QToolButton,
    QVBoxLayout,
    QWidget,
)

from specdec_core.chat import Message
from specdec_core.compat import Compatibility
from specdec_core.loading import DEVICES, PRECISIONS

from . import catalog_info, theme
from .conversations import Conversation, ConversationStore, StoredMessage, StoredToken, title_from
from .settings import AppSettings
from .side_panel import SidePanel, answer_footer
from .token_view import TokenView
from .worker import (
    AnswerDone,
    CommittedToken,
    EngineWorker,
    GaugeUpdate,
    GenerateRequest,
    LoadRequest,
    PairInfo,
)

OPEN_FOLDER = "::open-folder"
OPEN_GGUF = "::open-gguf"
HUB_ID = "::hub-id"
DRAFT_LABELS = {"ngram": "n-gram (no model)", "none": "None (target alone)"}


@dataclass(frozen=True)
class ChatOptions:
    """What `specdec chat` was asked for; empty strings mean "the last used, else the default"."""

    target: str = ""
    draft: str = ""
    device: str = ""
    precision: str = ""
    theme: str = ""


class PromptEdit(QPlainTextEdit):
    """The input box: Enter sends, Shift+Enter inserts a newline, Esc cancels an edit."""

    submitted = Signal()
    escaped = Signal()

    def keyPressEvent(self, event: QKeyEvent) -> None:
        if event.key() in (Qt.Key.Key_Return, Qt.Key.Key_Enter):
            if event.modifiers() & Qt.KeyboardModifier.ShiftModifier:
                self.insertPlainText("\n")
            else:
                self.submitted.emit()
            return
        if event.key() == Qt.Key.Key_Escape:
            self.escaped.emit()
            return
        super().keyPressEvent(event)


class SystemPromptDialog(QDialog):
    def __init__(self, text: str, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setWindowTitle("System prompt")
        self.editor = QPlainTextEdit(text, objectName="systemPromptEdit")
        self.editor.setPlaceholderText("e.g. You are a concise assistant who answers with code first.")
        buttons = QDialogButtonBox(
            QDialogButtonBox.StandardButton.Ok | QDialogButtonBox.StandardButton.Cancel
        )
        buttons.accepted.connect(self.accept)
        buttons.rejected.connect(self.reject)
        layout = QVBoxLayout(self)
        layout.addWidget(QLabel("Applies to this conversation and becomes the default for new chats."))
        layout.addWidget(self.editor)
        layout.addWidget(buttons)
        self.resize(520, 300)


class MainWindow(QMainWindow):
    # Requests to the worker (queued into its thread).
    loadRequested = Signal(object)
    swapDraftRequested = Signal(object)
    generateRequested = Signal(object)
    checkDraftsRequested = Signal(object)
    # What happened, for tests and anyone embedding the window.
    modelReady = Signal(object)  # PairInfo
    draftMenuUpdated = Signal()
    answerProgressed = Signal(int)  # tokens of the streaming answer received so far
    answerFinished = Signal(object)  # StoredMessage
    errorShown = Signal(str)

    def __init__(self, options: ChatOptions, settings: AppSettings | None = None) -> None:
        super().__init__()
        self.settings = settings or AppSettings()
        self.store = ConversationStore()
        self.conversation = Conversation.new(self.settings.system_prompt)
        self.pair: PairInfo | None = None
        self._loading: LoadRequest | None = None
        self._generation: GenerateRequest | None = None
        self._live: list[CommittedToken] = []
        self._live_shown: list[StoredToken] = []
        self._editing: int | None = None
        self._send_when_ready = False
        self._verdicts: dict[str, Compatibility] = {}
        self._closing = False
        self._theme_choice = options.theme or self.settings.theme
        self._target, self._draft = self._initial_models(options)
        self._device = options.device or self.settings.device
        self._precision = options.precision or self.settings.precision

        self.setWindowTitle("specdec")
        self.setWindowIcon(theme.app_icon())
        self._build_ui()
        self._start_worker()
        self._apply_theme()
        QGuiApplication.styleHints().colorSchemeChanged.connect(self._on_system_scheme)
        self._restore_geometry()
        self._reopen_last_conversation()
        self._request_load(self._target, self._draft)

    # ================================================================ construction
    def _initial_models(self, options: ChatOptions) -> tuple[str, str]:
        target = options.target or self.settings.target or catalog_info.default_target()
        if options.draft:
            return target, options.draft
        if not options.target or target == self.settings.target:
            return target, self.settings.draft or catalog_info.default_draft()
        entry = catalog_info.entry(target)
        return target, entry.recommended_drafts[0] if entry and entry.recommended_drafts else "ngram"

    def _build_ui(self) -> None:
        self._build_actions()
        self._build_toolbar()
        self._build_menus()

        self.conversation_list = QListWidget(objectName="conversationList")
        self.conversation_list.setEditTriggers(QAbstractItemView.EditTrigger.EditKeyPressed)
        self.conversation_list.setTextElideMode(Qt.TextElideMode.ElideRight)
        self.conversation_list.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.conversation_list.setContextMenuPolicy(Qt.ContextMenuPolicy.CustomContextMenu)
        self.conversation_list.customContextMenuRequested.connect(self._conversation_menu)
        self.conversation_list.itemClicked.connect(self._on_conversation_clicked)
        self.conversation_list.itemChanged.connect(self._on_conversation_renamed)
        self.conversation_list.itemDoubleClicked.connect(self.conversation_list.editItem)
        new_button = QPushButton(qta.icon("mdi6.plus"), "New chat", objectName="newChatButton")
        new_button.clicked.connect(self.new_chat)
        sidebar = QWidget()
        side_layout = QVBoxLayout(sidebar)
        side_layout.setContentsMargins(6, 6, 0, 6)
        side_layout.addWidget(new_button)
        side_layout.addWidget(self.conversation_list)
        sidebar.setMinimumWidth(170)

        self.error_banner = QFrame(objectName="errorBanner")
        self.error_text = QLabel(objectName="errorText")
        self.error_text.setWordWrap(True)
        self.error_text.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        dismiss = QToolButton()
        dismiss.setIcon(qta.icon("mdi6.close"))
        dismiss.setToolTip("Dismiss")
        dismiss.clicked.connect(self.error_banner.hide)
        banner_layout = QHBoxLayout(self.error_banner)
        banner_layout.addWidget(
            QLabel(pixmap=qta.icon("mdi6.alert-circle-outline", color="#dc2626").pixmap(18))
        )
        banner_layout.addWidget(self.error_text, 1)
        banner_layout.addWidget(dismiss)
        self.error_banner.hide()

        self.load_panel = QFrame(objectName="loadPanel")
        self.load_stage = QLabel("Loading…", objectName="loadStage")
        self.load_progress = QProgressBar(objectName="loadProgress")
        self.load_progress.setTextVisible(True)
        self.load_cancel = QPushButton("Cancel", objectName="loadCancelButton")
        self.load_cancel.clicked.connect(self.cancel_load)
        load_layout = QHBoxLayout(self.load_panel)
        load_layout.addWidget(self.load_stage, 1)
        load_layout.addWidget(self.load_progress, 1)
        load_layout.addWidget(self.load_cancel)
        self.load_panel.hide()

        self.view = TokenView()
        self.view.actionRequested.connect(self._on_message_action)
        self.view.set_placeholder("Ask anything. Enter sends, Shift+Enter starts a new line.")
        self.legend = QLabel(objectName="legendLabel")
        self.legend.setTextFormat(Qt.TextFormat.RichText)
        self.edit_banner = QLabel(objectName="editBanner")
        self.edit_banner.hide()

        self.prompt = PromptEdit(objectName="promptEdit")
        self.prompt.setPlaceholderText("Message the model…  (Enter to send, Shift+Enter for a new line)")
        self.prompt.setFixedHeight(84)
        self.prompt.submitted.connect(self.send)
        self.prompt.escaped.connect(self.cancel_edit)
        self.send_button = QPushButton(qta.icon("mdi6.send", color="white"), "Send", objectName="sendButton")
        self.send_button.clicked.connect(self.send)
        self.stop_button = QPushButton(qta.icon("mdi6.stop", color="white"), "Stop", objectName="stopButton")
        self.stop_button.clicked.connect(self.stop)
        buttons = QVBoxLayout()
        buttons.addWidget(self.send_button)
        buttons.addWidget(self.stop_button)
        input_row = QHBoxLayout()
        input_row.addWidget(self.prompt, 1)
        input_row.addLayout(buttons)

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
        input_holder = QHBoxLayout()
        input_holder.setContentsMargins(12, 0, 12, 0)
        input_holder.addLayout(input_row)
        chat_layout.addLayout(input_holder)

        self.side = SidePanel(self.settings)
        self.side.generation.systemPromptRequested.connect(self.edit_system_prompt)
        self.gauges = self.side.gauges

        self.splitter = QSplitter(objectName="mainSplitter")
        self.splitter.addWidget(sidebar)
        self.splitter.addWidget(chat)
        self.splitter.addWidget(self.side)
        self.splitter.setStretchFactor(1, 1)
        self.splitter.setSizes([210, 760, 290])
        self.setCentralWidget(self.splitter)
        self.statusBar().showMessage("Starting…")
        self._refresh_conversation_list()
        self._update_controls()

    def _build_actions(self) -> None:
        self.speculation_action = QAction(qta.icon("mdi6.lightning-bolt"), "Speculation", self)
        self.speculation_action.setObjectName("speculationToggle")
        self.speculation_action.setCheckable(True)
        self.speculation_action.setChecked(self.settings.speculation)
        self.speculation_action.setShortcut(QKeySequence("Ctrl+Shift+S"))
        self.speculation_action.setToolTip(
            "Speculative decoding on/off (Ctrl+Shift+S); applies from the next step of the running answer"
        )
        self.speculation_action.toggled.connect(self._on_speculation_toggled)
        self.provenance_action = QAction(qta.icon("mdi6.palette-outline"), "Show provenance", self)
        self.provenance_action.setObjectName("provenanceToggle")
        self.provenance_action.setCheckable(True)
        self.provenance_action.setChecked(self.settings.provenance)
        self.provenance_action.setShortcut(QKeySequence("Ctrl+Shift+P"))
        self.provenance_action.setToolTip("Tint each token by where it came from (Ctrl+Shift+P)")
        self.provenance_action.toggled.connect(self._on_provenance_toggled)
        self.new_chat_action = QAction(qta.icon("mdi6.plus"), "New chat", self)
        self.new_chat_action.setShortcut(QKeySequence.StandardKey.New)
        self.new_chat_action.triggered.connect(self.new_chat)
        self.regenerate_action = QAction(qta.icon("mdi6.refresh"), "Regenerate", self)
        self.regenerate_action.setShortcut(QKeySequence("Ctrl+R"))
        self.regenerate_action.triggered.connect(lambda: self.regenerate())
        self.stop_action = QAction(qta.icon("mdi6.stop"), "Stop", self)
        self.stop_action.setShortcut(QKeySequence("Ctrl+."))
        self.stop_action.triggered.connect(self.stop)
        self.copy_answer_action = QAction(qta.icon("mdi6.content-copy"), "Copy last answer", self)
        self.copy_answer_action.setShortcut(QKeySequence("Ctrl+Shift+C"))
        self.copy_answer_action.triggered.connect(self.copy_last_answer)
        self.system_prompt_action = QAction("System prompt…", self)
        self.system_prompt_action.triggered.connect(self.edit_system_prompt)
        self.quit_action = QAction("Quit", self)
        self.quit_action.setShortcut(QKeySequence.StandardKey.Quit)
        self.quit_action.triggered.connect(self.close)

    def _build_toolbar(self) -> None:
        bar = QToolBar("Models", objectName="mainToolbar")
        bar.setMovable(False)
        bar.setToolButtonStyle(Qt.ToolButtonStyle.ToolButtonTextBesideIcon)
        self.addToolBar(bar)
        self.target_menu = QComboBox(objectName="targetMenu")
        self.target_menu.setMinimumContentsLength(22)
        self.target_menu.setToolTip("Target model: the one whose answer you get")
        self.target_menu.activated.connect(self._on_target_activated)
        self.draft_menu = QComboBox(objectName="draftMenu")
        self.draft_menu.setMinimumContentsLength(20)
        self.draft_menu.setToolTip("Draft: proposes tokens for the target to verify")
        self.draft_menu.activated.connect(self._on_draft_activated)
        self.device_menu = QComboBox(objectName="deviceMenu")
        self.device_menu.addItems(list(DEVICES))
        self.device_menu.setCurrentText(self._device)
        self.device_menu.setToolTip("Device (auto: CUDA when available)")
        self.device_menu.activated.connect(self._on_device_or_precision)
        self.precision_menu = QComboBox(objectName="precisionMenu")
        self.precision_menu.addItems(list(PRECISIONS))
        self.precision_menu.setCurrentText(self._precision)
        self.precision_menu.setToolTip("Precision (auto: the fastest that fits; CPU int8 is exact per token)")
        self.precision_menu.activated.connect(self._on_device_or_precision)
        self.resolved_label = QLabel("", objectName="resolvedLabel")
        self.resolved_label.setToolTip("What the target actually runs on")
        bar.addWidget(QLabel(" Target "))
        bar.addWidget(self.target_menu)
        bar.addWidget(QLabel("  Draft "))
        bar.addWidget(self.draft_menu)
        bar.addSeparator()
        bar.addWidget(self.device_menu)
        bar.addWidget(self.precision_menu)
        bar.addWidget(self.resolved_label)
        bar.addSeparator()
        bar.addAction(self.speculation_action)
        bar.addAction(self.provenance_action)
        self._fill_target_menu()
        self._fill_draft_menu()

    def _build_menus(self) -> None:
        file_menu = self.menuBar().addMenu("&File")
        file_menu.addAction(self.new_chat_action)
        file_menu.addSeparator()
        file_menu.addAction(self.quit_action)
        chat_menu = self.menuBar().addMenu("&Chat")
        for action in (self.regenerate_action, self.stop_action, self.copy_answer_action):
            chat_menu.addAction(action)
        chat_menu.addSeparator()
        chat_menu.addAction(self.system_prompt_action)
        chat_menu.addAction(self.speculation_action)
        view_menu = self.menuBar().addMenu("&View")
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
        help_menu = self.menuBar().addMenu("&Help")
        about = QAction("About specdec", self)
        about.triggered.connect(self._about)
        help_menu.addAction(about)

    def _start_worker(self) -> None:
        self.engine_thread = QThread(self)
        self.engine_thread.setObjectName("specdec-engine")
        self.worker = EngineWorker()
        self.worker.moveToThread(self.engine_thread)
        self.engine_thread.finished.connect(self.worker.deleteLater)
        self.loadRequested.connect(self.worker.load)
        self.swapDraftRequested.connect(self.worker.swap_draft)
        self.generateRequested.connect(self.worker.generate)
        self.checkDraftsRequested.connect(self.worker.check_drafts)
        self.worker.loadProgress.connect(self._on_load_progress)
        self.worker.loaded.connect(self._on_loaded)
        self.worker.loadFailed.connect(self._on_load_failed)
        self.worker.loadCancelled.connect(self._on_load_cancelled)
        self.worker.draftVerdicts.connect(self._on_draft_verdicts)
        self.worker.tokensCommitted.connect(self._on_tokens)
        self.worker.gaugesUpdated.connect(self._on_gauges)
        self.worker.answerDone.connect(self._on_answer_done)
        self.worker.generationFailed.connect(self._on_generation_failed)
        self.worker.set_speculation(self.speculation_action.isChecked())
        self.engine_thread.start()

    # ================================================================ model menus
    def _fill_target_menu(self) -> None:
        menu = self.target_menu
        menu.blockSignals(True)
        menu.clear()
        seen: set[str] = set()
        for entry in catalog_info.entries():
            if "target" in entry.roles:
                menu.addItem(entry.name, entry.name)
                menu.setItemData(
                    menu.count() - 1, catalog_info.describe(entry.name), Qt.ItemDataRole.ToolTipRole
                )
                seen.add(entry.name)
        for ref in [self._target, *self.settings.recent_models]:
            if ref and ref not in seen:
                menu.addItem(_short(ref), ref)
                menu.setItemData(menu.count() - 1, ref, Qt.ItemDataRole.ToolTipRole)
                seen.add(ref)
        menu.insertSeparator(menu.count())
        menu.addItem(qta.icon("mdi6.folder-open-outline"), "Open model folder…", OPEN_FOLDER)
        menu.addItem(qta.icon("mdi6.file-outline"), "Open GGUF file…", OPEN_GGUF)
        menu.addItem(qta.icon("mdi6.cloud-download-outline"), "Hub id…", HUB_ID)
        menu.setCurrentIndex(max(0, menu.findData(self._target)))
        menu.blockSignals(False)

    def _draft_candidates(self) -> list[str]:
        refs: list[str] = []
        for entry in catalog_info.entries():
            if "draft" in entry.roles:
                refs.append(entry.name)
        refs += [self._draft, *self.settings.recent_models]
        out: list[str] = []
        for ref in refs:
            if ref and ref not in out and ref not in DRAFT_LABELS and ref != self._target:
                out.append(ref)
        return out

    def _fill_draft_menu(self) -> None:
        """Compatible drafts first, then n-gram and None, then unchecked, then incompatible (disabled)."""
        menu = self.draft_menu
        menu.blockSignals(True)
        menu.clear()
        candidates = self._draft_candidates()
        verdicts = {ref: self._verdicts.get(ref) for ref in candidates}
        compatible = [r for r in candidates if verdicts[r] is not None and verdicts[r].compatible]
        unchecked = [r for r in candidates if verdicts[r] is None]
        incompatible = [r for r in candidates if verdicts[r] is not None and not verdicts[r].compatible]
        for ref in compatible + unchecked:
            verdict = verdicts[ref]
            self._add_draft_item(
                ref, verdict.reason if verdict else "compatibility checked once the target loads"
            )
        menu.addItem(DRAFT_LABELS["ngram"], "ngram")
        menu.setItemData(
            menu.count() - 1,
            "Prompt lookup: drafts by copying from the text so far",
            Qt.ItemDataRole.ToolTipRole,
        )
        menu.addItem(DRAFT_LABELS["none"], "none")
        menu.setItemData(menu.count() - 1, "No speculation: the target alone", Qt.ItemDataRole.ToolTipRole)
        for ref in unchecked:
            self._add_draft_item(ref, "not checked yet: decided from its tokenizer when it loads")
        for ref in incompatible:
            reason = verdicts[ref].reason  # type: ignore[union-attr]
            self._add_draft_item(ref, f"Incompatible with the target: {reason}", enabled=False)
        menu.insertSeparator(menu.count())
        menu.addItem(qta.icon("mdi6.folder-open-outline"), "Open model folder…", OPEN_FOLDER)
        menu.addItem(qta.icon("mdi6.file-outline"), "Open GGUF file…", OPEN_GGUF)
        menu.addItem(qta.icon("mdi6.cloud-download-outline"), "Hub id…", HUB_ID)
        menu.setCurrentIndex(max(0, menu.findData(self._draft)))
        menu.blockSignals(False)

    def _add_draft_item(self, ref: str, tooltip: str, enabled: bool = True) -> None:
        menu = self.draft_menu
        menu.addItem(_short(ref), ref)
        index = menu.count() - 1
        menu.setItemData(index, tooltip, Qt.ItemDataRole.ToolTipRole)
        if not enabled:
            item = menu.model().item(index)
            item.setEnabled(False)

    def draft_menu_entries(self) -> list[tuple[str, str, bool, str]]:
        """(label, ref, enabled, tooltip) of every draft menu item, for tests and checks."""
        menu = self.draft_menu
        out = []
        for i in range(menu.count()):
            item = menu.model().item(i)
            ref = menu.itemData(i)
            if ref is None:
                continue  # a separator
            tooltip = menu.itemData(i, Qt.ItemDataRole.ToolTipRole) or ""
            out.append((menu.itemText(i), str(ref), item.isEnabled(), str(tooltip)))
        return out

    def _choose_ref(self, kind: str) -> str:
        if kind == OPEN_FOLDER:
            return QFileDialog.getExistingDirectory(self, "Open a Hugging Face model folder")
        if kind == OPEN_GGUF:
            path, _ = QFileDialog.getOpenFileName(self, "Open a GGUF file", "", "GGUF models (*.gguf)")
            return path
        text, ok = QInputDialog.getText(
            self, "Hub id", "Hugging Face hub id (e.g. Qwen/Qwen2.5-0.5B-Instruct):"
        )
        return text.strip() if ok else ""

    def _on_target_activated(self, index: int) -> None:
        ref = str(self.target_menu.itemData(index))
        if ref in (OPEN_FOLDER, OPEN_GGUF, HUB_ID):
            ref = self._choose_ref(ref)
            if not ref:
                self._fill_target_menu()
                return
        if ref == self._target and self.pair is not None:
            return
        self.settings.remember_model(ref)
        self._verdicts = {}
        self._request_load(ref, self._draft)

    def _on_draft_activated(self, index: int) -> None:
        spec = str(self.draft_menu.itemData(index))
        if spec in (OPEN_FOLDER, OPEN_GGUF, HUB_ID):
            spec = self._choose_ref(spec)
            if not spec:
                self._fill_draft_menu()
                return
            self.settings.remember_model(spec)
        if spec == self._draft and self.pair is not None:
            return
        self._draft = spec
        if self.pair is None:
            self._request_load(self._target, spec)
            return
        request = LoadRequest(self._target, spec, self._device, self._precision)
        self._begin_loading(request)
        self.swapDraftRequested.emit(request)

    def _on_device_or_precision(self) -> None:
        device, precision = self.device_menu.currentText(), self.precision_menu.currentText()
        if (device, precision) == (self._device, self._precision):
            return
        self._device, self._precision = device, precision
        self.settings.device, self.settings.precision = device, precision
        self._request_load(self._target, self._draft)

    # ================================================================ loading
    def _request_load(self, target: str, draft: str) -> None:
        if self._generation is not None:
            self.stop()
        if self._loading is not None:
            self.worker.cancel_load(self._loading)
        self._target, self._draft = target, draft
        self.pair = None
        self._fill_target_menu()
        self._fill_draft_menu()
        request = LoadRequest(target, draft, self._device, self._precision)
        self._begin_loading(request)
        self.loadRequested.emit(request)

    def _begin_loading(self, request: LoadRequest) -> None:
        self._loading = request
        self.load_stage.setText(f"Loading {_short(request.target)}…")
        self.load_progress.setRange(0, 0)
        self.load_panel.show()
        self.statusBar().showMessage("Loading models…")
        self._update_controls()

    def cancel_load(self) -> None:
        if self._loading is not None:
            self.worker.cancel_load(self._loading)
            self.load_stage.setText("Cancelling…")

    def _on_load_progress(self, stage: str, done: int, total: int) -> None:
        self.load_stage.setText(stage)
        if total > 0:
            self.load_progress.setRange(0, 1000)
            self.load_progress.setValue(int(1000 * done / total))
            self.load_progress.setFormat(f"%p%  ({done / 2**20:.0f} / {total / 2**20:.0f} MiB)")
        else:
            self.load_progress.setRange(0, 0)

    def _on_loaded(self, info: PairInfo) -> None:
        self._loading = None
        self.pair = info
        self._target, self._draft = info.target, info.draft
        self.settings.target, self.settings.draft = info.target, info.draft
        self.settings.remember_model(info.target) if Path(info.target).exists() else None
        self.load_panel.hide()
        self.resolved_label.setText(info.description)
        self.statusBar().showMessage(
            f"Ready: {info.target_name} on {info.description}, draft {info.draft_name}"
        )
        if info.warning:
            self.show_error(info.warning)
        self._fill_target_menu()
        self._fill_draft_menu()
        self.checkDraftsRequested.emit(self._draft_candidates())
        self._update_controls()
        self.modelReady.emit(info)
        if self._send_when_ready:
            self._send_when_ready = False
            self.send()

    def _on_load_failed(self, message: str) -> None:
        self._loading = None
        self._send_when_ready = False
        self.load_panel.hide()
        self.statusBar().showMessage("No model loaded")
        self.show_error(message)
        self._update_controls()

    def _on_load_cancelled(self) -> None:
        self._loading = None
        self._send_when_ready = False
        self.load_panel.hide()
        self.statusBar().showMessage("Loading cancelled: choose a model to load")
        self._update_controls()

    def _on_draft_verdicts(self, verdicts: dict[str, Compatibility]) -> None:
        self._verdicts.update(verdicts)
        self._fill_draft_menu()
        self.draftMenuUpdated.emit()

    # ================================================================ chat
    def send(self) -> None:
        text = self.prompt.toPlainText().strip()
        if text and self._loading is not None and self._generation is None:
            # Typed before the model was ready: send it as soon as loading ends.
            self._send_when_ready = True
            self.statusBar().showMessage("Will send when the model is ready…")
            return
        if not text or not self._can_send():
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
        self.prompt.clear()
        if not edited and self.view.message_count() == len(conversation.messages) - 1:
            self.view.append_message(message)  # the usual case: no redraw of what is shown
        else:
            self.view.render_messages(conversation.messages)
        self._start_generation()

    def regenerate(self, index: int | None = None) -> None:
        """Answer again from the user message before answer `index` (default: the last answer)."""
        messages = self.conversation.messages
        if not self._can_send() or not messages:
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
        request = GenerateRequest(
            history, self.conversation.system_prompt or None, self.side.generation.params()
        )
        self._generation = request
        self._live, self._live_shown = [], []
        self.gauges.reset()
        self.view.begin_live(self._answer_header())
        self.statusBar().showMessage("Generating…")
        self._update_controls()
        self.generateRequested.emit(request)

    def stop(self) -> None:
        if self._generation is not None:
            self.worker.stop(self._generation)
            self.statusBar().showMessage("Stopping…")
            self.stop_button.setEnabled(False)

    def _on_tokens(self, batch: tuple[CommittedToken, ...]) -> None:
        if self._generation is None:
            return
        self._take(batch)
        self.view.update_live(self._live_shown)
        self.answerProgressed.emit(len(self._live))

    def _take(self, batch: tuple[CommittedToken, ...]) -> None:
        self._live.extend(batch)
        self._live_shown.extend(
            StoredToken(t.text, t.source, t.step, t.target_prob, t.draft_prob) for t in batch if not t.is_stop
        )

    def _on_gauges(self, update: GaugeUpdate) -> None:
        if self._generation is not None:
            self.gauges.show_update(update, self.side.generation.pinned_k())

    def _on_answer_done(self, result: AnswerDone) -> None:
        if self._generation is None:
            return
        self._take(result.tokens)
        stats = result.done.stats
        draft_name = self.pair.draft_name if self.pair and stats.drafter != "none" else "none"
        footer = answer_footer(stats, draft_name)
        message = StoredMessage(
            "assistant",
            result.text,
            tokens=list(self._live_shown),
            footer=footer,
            stopped=stats.stop_reason == "cancelled",
        )
        self._generation = None
        self.conversation.messages.append(message)
        self._save()
        self.view.finish_live(message)
        self.gauges.show_final(stats, footer)
        self.statusBar().showMessage(footer)
        self._update_controls()
        self.answerFinished.emit(message)

    def _on_generation_failed(self, message: str) -> None:
        self._generation = None
        self.view.end_live()
        self.view.render_messages(self.conversation.messages)
        self.show_error(message)
        self._update_controls()

    def live_token_ids(self) -> list[int]:
        """Token ids of the answer being (or last) generated, end-of-turn included."""
        return [t.token_id for t in self._live]

    def _answer_header(self) -> str:
        if self.pair is None:
            return "Assistant"
        return f"Assistant · {self.pair.target_name}"

    # ================================================================ message actions
    def _on_message_action(self, action: str, index: int) -> None:
        if index >= len(self.conversation.messages):
            return
        message = self.conversation.messages[index]
        if action == "copy":
            QGuiApplication.clipboard().setText(message.content)
            self.statusBar().showMessage("Copied", 2000)
        elif action == "edit" and message.role == "user":
            self.start_edit(index)
        elif action == "regenerate" and message.role == "assistant":
            self.regenerate(index)

    def start_edit(self, index: int) -> None:
        """Edit-and-resend: the prompt takes the message; sending replaces it and what followed."""
        self._editing = index
        self.prompt.setPlainText(self.conversation.messages[index].content)
        self.prompt.setFocus()
        self.edit_banner.setText(
            "  Editing an earlier message: Send replaces it and everything after it (Esc cancels)"
        )
        self.edit_banner.show()

    def cancel_edit(self) -> None:
        if self._editing is not None:
            self._editing = None
            self.edit_banner.hide()

    def copy_last_answer(self) -> None:
        answers = [m for m in self.conversation.messages if m.role == "assistant"]
        if answers:
            QGuiApplication.clipboard().setText(answers[-1].content)

    def edit_system_prompt(self) -> None:
        dialog = SystemPromptDialog(self.conversation.system_prompt, self)
        if dialog.exec() == QDialog.DialogCode.Accepted:
            text = dialog.editor.toPlainText().strip()
            self.conversation.system_prompt = text
            self.settings.system_prompt = text
            if self.conversation.messages:
                self._save()

    # ================================================================ conversations
    def new_chat(self) -> None:
        if self._generation is not None:
            self.statusBar().showMessage("Stop the answer first", 3000)
            return
        self.cancel_edit()
        self.conversation = Conversation.new(self.settings.system_prompt)
        self.view.render_messages([])
        self.gauges.reset()
        self.gauges.footer.setText("")
        self._refresh_conversation_list()
        self.prompt.setFocus()

    def open_conversation(self, conversation_id: str) -> None:
        if self._generation is not None:
            self.statusBar().showMessage("Stop the answer first", 3000)
            self._refresh_conversation_list()
            return
        try:
            self.conversation = self.store.load(conversation_id)
        except (OSError, ValueError, KeyError) as exc:
            self.show_error(f"cannot open that conversation: {exc}")
            return
        self.cancel_edit()
        self.settings.last_conversation = conversation_id
        self.view.render_messages(self.conversation.messages)
        footers = [m.footer for m in self.conversation.messages if m.footer]
        self.gauges.reset()
        self.gauges.footer.setText(footers[-1] if footers else "")
        self._refresh_conversation_list()

    def rename_conversation(self, conversation_id: str, title: str) -> None:
        title = title.strip()
        if not title:
            return
        if conversation_id == self.conversation.id:
            self.conversation.title = title
            if self.conversation.messages:
                self._save()
            return
        conversation = self.store.load(conversation_id)
        conversation.title = title
        self.store.save(conversation)
        self._refresh_conversation_list()

    def delete_conversation(self, conversation_id: str) -> None:
        self.store.delete(conversation_id)
        if conversation_id == self.conversation.id:
            self.new_chat()
        self._refresh_conversation_list()

    def _reopen_last_conversation(self) -> None:
        last = self.settings.last_conversation
        if last and self.store.path(last).is_file():
            self.open_conversation(last)

    def _save(self) -> None:
        self.store.save(self.conversation)
        self.settings.last_conversation = self.conversation.id
        self._refresh_conversation_list()

    def _refresh_conversation_list(self) -> None:
        widget = self.conversation_list
        widget.blockSignals(True)
        widget.clear()
        for conversation in self.store.list():
            item = QListWidgetItem(conversation.title)
            item.setData(Qt.ItemDataRole.UserRole, conversation.id)
            item.setToolTip(f"{len(conversation.messages)} messages")
            item.setFlags(item.flags() | Qt.ItemFlag.ItemIsEditable)
            widget.addItem(item)
            if conversation.id == self.conversation.id:
                widget.setCurrentItem(item)
        widget.blockSignals(False)

    def _on_conversation_clicked(self, item: QListWidgetItem) -> None:
        conversation_id = str(item.data(Qt.ItemDataRole.UserRole))
        if conversation_id != self.conversation.id:
            self.open_conversation(conversation_id)

    def _on_conversation_renamed(self, item: QListWidgetItem) -> None:
        self.rename_conversation(str(item.data(Qt.ItemDataRole.UserRole)), item.text())

    def _conversation_menu(self, point) -> None:
        item = self.conversation_list.itemAt(point)
        if item is None:
            return
        conversation_id = str(item.data(Qt.ItemDataRole.UserRole))
        menu = QMenu(self)
        rename = menu.addAction(qta.icon("mdi6.pencil-outline"), "Rename")
        delete = menu.addAction(qta.icon("mdi6.delete-outline"), "Delete")
        chosen = menu.exec(self.conversation_list.viewport().mapToGlobal(point))
        if chosen is rename:
            self.conversation_list.editItem(item)
        elif chosen is delete:
            answer = QMessageBox.question(self, "Delete conversation", f"Delete “{item.text()}”?")
            if answer == QMessageBox.StandardButton.Yes:
                self.delete_conversation(conversation_id)

    # ================================================================ toggles, theme, errors
    def _on_speculation_toggled(self, on: bool) -> None:
        self.worker.set_speculation(on)  # thread-safe: read by the engine at its next step
        self.settings.speculation = on
        self.statusBar().showMessage("Speculation on" if on else "Speculation off: the target alone", 3000)

    def _on_provenance_toggled(self, on: bool) -> None:
        self.settings.provenance = on
        self.view.set_provenance(on)
        self.legend.setVisible(on)

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
        self.view.set_provenance(self.provenance_action.isChecked())
        self.view.set_tints(tints)
        self.legend.setText(_legend_html(tints))
        self.legend.setVisible(self.provenance_action.isChecked())

    def show_error(self, message: str) -> None:
        self.error_text.setText(message)
        self.error_banner.show()
        self.errorShown.emit(message)

    def _about(self) -> None:
        QMessageBox.about(
            self,
            "About specdec",
            "specdec: chat with local models, made fast by exact speculative decoding.\n"
            "The answer is exactly what the target alone would write; tints show which tokens the draft got right.",
        )

    def _can_send(self) -> bool:
        return self.pair is not None and self._loading is None and self._generation is None

    def _update_controls(self) -> None:
        generating = self._generation is not None
        self.send_button.setEnabled(
            self._can_send() or (self._loading is not None and self._generation is None)
        )
        self.send_button.setToolTip("" if self.pair else "Waiting for a model to load")
        self.stop_button.setEnabled(generating)
        self.stop_action.setEnabled(generating)
        self.regenerate_action.setEnabled(self._can_send() and bool(self.conversation.messages))
        for widget in (self.target_menu, self.draft_menu, self.device_menu, self.precision_menu):
            widget.setEnabled(not generating)

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
        """Cancel whatever runs, stop the engine thread and wait for it (one step at most)."""
        self.worker.cancel_everything()
        self.engine_thread.quit()
        self.engine_thread.wait()


def _short(ref: str) -> str:
    path = Path(ref)
    return path.name if (path.is_absolute() or ref.startswith((".", "~"))) and path.name else ref


def _legend_html(tints: theme.Tints) -> str:
    def chip(color: str, label: str, underline: bool = False) -> str:
        style = f"background-color:{color};"
        if underline:
            style += " text-decoration: underline; color: inherit;"
        return f'<span style="{style}">&nbsp;{label}&nbsp;</span>'

    return (
        chip(tints.accepted.name(), "accepted draft")
        + " &nbsp; "
        + chip(tints.corrected.name(), "corrected by target", underline=True)
        + " &nbsp; "
        + chip(tints.bonus.name(), "bonus")
        + " &nbsp; target (no tint) &nbsp;·&nbsp; hover a token for details"
    )
