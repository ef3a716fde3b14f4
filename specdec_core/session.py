"""One chat session: the API the app and the CLI use (never the engine's parts, never torch).

    session = ChatSession()
    info = session.load(LoadSpec(target="qwen2.5-coder-1.5b-instruct", draft="qwen2.5-coder-0.5b-instruct"))
    session.calibrate()                               # optional: a measured speedup baseline
    for event in session.answer([Message("user", "Write a loop.")]):
        ...                                           # PrefillEvent, TokenEvent, StepEvent, DoneEvent

Contract:
- `load` loads the target once. A model draft that does not fit the target (another
  tokenizer) is replaced by n-gram lookup and `info.warning` says why. The exactness
  self-check runs on the loaded pair; its report is `info.exactness`.
- `answer` renders the chat with the model's template (time-limited), refuses a
  conversation longer than the model's positions (`ContextTooLong`; nothing is
  trimmed behind the user's back), and stops an answer at the model's last position
  with stop reason `context_full`. The final `DoneEvent.text` holds no stop token.
- Every failure is a `SpecdecError` with a one-line `str()`. Out of memory is
  `OutOfMemory`, raised after the caches were reset, so the session stays usable.
  Anything unexpected is `InternalError` (exit code 1) with the cause chained.
- `speculation_enabled` may be set from another thread; the engine reads it every step.
- `read_ahead(messages, typing)` reads a conversation and the message being typed into
  the caches while the user types; `answer` then reads only the rest. It never changes
  an answer, whatever is sent after it.
- `remember(conversations)` gives the drafter past conversations to copy from (the
  suffix index's library, docs/engine.md#drafters); it stays across answers and drafter
  swaps until replaced, and changes only speed.
- A target that is a server address (`http://127.0.0.1:8080/v1`) is a served engine
  (`served/`): the same calls and events, answered by that server; `info.server` says
  what it reports, and `check_server_exactness` compares its answers with speculation on
  and off.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from .engine.drafters import NGRAM
from .engine.events import DoneEvent, Event, ReadAheadEvent
from .engine.selfcheck import ExactnessReport, check_exactness
from .engine.speculative import MAX_DRAFT_LENGTH, GenerationParams, SpeculativeEngine
from .engine.suffix_drafter import set_library
from .errors import (
    ContextTooLong,
    IncompatibleDraftError,
    InternalError,
    InvalidInput,
    InvalidParameter,
    NotLoaded,
    OutOfMemory,
    SpecdecError,
)
from .kernels.dispatch import step_label
from .models.chat import Message, encode_chat, encode_text, settled_prefix
from .models.compat import Compatibility, gguf_drafts_near, rate_draft
from .models.loading import LoadedModel, load_model
from .models.pair import DraftSpec, LoadedPair, load_draft, make_engine
from .progress import Progress, ProgressCallback, check_cancelled
from .served.backend import ServedBackend, ServedExactness, ServerInfo
from .served.client import is_server_url
from .served.local_server import LocalLlamaServer, llama_server_binary

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadSpec:
    target: str
    draft: str = NGRAM  # a model ref | "ngram" | "none"
    device: str = "auto"
    precision: str = "auto"
    offload: bool = False  # device_map="auto" CPU offload on CUDA, opt-in
    trust_remote_code: bool = False
    # A model draft that does not fit the target: n-gram instead (with info.warning), or
    # IncompatibleDraftError when False (the CLI: a scripted run asked for that draft).
    draft_fallback: bool = True
    # A served target (an http:// address): the model to ask it for ("" = the one it serves).
    served_model: str = ""
    # Serve a .gguf target (and a .gguf draft) with llama.cpp's server on 127.0.0.1 and answer
    # through it: the binary's path, or "auto" for $SPECDEC_LLAMA_SERVER / llama-server on PATH.
    # `release()` (or the next load) stops it. "" = in-process.
    local_server: str = ""


@dataclass(frozen=True)
class SessionInfo:
    target: str
    target_name: str
    target_path: str
    draft: str  # the draft spec in use ("ngram" when the model draft was refused)
    draft_name: str
    description: str  # resolved device and precision, e.g. "cpu · int8"
    warning: str = ""  # e.g. "draft X does not fit target Y: <reason>. Using n-gram instead."
    exactness: ExactnessReport | None = None
    context_length: int | None = None  # positions the pair can attend over (None: unknown)
    device: str = ""  # resolved: "cpu" | "cuda"
    precision: str = ""  # resolved: "fp32" | "bf16" | "fp16" | "int8" | "int4" | "nf4"
    draft_precision: str = ""  # the draft model's ("int8/int4": 4-bit steps; "int4 (int8 reads)"); "" without one
    server: ServerInfo | None = None  # a served engine: what it is and reports (None: in-process)
    fidelity: str = ""  # the target's weights against its source's, e.g. "as stored (Q4_K_M)"
    step: str = ""  # how the target's forwards run on CUDA (static_step.step_label); "" on the CPU


class ChatSession:
    def __init__(self) -> None:
        self._pair: LoadedPair | None = None
        self._served: ServedBackend | None = None
        self._local_server: LocalLlamaServer | None = None
        self._spec: LoadSpec | None = None
        self._speculation = True
        self._library: list[list[int]] = []  # past conversations' tokens, for the drafter's copies
        self.info: SessionInfo | None = None

    # -- state ---------------------------------------------------------------------------
    @property
    def speculation_enabled(self) -> bool:
        return self._speculation

    @speculation_enabled.setter
    def speculation_enabled(self, enabled: bool) -> None:
        # A plain attribute write: safe from any thread, read by the engine at its next step.
        self._speculation = bool(enabled)
        if self._pair is not None:
            self._pair.engine.speculation_enabled = self._speculation

    @property
    def engine(self) -> SpeculativeEngine:
        """The loaded engine, for tools that time its parts (bench); chat front ends don't need it."""
        return self._require().engine

    # -- loading -------------------------------------------------------------------------
    def load(
        self,
        spec: LoadSpec,
        *,
        progress: ProgressCallback | None = None,
        cancel: threading.Event | None = None,
    ) -> SessionInfo:
        """Load the target (once) and its drafter, check exactness; replaces what was loaded."""
        if spec.local_server:
            return self._serve_locally(spec, progress, cancel)
        if is_server_url(spec.target):
            return self._connect(spec)
        draft = DraftSpec.parse(spec.draft)  # a bad spec fails before anything is loaded
        self.release()
        with _one_line_errors("loading the model", hint="try a smaller precision or a smaller model"):
            target = load_model(
                spec.target,
                device=spec.device,
                precision=spec.precision,
                offload=spec.offload,
                trust_remote_code=spec.trust_remote_code,
                progress=progress,
                cancel=cancel,
            )
            warning = ""
            try:
                drafter, draft_model = load_draft(
                    draft, target, trust_remote_code=spec.trust_remote_code, progress=progress, cancel=cancel
                )
            except IncompatibleDraftError as exc:
                if not spec.draft_fallback:
                    raise
                # The target is fine: keep the chat usable with the model-free drafter.
                warning = f"{exc}. Using n-gram instead."
                draft = DraftSpec(NGRAM)
                drafter, draft_model = load_draft(draft, target)
            engine = make_engine(target, drafter)
            engine.speculation_enabled = self._speculation
            set_library(drafter, self._library)
            check_cancelled(cancel)
            exactness = self._check_exactness(engine, progress)
        # Only a load that got this far is kept: on any failure above, nothing is loaded.
        self._pair = LoadedPair(target=target, draft=draft_model, engine=engine)
        self._spec = spec
        self.info = self._describe(draft, warning, exactness)
        return self.info

    def _serve_locally(
        self, spec: LoadSpec, progress: ProgressCallback | None, cancel: threading.Event | None
    ) -> SessionInfo:
        """Start llama.cpp's server on 127.0.0.1 for spec.target (with spec.draft when a .gguf)."""
        self.release()
        binary = llama_server_binary("" if spec.local_server == "auto" else spec.local_server)
        draft = spec.draft if spec.draft.endswith(".gguf") else ""
        server = LocalLlamaServer(binary, spec.target, draft)
        if progress is not None:
            progress(Progress("Starting llama.cpp's server on 127.0.0.1", 0, 0, unit="steps"))
        with _one_line_errors("starting llama.cpp's server"):
            url = server.start(cancel=cancel)
        try:
            self._connect(dataclasses.replace(spec, target=url, local_server=""), key=server.api_key)
        except BaseException:
            server.stop()
            raise
        self._local_server = server  # after _connect, whose release() would stop it
        # The target stays the file: a front end that remembers it reloads the model, never
        # an address that ends with this session.
        self._spec = spec
        self.info = self._describe_served()
        return self.info

    def _connect(self, spec: LoadSpec, key: str | None = None) -> SessionInfo:
        """A served engine: ask the server what it is; nothing is loaded here."""
        self.release()
        with _one_line_errors("connecting to the server"):
            backend = ServedBackend.connect(spec.target, spec.served_model, key=key)
        self._served, self._spec = backend, spec
        self.info = self._describe_served()
        return self.info

    def _describe_served(self) -> SessionInfo:
        """The served engine as the session's info (what the server has said so far)."""
        assert self._served is not None and self._spec is not None
        server, spec = self._served.info, self._spec
        return SessionInfo(
            target=spec.target,
            target_name=server.model or server.url,
            target_path="",
            draft=spec.draft,  # kept as asked: the server's own draft is in draft_name
            draft_name=f"the server's ({server.speculation})",
            description=(
                f"llama.cpp's server started here at {server.url}"
                if self._local_server is not None
                else f"{server.kind} at {server.url}"
            ),
            warning="; ".join(server.notes),
            context_length=server.context_length,
            device="server",
            server=server,
        )

    def swap_draft(
        self,
        draft: str,
        *,
        progress: ProgressCallback | None = None,
        cancel: threading.Event | None = None,
    ) -> SessionInfo:
        """Change only the drafter; the target stays. On failure the old drafter stays in use."""
        if self._served is not None:
            raise InvalidInput(
                "a served engine's draft is chosen when the server starts: restart it with another"
            )
        pair = self._require()
        spec = DraftSpec.parse(draft)
        trust = self._spec.trust_remote_code if self._spec else False
        with _one_line_errors(
            "loading the draft", on_oom=self._reset_caches, hint="try n-gram or a smaller draft"
        ):
            drafter, draft_model = load_draft(
                spec, pair.target, trust_remote_code=trust, progress=progress, cancel=cancel
            )
            pair.engine.set_drafter(drafter)
            pair.draft = draft_model
            set_library(drafter, self._library)
        assert self.info is not None
        self.info = self._describe(spec, "", self.info.exactness)
        return self.info

    def remember(self, conversations: Iterable[Sequence[Message]], *, system: str | None = None) -> int:
        """Let the drafter copy from past conversations, each rendered with the chat template
        as an answer's prompt is; replaces what was remembered before. Returns the tokens
        the drafter's library holds: 0 where it keeps none (n-gram, none, a served engine),
        fewer than given past its memory bound."""
        pair = self._require() if self._served is None else None
        if pair is None:
            return 0
        with _one_line_errors("preparing the library"):
            self._library = [encode_chat(pair.target.tokenizer, list(c), system) for c in conversations]
        return set_library(pair.engine.drafter, self._library)

    def rate_drafts(self, refs: Sequence[str]) -> dict[str, Compatibility]:
        """Whether each candidate draft fits the loaded target, with a reason, without loading
        weights or downloading anything (`compat.rate_draft`: one verdict for every front end).
        The GGUF files beside a GGUF target are rated too (`compat.gguf_drafts_near`): a front
        end offers what it gets verdicts for."""
        if self._served is not None:
            return {ref: Compatibility(False, "the server runs its own draft") for ref in refs}
        pair = self._require()
        verdicts: dict[str, Compatibility] = {}
        for ref in dict.fromkeys([*refs, *gguf_drafts_near(pair.target.ref)]):
            try:
                verdict = _rate_draft(pair.target, ref)
            except SpecdecError as exc:
                verdict = Compatibility(False, str(exc))
            verdicts[ref] = verdict
        return verdicts

    def calibrate(self) -> None:
        """Time target (and draft) forwards: the controller's costs and the speedup baseline.

        A served engine: time the same server with speculation off, where it allows it."""
        if self._served is not None:
            with _one_line_errors("timing the server"):
                self._check_local_server()
                self._served.calibrate(GenerationParams())
            self.info = self._describe_served()
            return
        pair = self._require()
        with _one_line_errors("timing the model", on_oom=self._reset_caches):
            pair.engine.calibrate()

    def release(self) -> None:
        """Drop the models. (No gc.collect here: the app collects on its UI thread only.)"""
        self._pair = None
        self._served = None
        if self._local_server is not None:
            self._local_server.stop()
            self._local_server = None
        self.info = None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    # -- answering -----------------------------------------------------------------------
    def answer(
        self,
        messages: Sequence[Message],
        *,
        system: str | None = None,
        params: GenerationParams | None = None,
        cancel: threading.Event | None = None,
    ) -> Iterator[Event]:
        """Stream the assistant's answer to `messages`. Bad input raises here, before any event."""
        params = params or GenerationParams()
        check_params(params)
        if self._served is not None:
            with _one_line_errors("asking the server"):
                self._check_local_server()
                return self._served_events(
                    self._served.answer(messages, system, params, cancel, speculation=self._speculation)
                )
        pair = self._require()
        with _one_line_errors("preparing the chat"):
            prompt = encode_chat(pair.target.tokenizer, messages, system)
        return self._stream(prompt, params, cancel)

    def read_ahead(
        self,
        messages: Sequence[Message],
        typing: str,
        *,
        system: str | None = None,
        stop: threading.Event | None = None,
    ) -> Iterator[ReadAheadEvent]:
        """Read `messages` and the settled start of `typing`, a user message still being
        written, into the caches before it is sent (`models.chat.settled_prefix`); a set
        `stop` ends the read at the next chunk, keeping what was read. It changes how soon
        the answer starts, never the answer (`SpeculativeEngine.read_ahead`). A served
        engine reads nothing ahead."""
        if self._served is not None:
            return iter(())
        pair = self._require()
        with _one_line_errors("preparing the chat"):
            tokens = settled_prefix(pair.target.tokenizer, messages, typing, system)
        limit = self.info.context_length if self.info is not None else None
        if limit is not None:
            tokens = tokens[: limit - 1]  # a prompt the model can hold keeps a last position free
        return self._read_events(pair.engine, tokens, stop)

    def _read_events(
        self, engine: SpeculativeEngine, tokens: list[int], stop: threading.Event | None
    ) -> Iterator[ReadAheadEvent]:
        with _one_line_errors("reading ahead", on_oom=self._reset_caches):
            yield from engine.read_ahead(tokens, stop)

    def complete(
        self, text: str, *, params: GenerationParams | None = None, cancel: threading.Event | None = None
    ) -> Iterator[Event]:
        """Continue plain `text` without the chat template (the CLI's --raw)."""
        params = params or GenerationParams()
        check_params(params)
        if not text:
            raise InvalidInput("the prompt is empty: a raw prompt needs at least one token")
        if self._served is not None:
            with _one_line_errors("asking the server"):
                self._check_local_server()
                return self._served_events(
                    self._served.complete(text, params, cancel, speculation=self._speculation)
                )
        pair = self._require()
        with _one_line_errors("tokenizing the prompt"):
            prompt = encode_text(pair.target.tokenizer, text)
        if not prompt:
            raise InvalidInput("the prompt is empty after tokenization")
        return self._stream(prompt, params, cancel)

    def _stream(
        self, prompt: list[int], params: GenerationParams, cancel: threading.Event | None
    ) -> Iterator[Event]:
        engine = self._require().engine
        params, capped = self._fit_context(prompt, params)
        return self._events(engine, prompt, params, capped, cancel)

    def _events(
        self,
        engine: SpeculativeEngine,
        prompt: list[int],
        params: GenerationParams,
        capped: bool,
        cancel: threading.Event | None,
    ) -> Iterator[Event]:
        with _one_line_errors("generating", on_oom=self._reset_caches):
            for event in engine.generate(prompt, params, cancel=cancel):
                if isinstance(event, DoneEvent):
                    event = self._finished(event, capped)
                yield event

    def _check_local_server(self) -> None:
        """A server started here that has ended leaves its port to any program: ask it nothing."""
        if self._local_server is not None:
            self._local_server.check_running()

    def _served_events(self, events: Iterator[Event]) -> Iterator[Event]:
        with _one_line_errors("streaming from the server"):
            yield from events

    def check_server_exactness(
        self,
        prompt: str,
        *,
        against: str | None = None,
        params: GenerationParams | None = None,
    ) -> ServedExactness:
        """A served engine's greedy answer to `prompt` with speculation on and off, token for token.

        Off is asked of the same server per request, or of `against` (the same model served
        without a draft) where the server cannot switch it off."""
        if self._served is None:
            raise NotLoaded("no server is connected: load a target that is a server address first")
        params = dataclasses.replace(params or GenerationParams(max_new_tokens=64), temperature=0.0)
        check_params(params)
        with _one_line_errors("comparing the server's answers"):
            plain = ServedBackend.connect(against) if against else None
            return self._served.check_exactness([Message("user", prompt)], params, plain)

    def _fit_context(self, prompt: list[int], params: GenerationParams) -> tuple[GenerationParams, bool]:
        """Refuse a prompt the model cannot hold; cap the answer at the model's last position."""
        assert self.info is not None
        limit = self.info.context_length
        if limit is None:
            return params, False
        if len(prompt) >= limit:
            raise ContextTooLong(
                f"the conversation is {len(prompt)} tokens but {self.info.target_name} holds "
                f"{limit}: start a new conversation or shorten this one"
            )
        room = limit - len(prompt)
        if params.max_new_tokens <= room:
            return params, False
        return dataclasses.replace(params, max_new_tokens=room), True

    def _finished(self, done: DoneEvent, capped: bool) -> DoneEvent:
        """The final event, with `context_full` when the model's positions ended the answer."""
        if capped and done.stats.stop_reason == "max_tokens":
            return dataclasses.replace(
                done, stats=dataclasses.replace(done.stats, stop_reason="context_full")
            )
        return done

    # -- helpers -------------------------------------------------------------------------
    def _require(self) -> LoadedPair:
        if self._pair is None:
            raise NotLoaded("no model is loaded yet")
        return self._pair

    def _reset_caches(self) -> None:
        """Empty both KV caches: a forward that failed midway may have written part of its step."""
        pair = self._pair
        if pair is not None:
            pair.engine.target.reset()
            pair.engine.drafter.reset()

    def _check_exactness(
        self, engine: SpeculativeEngine, progress: ProgressCallback | None
    ) -> ExactnessReport:
        if progress:
            progress(Progress("Checking exactness (verify vs plain steps)", 0, 0))
        report = check_exactness(engine)
        engine.exactness = report  # the engine's stats carry its label
        return report

    def _describe(self, draft: DraftSpec, warning: str, exactness: ExactnessReport | None) -> SessionInfo:
        pair = self._require()
        target = pair.target
        lengths = [n for n in (target.context_length, pair.draft and pair.draft.context_length) if n]
        return SessionInfo(
            target=target.ref,
            target_name=target.name,
            target_path=str(target.path),
            draft=str(draft),
            draft_name=pair.draft.name if pair.draft is not None else draft.display_name,
            description=target.description,
            warning=warning,
            exactness=exactness,
            # A model draft reads the same tokens, so the shorter of the two bounds the pair.
            context_length=min(lengths) if lengths else None,
            device=target.device,
            precision=target.precision,
            draft_precision=pair.draft.precision if pair.draft is not None else "",
            fidelity=target.fidelity,
            step=step_label(pair.engine.target),
        )


def check_params(params: GenerationParams) -> None:
    """Refuse parameters outside their range, naming the range."""
    rules: list[tuple[str, Any, bool, str]] = [
        ("max_new_tokens", params.max_new_tokens, _is_int(params.max_new_tokens) and params.max_new_tokens >= 1,
         "a whole number ≥ 1"),
        ("temperature", params.temperature, _is_real(params.temperature) and params.temperature >= 0,
         "a number ≥ 0 (0 = greedy)"),
        ("top_p", params.top_p, _is_real(params.top_p) and 0 < params.top_p <= 1, "a number in (0, 1]"),
        ("top_k", params.top_k, _is_int(params.top_k) and params.top_k >= 0, "a whole number ≥ 0 (0 = off)"),
        ("max_draft_length", params.max_draft_length,
         _is_int(params.max_draft_length) and 0 <= params.max_draft_length <= MAX_DRAFT_LENGTH,
         f"a whole number from 0 to {MAX_DRAFT_LENGTH} (the widest verify the self-check compares)"),
        ("max_copy_length", params.max_copy_length,
         _is_int(params.max_copy_length) and 0 <= params.max_copy_length <= MAX_DRAFT_LENGTH,
         f"a whole number from 0 to {MAX_DRAFT_LENGTH} (the widest verify the self-check compares)"),
        ("draft_length", params.draft_length, params.draft_length is None
         or (_is_int(params.draft_length) and 0 <= params.draft_length <= params.max_draft_length),
         f"'auto' or a whole number from 0 to {params.max_draft_length}"),
        ("seed", params.seed, params.seed is None or (_is_int(params.seed) and 0 <= params.seed < 2**63),
         "a whole number from 0 to 2^63 - 1"),
    ]  # fmt: skip
    for name, value, ok, allowed in rules:
        if not ok:
            raise InvalidParameter(f"{name} must be {allowed}, not {value!r}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _rate_draft(target: LoadedModel, ref: str) -> Compatibility:
    """compat.rate_draft — the one verdict — on the loaded target and a parsed draft spec."""
    return rate_draft(target.ref, str(DraftSpec.parse(ref)))


@contextmanager
def _one_line_errors(
    doing: str,
    *,
    on_oom: Callable[[], None] | None = None,
    hint: str = "try a shorter conversation or a smaller precision (int8, int4, nf4)",
) -> Iterator[None]:
    """Map every failure while `doing` to one `SpecdecError`.

    Out of memory: `on_oom()` resets what the failed step left half-written, so the
    session is usable again. Anything unexpected is an `InternalError` with its cause.
    """
    try:
        yield
    except SpecdecError:
        raise
    except (torch.OutOfMemoryError, MemoryError) as exc:
        if on_oom is not None:
            on_oom()
            hint += "; the session is still usable"
        if torch.cuda.is_available():  # hand back what the failed step had allocated
            torch.cuda.empty_cache()
        raise OutOfMemory(f"out of memory while {doing}: {hint}") from exc
    except Exception as exc:
        log.debug("%s failed", doing, exc_info=True)
        text = str(exc).strip().splitlines()
        detail = f": {text[0]}" if text else ""
        raise InternalError(f"{doing} failed: {type(exc).__name__}{detail} (a bug in specdec)") from exc
