"""The engine worker: a QObject living in its own QThread that owns the models.

The UI thread never runs model code. It asks for work by emitting signals that are
connected (queued) to this worker's slots, and hears back only through the
worker's signals. Three things must reach the worker *while it is busy* in a slot,
so they are plain thread-safe calls instead of queued slots:
`cancel_load()` / `stop()` set a `threading.Event` the engine checks between steps,
and `set_speculation()` writes `engine.speculation_enabled`, which the engine reads
at every step, so the toggle applies to the running answer.

Tokens are forwarded in batches, at most every `EMIT_INTERVAL_S` (and at the end):
tiny or fast models commit thousands of tokens a second, and one signal per token
would flood the UI thread's event queue.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from PySide6.QtCore import QObject, Signal, Slot

from specdec_core.chat import Message, encode_chat
from specdec_core.compat import Compatibility, check_draft_compatibility, config_vocab_size
from specdec_core.engine import GenerationParams
from specdec_core.errors import Cancelled, IncompatibleDraftError, SpecdecError
from specdec_core.events import DoneEvent, PrefillEvent, StepEvent, TokenEvent
from specdec_core.pair import MODEL_FREE_DRAFTS, LoadedPair, load_draft, load_pair
from specdec_core.progress import Progress

from .catalog_info import catalog_verdict

log = logging.getLogger(__name__)
EMIT_INTERVAL_S = 0.03


@dataclass(frozen=True)
class LoadRequest:
    target: str
    draft: str
    device: str
    precision: str
    cancel: threading.Event = field(default_factory=threading.Event, compare=False)


@dataclass(frozen=True)
class GenerateRequest:
    messages: tuple[Message, ...]
    system: str | None
    params: GenerationParams
    cancel: threading.Event = field(default_factory=threading.Event, compare=False)


@dataclass(frozen=True)
class PairInfo:
    """What the window shows about the loaded pair."""

    target: str
    target_name: str
    target_path: str
    draft: str  # the spec actually in use ("ngram" when a model draft was refused)
    draft_name: str
    description: str  # resolved device and precision: "cpu · int8"
    warning: str = ""  # e.g. the requested draft did not fit and n-gram is used instead


@dataclass(frozen=True)
class CommittedToken:
    token_id: int
    text: str
    source: str
    step: int
    target_prob: float | None
    draft_prob: float | None
    is_stop: bool  # an end-of-turn token: counted, not shown


@dataclass(frozen=True)
class GaugeUpdate:
    """Running figures after a verify step, for the gauges."""

    tokens_per_second: float
    acceptance_rate: float
    mean_accepted_length: float  # tokens committed per verify step
    k: int
    measured_speedup: float
    theoretical_speedup: float
    speculating: bool


@dataclass(frozen=True)
class AnswerDone:
    tokens: tuple[CommittedToken, ...]  # the last batch not yet sent
    done: DoneEvent
    text: str  # the answer without its end-of-turn token


class EngineWorker(QObject):
    loadProgress = Signal(str, int, int)  # stage, done, total (0 = unknown)
    loaded = Signal(object)  # PairInfo
    loadFailed = Signal(str)
    loadCancelled = Signal()
    draftVerdicts = Signal(object)  # dict[str, Compatibility]
    prefilled = Signal(object)  # PrefillEvent
    tokensCommitted = Signal(object)  # tuple[CommittedToken, ...]
    gaugesUpdated = Signal(object)  # GaugeUpdate
    answerDone = Signal(object)  # AnswerDone
    generationFailed = Signal(str)

    def __init__(self) -> None:
        super().__init__()
        self._pair: LoadedPair | None = None
        self._speculation = True
        self._cancel_events: set[threading.Event] = set()
        self._lock = threading.Lock()
        self.emit_interval_s = EMIT_INTERVAL_S  # tests set 0 to see every step

    # -- thread-safe calls from the UI thread ------------------------------------------------
    def set_speculation(self, enabled: bool) -> None:
        self._speculation = enabled
        pair = self._pair
        if pair is not None:
            pair.engine.speculation_enabled = enabled

    def stop(self, request: GenerateRequest) -> None:
        request.cancel.set()

    def cancel_load(self, request: LoadRequest) -> None:
        request.cancel.set()

    def cancel_everything(self) -> None:
        """Closing the window: whatever runs now ends at its next check."""
        with self._lock:
            for event in self._cancel_events:
                event.set()

    # -- slots (run in the worker thread) -----------------------------------------------------
    @Slot(object)
    def load(self, request: LoadRequest) -> None:
        self._track(request.cancel)
        try:
            self._release()
            info = self._load(request)
        except Cancelled:
            self.loadCancelled.emit()
        except SpecdecError as exc:
            self.loadFailed.emit(str(exc))
        except (torch.OutOfMemoryError, MemoryError):
            self.loadFailed.emit("out of memory while loading: try a smaller precision (int8 or nf4)")
        except Exception as exc:
            # A slot's exception would only be printed in this thread and the window would
            # wait forever; show it instead (with the traceback in the log for a bug report).
            log.exception("loading failed")
            self.loadFailed.emit(f"loading failed: {type(exc).__name__}: {exc}")
        else:
            self.loaded.emit(info)
        finally:
            self._untrack(request.cancel)

    @Slot(object)
    def swap_draft(self, request: LoadRequest) -> None:
        """Change only the drafter of the loaded target (no target reload)."""
        pair = self._pair
        if pair is None:
            return self.load(request)
        self._track(request.cancel)
        try:
            drafter, draft = load_draft(
                request.draft, pair.target, progress=self._progress, cancel=request.cancel
            )
            pair.engine.set_drafter(drafter)
            pair.draft = draft
            self._warm_up(pair)
            self.loaded.emit(self._info(pair, request.draft))
        except Cancelled:
            self.loadCancelled.emit()
        except SpecdecError as exc:
            self.loadFailed.emit(str(exc))
        except (torch.OutOfMemoryError, MemoryError):
            self.loadFailed.emit("out of memory loading the draft: try n-gram or a smaller draft")
        except Exception as exc:  # see load()
            log.exception("loading the draft failed")
            self.loadFailed.emit(f"loading the draft failed: {type(exc).__name__}: {exc}")
        finally:
            self._untrack(request.cancel)

    @Slot(object)
    def check_drafts(self, candidates: list[str]) -> None:
        """Verdicts for draft candidates against the loaded target, for the draft menu."""
        pair = self._pair
        if pair is None:
            return
        verdicts: dict[str, Compatibility] = {}
        for ref in candidates:
            verdict = self._verdict(pair, ref)
            if verdict is not None:
                verdicts[ref] = verdict
        self.draftVerdicts.emit(verdicts)

    @Slot(object)
    def generate(self, request: GenerateRequest) -> None:
        pair = self._pair
        if pair is None:
            self.generationFailed.emit("no model is loaded yet")
            return
        self._track(request.cancel)
        try:
            self._generate(pair, request)
        except (torch.OutOfMemoryError, MemoryError):
            self.generationFailed.emit(
                "out of memory while generating: try a shorter chat or a smaller precision"
            )
        except SpecdecError as exc:
            self.generationFailed.emit(str(exc))
        except Exception as exc:  # see load()
            log.exception("generation failed")
            self.generationFailed.emit(f"generation failed: {type(exc).__name__}: {exc}")
        finally:
            self._untrack(request.cancel)

    @Slot()
    def release(self) -> None:
        self._release()

    # -- work --------------------------------------------------------------------------------
    def _load(self, request: LoadRequest) -> PairInfo:
        warning = ""
        try:
            pair = load_pair(
                request.target,
                request.draft,
                device=request.device,
                precision=request.precision,
                progress=self._progress,
                cancel=request.cancel,
            )
            draft_spec = request.draft
        except IncompatibleDraftError as exc:
            # The target is fine: keep the chat usable with the model-free drafter.
            warning = f"{exc}. Using n-gram instead."
            draft_spec = "ngram"
            pair = load_pair(
                request.target,
                draft_spec,
                device=request.device,
                precision=request.precision,
                progress=self._progress,
                cancel=request.cancel,
            )
        pair.engine.speculation_enabled = self._speculation
        self._pair = pair
        self._warm_up(pair)
        return self._info(pair, draft_spec, warning)

    def _warm_up(self, pair: LoadedPair) -> None:
        # Calibration times target forwards so the speedup gauge has a measured
        # baseline (and the controller real costs) from the first message on.
        self.loadProgress.emit("Warming up (timing the target)", 0, 0)
        pair.engine.calibrate()

    def _info(self, pair: LoadedPair, draft_spec: str, warning: str = "") -> PairInfo:
        draft_name = {"ngram": "n-gram", "none": "none"}.get(
            draft_spec, pair.draft.name if pair.draft else draft_spec
        )
        return PairInfo(
            target=pair.target.ref,
            target_name=pair.target.name,
            target_path=str(pair.target.path),
            draft=draft_spec,
            draft_name=draft_name,
            description=pair.description,
            warning=warning,
        )

    def _verdict(self, pair: LoadedPair, ref: str) -> Compatibility | None:
        if ref in MODEL_FREE_DRAFTS:
            return Compatibility(True, "needs no model")
        folder = Path(ref).expanduser()
        if folder.is_dir() and (folder / "config.json").is_file():
            from transformers import AutoTokenizer

            try:
                draft_tokenizer = AutoTokenizer.from_pretrained(str(folder))
            except (OSError, ValueError) as exc:
                return Compatibility(False, f"cannot read its tokenizer ({exc})")
            return check_draft_compatibility(
                pair.target.tokenizer,
                draft_tokenizer,
                target_vocab_size=pair.target.vocab_size,
                draft_vocab_size=config_vocab_size(folder),
            )
        return catalog_verdict(pair.target.ref, ref)

    def _generate(self, pair: LoadedPair, request: GenerateRequest) -> None:
        engine = pair.engine
        engine.speculation_enabled = self._speculation
        prompt_ids = encode_chat(pair.target.tokenizer, request.messages, request.system)
        stops = engine.stop_token_ids
        batch: list[CommittedToken] = []
        last_emit = time.perf_counter()
        committed = steps = 0
        for event in engine.generate(prompt_ids, request.params, cancel=request.cancel):
            if isinstance(event, TokenEvent):
                batch.append(_committed(event, event.token_id in stops))
            elif isinstance(event, StepEvent):
                steps += 1
                committed += event.committed
                now = time.perf_counter()
                if now - last_emit >= self.emit_interval_s:
                    self.tokensCommitted.emit(tuple(batch))
                    batch = []
                    self.gaugesUpdated.emit(self._gauges(engine, event, committed, steps))
                    last_emit = now
            elif isinstance(event, PrefillEvent):
                self.prefilled.emit(event)
            elif isinstance(event, DoneEvent):
                ids = list(event.token_ids)
                if ids and ids[-1] in stops:
                    ids = ids[:-1]
                text = pair.target.tokenizer.decode(
                    ids, skip_special_tokens=False, clean_up_tokenization_spaces=False
                )
                self.answerDone.emit(AnswerDone(tuple(batch), event, text))

    def _gauges(self, engine, event: StepEvent, committed: int, steps: int) -> GaugeUpdate:
        return GaugeUpdate(
            tokens_per_second=event.tokens_per_second,
            acceptance_rate=event.acceptance_rate,
            mean_accepted_length=committed / steps if steps else 0.0,
            k=event.k,
            measured_speedup=event.measured_speedup,
            theoretical_speedup=event.theoretical_speedup,
            speculating=bool(engine.speculation_enabled),
        )

    def _progress(self, progress: Progress) -> None:
        self.loadProgress.emit(progress.stage, progress.done, progress.total)

    def _release(self) -> None:
        if self._pair is not None:
            self._pair = None
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()

    def _track(self, event: threading.Event) -> None:
        with self._lock:
            self._cancel_events.add(event)

    def _untrack(self, event: threading.Event) -> None:
        with self._lock:
            self._cancel_events.discard(event)


def _committed(event: TokenEvent, is_stop: bool) -> CommittedToken:
    return CommittedToken(
        token_id=event.token_id,
        text=event.text,
        source=event.source.value,
        step=event.step,
        target_prob=event.target_prob,
        draft_prob=event.draft_prob,
        is_stop=is_stop,
    )
