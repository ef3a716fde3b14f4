"""Which models are loaded and which are loading: load, swap the draft, cancel.

The one owner of the model state: the chosen target, draft, device and precision,
the loaded pair (the session's `SessionInfo`, None while nothing is usable), the
load in flight and the draft verdicts (the session's, from `rate_drafts`). It asks the `EngineWorker` for work through its request
signals (queued into the worker thread) and keeps the toolbar's menus and the
load panel in step with the answers.
"""

from __future__ import annotations

from pathlib import Path

from PySide6.QtCore import QObject, Signal

from specdec_core import Compatibility, SessionInfo

from . import catalog_info, gc_guard
from .model_toolbar import DRAFT_LABELS, ModelToolbar, ask_llama_server, short_ref
from .settings import AppSettings
from .widgets import LoadPanel
from .worker import EngineWorker, LoadRequest


class ModelController(QObject):
    # Requests to the worker (queued into its thread).
    loadRequested = Signal(object)  # LoadRequest
    swapDraftRequested = Signal(object)  # LoadRequest
    # What happened.
    loadStarting = Signal()  # a new load replaces the pair: a running answer must stop
    modelReady = Signal(object)  # SessionInfo
    stateChanged = Signal()  # loading began or ended
    draftMenuUpdated = Signal()
    errorRaised = Signal(str)
    statusChanged = Signal(str)

    def __init__(
        self,
        settings: AppSettings,
        toolbar: ModelToolbar,
        load_panel: LoadPanel,
        models: tuple[str, str, str, str],  # target, draft, device, precision
        parent: QObject | None = None,
    ) -> None:
        super().__init__(parent)
        self.settings = settings
        self.toolbar = toolbar
        self.load_panel = load_panel
        self.target, self.draft, self.device, self.precision = models
        # Asked for on the command line for this run only: never saved in the settings.
        self.offload = False
        self.trust_remote_code = False
        # The target served by llama.cpp's server started here: its binary ("auto": the
        # default one); "" = answered in-process or by the server the target names.
        self.local_server = ""
        self.pair: SessionInfo | None = None
        self._loading: LoadRequest | None = None
        self._verdicts: dict[str, Compatibility] = {}
        self._worker: EngineWorker | None = None
        toolbar.targetChosen.connect(self._on_target_chosen)
        toolbar.localServerRequested.connect(self._on_local_server_requested)
        toolbar.draftChosen.connect(self._on_draft_chosen)
        toolbar.placementChosen.connect(self._on_placement_chosen)
        load_panel.cancelRequested.connect(self.cancel_load)
        self.fill_menus()

    def attach(self, worker: EngineWorker) -> None:
        """Wire this controller to the worker (before the worker's thread starts)."""
        self._worker = worker
        self.loadRequested.connect(worker.load)
        self.swapDraftRequested.connect(worker.swap_draft)
        worker.loadProgress.connect(self.load_panel.show_progress)
        worker.loaded.connect(self._on_loaded)
        worker.loadFailed.connect(self._on_load_failed)
        worker.loadCancelled.connect(self._on_load_cancelled)
        worker.draftVerdicts.connect(self._on_draft_verdicts)

    @property
    def loading(self) -> bool:
        return self._loading is not None

    @property
    def ready(self) -> bool:
        """A pair is loaded and nothing is loading: messages can be answered."""
        return self.pair is not None and self._loading is None

    # -- requests ---------------------------------------------------------------------------
    def request_load(self, target: str | None = None, draft: str | None = None) -> None:
        """Load `target` with `draft` (default: the current ones), replacing what is loaded."""
        self.loadStarting.emit()
        if self._loading is not None and self._worker is not None:
            self._worker.cancel_load(self._loading)
        self.target = self.target if target is None else target
        self.draft = self.draft if draft is None else draft
        self.pair = None
        self.fill_menus()
        request = self._request(self.draft)
        self._begin_loading(request)
        self.loadRequested.emit(request)

    def cancel_load(self) -> None:
        if self._loading is not None and self._worker is not None:
            self._worker.cancel_load(self._loading)
            self.load_panel.stage.setText("Cancelling…")

    def _request(self, draft: str) -> LoadRequest:
        return LoadRequest(
            self.target,
            draft,
            self.device,
            self.precision,
            self.offload,
            self.trust_remote_code,
            # A server runs whichever .gguf draft it is started with: nothing to rate.
            () if self.local_server else tuple(self.draft_candidates()),
            self.local_server,
        )

    def _begin_loading(self, request: LoadRequest) -> None:
        gc_guard.thaw()  # the pair being replaced may sit in reference cycles
        self._loading = request
        self.load_panel.begin(f"Loading {short_ref(request.target)}…")
        self.statusChanged.emit("Loading models…")
        self.stateChanged.emit()

    def _on_target_chosen(self, ref: str) -> None:
        if ref == self.target and self.pair is not None:
            return
        self.settings.remember_model(ref)
        self._verdicts = {}
        self.local_server = ""  # another target: in-process (or the server it names)
        self.request_load(ref, self.draft)

    def _on_local_server_requested(self) -> None:
        binary = ask_llama_server(self.toolbar, self.target, self.draft, self.settings.llama_server)
        if binary is None:
            return
        self.settings.llama_server = binary
        self.local_server = binary or "auto"
        self._verdicts = {}
        self.request_load()

    def _on_draft_chosen(self, spec: str, from_dialog: bool) -> None:
        if from_dialog:
            self.settings.remember_model(spec)
        if spec == self.draft and self.pair is not None:
            return
        self.draft = spec
        if self.pair is None or self.local_server:  # a local server restarts with the new draft
            self.request_load(self.target, spec)
            return
        request = self._request(spec)
        self._begin_loading(request)
        self.swapDraftRequested.emit(request)  # the target stays loaded

    def _on_placement_chosen(self, device: str, precision: str) -> None:
        if (device, precision) == (self.device, self.precision):
            return
        self.device, self.precision = device, precision
        self.settings.device, self.settings.precision = device, precision
        self.request_load()

    # -- answers from the worker ------------------------------------------------------------
    def _on_loaded(self, info: SessionInfo) -> None:
        gc_guard.freeze_long_lived()  # before the first answer, so no collection walks the pair
        self._loading = None
        self.pair = info
        self.target, self.draft = info.target, info.draft
        self.settings.target, self.settings.draft = info.target, info.draft
        if Path(info.target).exists():
            self.settings.remember_model(info.target)
        self.load_panel.hide()
        self.toolbar.set_resolved(info.description, info.fidelity)
        self.statusChanged.emit(f"Ready: {info.target_name} on {info.description}, draft {info.draft_name}")
        if info.warning:
            self.errorRaised.emit(info.warning)
        self.fill_menus()
        self.stateChanged.emit()
        self.modelReady.emit(info)

    def _end_loading(self, status: str) -> None:
        gc_guard.freeze_long_lived()
        self._loading = None
        self.load_panel.hide()
        self.statusChanged.emit(status)
        self.stateChanged.emit()

    def _on_load_failed(self, message: str) -> None:
        self._end_loading("No model loaded")
        self.errorRaised.emit(message)

    def _on_load_cancelled(self) -> None:
        self._end_loading("Loading cancelled: choose a model to load")

    def _on_draft_verdicts(self, verdicts: dict[str, Compatibility]) -> None:
        self._verdicts.update(verdicts)
        self.fill_menus(target=False)
        self.draftMenuUpdated.emit()

    # -- menus ------------------------------------------------------------------------------
    def draft_candidates(self) -> list[str]:
        """Catalog drafts, the current draft, recent models and whatever else the session
        rated (the GGUFs beside a GGUF target); never the target itself."""
        refs = [entry.name for entry in catalog_info.entries() if "draft" in entry.roles]
        refs += [self.draft, *self.settings.recent_models, *self._verdicts]
        out: list[str] = []
        for ref in refs:
            if ref and ref not in out and ref not in DRAFT_LABELS and ref != self.target:
                out.append(ref)
        return out

    def fill_menus(self, target: bool = True) -> None:
        if target:
            self.toolbar.fill_target_menu(self.target, self.settings.recent_models)
        self.toolbar.fill_draft_menu(self.draft, self.draft_candidates(), self._verdicts)
