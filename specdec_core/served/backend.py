"""The session side of a served engine: one server's stream turned into the engine's events.

    backend = ServedBackend.connect("http://127.0.0.1:8080/v1")
    for event in backend.answer([Message("user", "Hi")], None, GenerationParams(), cancel, speculation=True):
        ...  # PrefillEvent, TokenEvent, StepEvent, DoneEvent: what the in-process engine yields

What each event says, and where it comes from:
- token ids come from the server where its stream lists them (llama.cpp's /completion);
  a token whose id the server did not list has id -1, and an OpenAI-style stream yields
  one event per text piece with id -1 (`ServerInfo.token_ids` says which);
- every token's source is `Source.UNKNOWN`: no server says which tokens were drafted;
- acceptance and draft counts are the server's (`engines`); tokens/s is timed here, from
  the first token to the last; the speedup is against the same server with speculation
  off per request (timed by `calibrate`), and unknown where that cannot be asked;
- a stream that breaks after the first token ends the answer with the text so far and
  stop reason "server_stopped" (`stats.note` says why); before it, `ServerError`.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..engine.events import DoneEvent, Event, PrefillEvent, Source, StepEvent, TokenEvent
from ..engine.stats import GenerationStats
from ..errors import ServerError
from . import engines
from .client import KeyChoice, ServerAddress, ServerClient, api_key
from .engines import DraftCounts

if TYPE_CHECKING:
    from ..engine.speculative import GenerationParams
    from ..models.chat import Message

CALIBRATION_PROMPT = "Count from one to forty in words, separated by commas."
CALIBRATION_TOKENS = 48
UNKNOWN_ID = -1

# llama.cpp's stop_type -> the engine's stop reasons.
_LLAMA_STOPS = {"eos": "eos", "word": "eos", "limit": "max_tokens"}
_OPENAI_STOPS = {"stop": "eos", "length": "max_tokens"}


@dataclass(frozen=True)
class ServerInfo:
    """What a served engine is and what it reports, for front ends to show."""

    url: str
    kind: str  # engines.LLAMA_CPP | VLLM | SGLANG | OPENAI
    model: str
    token_ids: bool  # the stream lists token ids (else text pieces with id -1)
    speculation: str  # what the server says it runs ("draft-simple", "none"), or "unknown"
    exactness: str  # engines.BATCH_INVARIANT | NOT_VERIFIED
    context_length: int | None = None
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class ServedExactness:
    """The same greedy prompt with speculation on and off, compared token for token."""

    identical: bool
    compared: int  # tokens (or characters, when ids are missing) compared
    unit: str  # "tokens" | "characters"
    first_difference: int | None
    with_speculation: str
    without_speculation: str
    drafted: int  # draft tokens the speculating run proposed (0: it did not speculate)

    def summary(self) -> str:
        if self.identical:
            return f"identical: {self.compared} {self.unit} with and without speculation"
        return (
            f"different: the answers part at {self.unit[:-1]} {self.first_difference} "
            f"of {self.compared} with and without speculation"
        )


@dataclass
class _Answer:
    """One answer's running figures while it streams."""

    started: float
    speculation: str
    prompt_tokens: int = 0
    first_token_at: float | None = None
    ids: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    chunks: int = 0
    counts: DraftCounts | None = None
    stop_reason: str = "max_tokens"
    finished: bool = False  # the server said the answer ended (a stop chunk, a finish reason)
    note: str = ""
    complete_ids: bool = True

    def seconds(self) -> tuple[float, float]:
        """(prefill, decode): to the first token, and from it to now."""
        now = time.perf_counter()
        first = self.first_token_at if self.first_token_at is not None else now
        return first - self.started, now - first


class ServedBackend:
    """A connection to one served engine and its answers as the engine's events."""

    def __init__(self, client: ServerClient, info: ServerInfo) -> None:
        self.client = client
        self.info = info
        self.baseline_tokens_per_second: float | None = None
        self.speculation_switchable: bool | None = None  # None: not asked yet
        self.last_prompt_ids: list[int] | None = None

    # -- connecting --------------------------------------------------------------------------
    @classmethod
    def connect(
        cls, url: str, model: str = "", *, read_timeout: float | None = None, key: str | None = None
    ) -> ServedBackend:
        """Ask the server at `url` what it is; `key`: its own (a server started here), else
        the user's key for that host (`client.api_key`), whose notices lead `info.notes`."""
        address = ServerAddress.parse(url)
        choice = KeyChoice(key) if key else api_key(address)
        client = ServerClient(address, key=choice.key, key_notices=choice.notices)
        if read_timeout is not None:
            client.read_timeout = read_timeout
        models = client.get_json(f"{address.api_prefix}/models")
        kind = engines.identify(models)
        names = engines.served_models(models)
        if model and model not in names:
            served = ", ".join(names) or "none listed"
            raise ServerError(f"the server at {address} does not serve {model!r} (it serves: {served})")
        chosen = model or (names[0] if names else "")
        props = _optional_json(client, "/props") if kind == engines.LLAMA_CPP else None
        server_info = _optional_json(client, "/server_info") if kind == engines.VLLM else None
        info = _describe(address, kind, chosen, models, props, server_info)
        return cls(client, dataclasses.replace(info, notes=(*choice.notices, *info.notes)))

    # -- answering ---------------------------------------------------------------------------
    def answer(
        self,
        messages: Sequence[Message],
        system: str | None,
        params: GenerationParams,
        cancel: threading.Event | None,
        *,
        speculation: bool,
    ) -> Iterator[Event]:
        chat = [{"role": m.role, "content": m.content} for m in messages]
        if system:
            chat.insert(0, {"role": "system", "content": system})
        if self.info.kind == engines.LLAMA_CPP:
            reply = self.client.post_json("/apply-template", {"messages": chat})
            prompt = reply.get("prompt") if isinstance(reply, dict) else None
            if not isinstance(prompt, str):
                raise ServerError(f"the server at {self.client.address} did not apply its chat template")
            return self._llama_cpp(prompt, params, cancel, speculation)
        return self._openai("chat/completions", {"messages": chat}, params, cancel)

    def complete(
        self, text: str, params: GenerationParams, cancel: threading.Event | None, *, speculation: bool
    ) -> Iterator[Event]:
        if self.info.kind == engines.LLAMA_CPP:
            return self._llama_cpp(text, params, cancel, speculation)
        return self._openai("completions", {"prompt": text}, params, cancel)

    # -- llama.cpp's /completion ---------------------------------------------------------------
    def _llama_cpp(
        self, prompt: str, params: GenerationParams, cancel: threading.Event | None, speculation: bool
    ) -> Iterator[Event]:
        body: dict[str, Any] = {
            "prompt": prompt,
            "n_predict": params.max_new_tokens,
            **_sampling(params),
            "min_p": 0.0,  # the engine's sampling: temperature, top-k and top-p only
            "return_tokens": True,
            "timings_per_token": True,
            "cache_prompt": True,
        }
        if not speculation:
            # The request field llama.cpp's server reads for a per-request draft length;
            # whether it was honoured shows in the reply's draft_n.
            body["speculative.n_max"] = 0
            body["speculative.n_min"] = 0
        run = _Answer(time.perf_counter(), self.info.speculation if speculation else "none")
        return self._events(run, self._llama_chunks(run, body, cancel), cancel)

    def _llama_chunks(
        self, run: _Answer, body: dict[str, Any], cancel: threading.Event | None
    ) -> Iterator[list[TokenEvent]]:
        for chunk in self.client.stream("/completion", body, cancel):
            _raise_on_error(chunk, self.client.address)
            run.prompt_tokens = int(chunk.get("tokens_evaluated") or run.prompt_tokens)
            run.counts = engines.llama_cpp_counts(chunk.get("timings")) or run.counts
            predicted = chunk.get("tokens_predicted")
            ids = [i for i in chunk.get("tokens") or [] if isinstance(i, int)]
            content = str(chunk.get("content") or "")
            settings = chunk.get("generation_settings")
            if isinstance(settings, dict) and isinstance(settings.get("speculative.types"), str):
                self._reported_speculation(settings["speculative.types"], run)
            if chunk.get("stop"):
                run.finished = True
                run.stop_reason = _LLAMA_STOPS.get(str(chunk.get("stop_type")), "eos")
                new = max(0, int(predicted) - len(run.ids)) if isinstance(predicted, int) else 0
            else:
                new = max(0, int(predicted) - len(run.ids)) if isinstance(predicted, int) else len(ids)
                new = new or (1 if content else 0)
            if new or content:
                yield self._tokens(run, ids, new, content)

    def _tokens(self, run: _Answer, ids: list[int], new: int, content: str) -> list[TokenEvent]:
        """`new` tokens that together add `content`, each with the id the server listed for it.

        llama.cpp lists one id per chunk, the last token's: a chunk carries several tokens
        only where the server held back the ones before it (their text ended inside a
        UTF-8 character), and it sends their ids nowhere in a stream (not with `n_probs`,
        not in the final chunk). Those get `UNKNOWN_ID`; the listed ids keep their places.
        """
        new = max(new, 1)
        if len(ids) != new:
            ids = [UNKNOWN_ID] * (new - len(ids)) + ids if len(ids) < new else [UNKNOWN_ID] * new
            run.complete_ids = False
        step = run.chunks + 1
        return [
            TokenEvent(
                token_id=i, text=content if n == len(ids) - 1 else "", source=Source.UNKNOWN, step=step
            )
            for n, i in enumerate(ids)
        ]

    # -- OpenAI-style streams (vLLM, SGLang, others) ---------------------------------------------
    def _openai(
        self, endpoint: str, request: dict[str, Any], params: GenerationParams, cancel: threading.Event | None
    ) -> Iterator[Event]:
        body: dict[str, Any] = {
            **request,
            "model": self.info.model,
            "max_tokens": params.max_new_tokens,
            **_sampling(params),
            "stream_options": {"include_usage": True},
        }
        if self.info.kind == engines.VLLM:
            body["return_token_ids"] = True  # vLLM lists each chunk's token ids when asked
        run = _Answer(time.perf_counter(), self.info.speculation)
        path = f"{self.client.address.api_prefix}/{endpoint}"
        return self._events(run, self._openai_chunks(run, path, body, cancel), cancel)

    def _openai_chunks(
        self, run: _Answer, path: str, body: dict[str, Any], cancel: threading.Event | None
    ) -> Iterator[list[TokenEvent]]:
        before = self._metrics_counts()
        usage_tokens: int | None = None
        for chunk in self.client.stream(path, body, cancel):
            _raise_on_error(chunk, self.client.address)
            usage = chunk.get("usage")
            if isinstance(usage, dict):
                run.prompt_tokens = int(usage.get("prompt_tokens") or run.prompt_tokens)
                usage_tokens = usage.get("completion_tokens")
            for choice in chunk.get("choices") or []:
                delta = choice.get("delta") or {}
                content = str(delta.get("content") or choice.get("text") or "")
                ids = [i for i in choice.get("token_ids") or [] if isinstance(i, int)]
                if choice.get("finish_reason"):
                    run.finished = True
                    run.stop_reason = _OPENAI_STOPS.get(str(choice["finish_reason"]), "eos")
                if content or ids:
                    yield self._tokens(run, ids, len(ids) or 1, content)
        if isinstance(usage_tokens, int) and run.complete_ids is False:
            run.note = f"{usage_tokens} tokens by the server's count; one event per text piece it sent"
        self._read_speculation(run, before)

    def _reported_speculation(self, types: str, run: _Answer) -> None:
        """llama.cpp names the speculation it ran in each answer's settings (its /props may not)."""
        types = speculation_named(types)
        run.speculation = types
        if self.info.speculation != types:
            self.info = dataclasses.replace(self.info, speculation=types)

    def _metrics_counts(self) -> DraftCounts | None:
        if self.info.kind != engines.VLLM:
            return None
        text = _optional_text(self.client, "/metrics")
        return engines.vllm_counts(text) if text else None

    def _read_speculation(self, run: _Answer, before: DraftCounts | None) -> None:
        """The server's counts for this answer, read from its metrics once it ended."""
        text = (
            _optional_text(self.client, "/metrics")
            if self.info.kind in (engines.VLLM, engines.SGLANG)
            else ""
        )
        if self.info.kind == engines.VLLM and text and before is not None:
            after = engines.vllm_counts(text)
            if after is not None:
                run.counts = after.minus(before)
        elif self.info.kind == engines.SGLANG and text:
            figures = engines.sglang_acceptance(text)
            if figures is not None:
                rate = "" if figures.accept_rate is None else f", acceptance {figures.accept_rate:.0%}"
                run.note = f"SGLang server-wide: {figures.accept_length:.2f} tokens per verify step{rate}"

    # -- events ------------------------------------------------------------------------------
    def _events(
        self, run: _Answer, chunks: Iterator[list[TokenEvent]], cancel: threading.Event | None
    ) -> Iterator[Event]:
        try:
            for tokens in chunks:
                if run.first_token_at is None:
                    run.first_token_at = time.perf_counter()
                    yield PrefillEvent(run.prompt_tokens, 0, run.first_token_at - run.started)
                run.chunks += 1
                run.ids.extend(t.token_id for t in tokens)
                run.text.extend(t.text for t in tokens)
                yield from tokens
                yield self._step(run, len(tokens))
        except ServerError as exc:
            if not run.ids:
                raise
            run.stop_reason, run.note = "server_stopped", str(exc)
        else:
            if cancel is not None and cancel.is_set() and not run.finished:
                run.stop_reason = "cancelled"
            elif not run.finished:
                if not run.ids:
                    raise ServerError(
                        f"the server at {self.client.address} closed the stream before answering"
                    )
                run.stop_reason = "server_stopped"
                run.note = f"the server at {self.client.address} closed the stream before the answer ended"
        yield DoneEvent(tuple(run.ids), "".join(run.text), self._stats(run))

    def _step(self, run: _Answer, committed: int) -> StepEvent:
        stats = self._stats(run)
        return StepEvent(
            step=run.chunks,
            k=0,
            proposed=0,
            accepted=0,
            committed=committed,
            draft_seconds=0.0,
            verify_seconds=0.0,
            tokens_per_second=stats.tokens_per_second,
            acceptance_rate=stats.acceptance_rate,
            measured_speedup=stats.measured_speedup,
            theoretical_speedup=0.0,
            mean_accepted_length=stats.mean_accepted_length,
            exactness=self.info.exactness,
        )

    def _stats(self, run: _Answer) -> GenerationStats:
        prefill, decode = run.seconds()
        counts = run.counts
        per_position: tuple[float, ...] = ()
        if counts is not None and counts.drafts:
            per_position = tuple(n / counts.drafts for n in counts.per_position)
        baseline = self.baseline_tokens_per_second
        return GenerationStats(
            drafter=run.speculation,
            prompt_tokens=run.prompt_tokens,
            new_tokens=len(run.ids),
            stop_reason=run.stop_reason,
            steps=run.chunks,
            proposed=counts.drafted if counts else 0,
            accepted=counts.accepted if counts else 0,
            per_position_acceptance=per_position,
            prefill_seconds=prefill,
            decode_seconds=decode,
            target_token_seconds=1.0 / baseline if baseline else 0.0,
            baseline_measured=baseline is not None,
            exactness=self.info.exactness,
            speedup_known=baseline is not None,
            note=run.note,
        )

    # -- baseline and exactness --------------------------------------------------------------
    def calibrate(self, params: GenerationParams) -> None:
        """Time plain decoding on the same server (speculation off per request), where it allows it."""
        if self.info.kind != engines.LLAMA_CPP:
            self.speculation_switchable = False
            return
        plain = dataclasses.replace(params, max_new_tokens=CALIBRATION_TOKENS, temperature=0.0)
        done = _last(self.complete(CALIBRATION_PROMPT, plain, None, speculation=False))
        self.speculation_switchable = done.stats.proposed == 0
        tps = done.stats.tokens_per_second
        self.baseline_tokens_per_second = tps if self.speculation_switchable and tps > 0 else None

    def check_exactness(
        self, messages: Sequence[Message], params: GenerationParams, against: ServedBackend | None = None
    ) -> ServedExactness:
        """The same greedy answer with speculation on and off (here, or on `against`), compared."""
        on = _last(self.answer(messages, None, params, None, speculation=True))
        plain = against or self
        off = _last(plain.answer(messages, None, params, None, speculation=False))
        if off.stats.proposed:
            raise ServerError(
                f"the server at {plain.client.address} kept speculating with it switched off per request "
                f"({off.stats.proposed} draft tokens): compare against a second server without a draft"
            )
        if all(i != UNKNOWN_ID for i in (*on.token_ids, *off.token_ids)) and on.token_ids and off.token_ids:
            a: Sequence[object] = on.token_ids
            b: Sequence[object] = off.token_ids
            unit = "tokens"
        else:
            a, b, unit = on.text, off.text, "characters"
        first = next((n for n, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
        if first is None and len(a) != len(b):
            first = min(len(a), len(b))
        return ServedExactness(
            identical=first is None,
            compared=max(len(a), len(b)),
            unit=unit,
            first_difference=first,
            with_speculation=on.text,
            without_speculation=off.text,
            drafted=on.stats.proposed,
        )


def _sampling(params: GenerationParams) -> dict[str, Any]:
    sampling: dict[str, Any] = {"temperature": params.temperature, "top_p": params.top_p}
    if params.top_k:
        sampling["top_k"] = params.top_k
    if params.seed is not None:
        sampling["seed"] = params.seed
    return sampling


def _raise_on_error(chunk: dict[str, Any], address: ServerAddress) -> None:
    error = chunk.get("error")
    if error:
        message = error.get("message", error) if isinstance(error, dict) else error
        raise ServerError(f"the server at {address} stopped with an error: {message}")


def _last(events: Iterator[Event]) -> DoneEvent:
    done = None
    for event in events:
        if isinstance(event, DoneEvent):
            done = event
    if done is None:
        raise ServerError("the server's answer ended without its final event")
    return done


def _optional_json(client: ServerClient, path: str) -> Any:
    """An endpoint only some servers have (llama.cpp's /props, vLLM's /server_info)."""
    try:
        return client.get_json(path)
    except ServerError:
        return None


def _optional_text(client: ServerClient, path: str) -> str:
    try:
        return client.get_text(path)
    except ServerError:
        return ""


def speculation_named(types: str) -> str:
    """llama.cpp's list of speculation types without its "none" beside a real one
    ("none,draft-simple" is draft-simple); "none" where it names nothing else."""
    named = [t.strip() for t in types.split(",") if t.strip() and t.strip() != "none"]
    return ",".join(named) or "none"


def _describe(
    address: ServerAddress, kind: str, model: str, models: Any, props: Any, server_info: Any
) -> ServerInfo:
    speculation, context = "unknown", None
    if isinstance(props, dict):
        settings = props.get("default_generation_settings") or {}
        params = settings.get("params") or {}
        # /props' defaults may say "none" for a server started with a draft: only a
        # named speculation is taken from it; each answer's own settings say the rest.
        types = params.get("speculative.types")
        if isinstance(types, str) and speculation_named(types) != "none":
            speculation = speculation_named(types)
        elif isinstance(params.get("speculative.n_max"), int) and params["speculative.n_max"] > 0:
            speculation = "draft"
        context = settings.get("n_ctx") if isinstance(settings.get("n_ctx"), int) else None
    for entry in (models.get("data") or []) if isinstance(models, dict) else []:
        meta = entry.get("meta") if isinstance(entry, dict) else None
        if context is None and isinstance(meta, dict) and isinstance(meta.get("n_ctx"), int):
            context = meta["n_ctx"]
        if context is None and isinstance(entry, dict) and isinstance(entry.get("max_model_len"), int):
            context = entry["max_model_len"]
    token_ids = kind in (engines.LLAMA_CPP, engines.VLLM)
    notes = []
    if not token_ids:
        notes.append(f"{kind} streams text only: token ids are not available")
    if kind == engines.LLAMA_CPP:
        notes.append("token ids: each one llama.cpp streams (-1 for a token it held back mid-character)")
    if kind in (engines.SGLANG, engines.OPENAI):
        notes.append("acceptance: per answer not reported by this server")
    return ServerInfo(
        url=str(address),
        kind=kind,
        model=model,
        token_ids=token_ids,
        speculation=speculation,
        exactness=engines.exactness_label(server_info),
        context_length=context,
        notes=tuple(notes),
    )
