"""The methods `specdec bench` times: transformers' `generate` and our engine.

Every method runs in this one process on the same model objects (same weights,
same precision, same device), greedy unless a `Decoding` samples (then every method
draws with the same temperature, top-k, top-p and seed, and texts are not compared):

- `target`           transformers' own `generate` with the target alone: the reference
                     output and the baseline speed;
- `hf-assisted`      `generate(assistant_model=draft)`, the library's default schedule;
- `hf-prompt-lookup` `generate(prompt_lookup_num_tokens=10)`;
- `ours-off`         our engine, speculation off (the same code path, no drafter);
- `ours-draft`       our engine with the draft model and adaptive draft length;
- `ours-ngram`       our engine with the n-gram (prompt lookup) drafter;
- `ours-suffix`      our engine with the suffix-index drafter (model-free, `SuffixDrafter`);
- `ours-suffix-draft` copies from the suffix index, else the draft model: `ours-auto` with the
                     suffix index in place of prompt lookup (an A/B of the two model-free sources);
- `ours-ngram-draft` prompt lookup, else the draft model, copies unchecked (the A/B's base);
- `ours-cascade`     prompt lookup whose copies the draft model checks first (greedy), else the
                     draft model (`LookupThenModelDrafter(cascade=True)`, what `ours-auto` is now);
- `ours-auto`        what the app uses by default (see `AUTO_DRAFTER`).

The peer, llama.cpp's server on the same GGUF files, is in `llama_server`.
Wall seconds cover the whole call (prefill, decoding, detokenization for ours).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ...engine.drafters import Drafter, LookupThenModelDrafter, ModelDrafter, NgramDrafter, NoDrafter
from ...engine.events import DoneEvent
from ...engine.speculative import GenerationParams, SpeculativeEngine
from ...engine.stats import GenerationStats
from ...engine.suffix_drafter import SuffixDrafter
from ...errors import SpecdecError
from ...kernels.cpu.threads import default_governor

HF_METHODS = ("target", "hf-assisted", "hf-prompt-lookup")
OUR_METHODS = (
    "ours-off", "ours-draft", "ours-ngram", "ours-suffix", "ours-suffix-draft", "ours-ngram-draft",
    "ours-cascade", "ours-auto",
)  # fmt: skip
METHODS = HF_METHODS + OUR_METHODS
LLAMA_SERVER = "llama-server"
LLAMA_SERVER_DRAFT = "llama-server-draft"
PEER_METHODS = (LLAMA_SERVER, LLAMA_SERVER_DRAFT)  # llama.cpp's server: built by `llama_server`
ALL_METHODS = METHODS + PEER_METHODS
DRAFT_MODEL_METHODS = frozenset({"hf-assisted", "ours-draft", "ours-suffix-draft", "ours-ngram-draft", "ours-cascade"})
OURS_PREFIX = "ours-"
BASELINE = "target"
HF_ASSISTED = "hf-assisted"
PROMPT_LOOKUP_TOKENS = 10  # the issue's setting (transformers' docs suggest 10 for input-grounded tasks)
# What the app runs by default, named by drafter: prompt lookup when the text has a match
# (free; under greedy decoding checked by the draft model first), else the draft model,
# each with adaptive k (`models.pair.auto_drafter`).
AUTO_DRAFTER = "cascade+draft"


@dataclass(frozen=True)
class Decoding:
    """How every method picks its tokens: greedy (temperature 0), or seeded sampling."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


GREEDY = Decoding()


@dataclass(frozen=True)
class Run:
    """One timed generation."""

    token_ids: tuple[int, ...]
    seconds: float
    stats: GenerationStats | None = None  # our engine's stats; None for transformers


class Method(Protocol):
    name: str

    def run(self, prompt_ids: Sequence[int], max_new_tokens: int) -> Run: ...


class HfMethod:
    """transformers' own `generate` (greedy, or seeded sampling) with a clean generation config.

    A model's shipped `generation_config` (e.g. Qwen's repetition_penalty 1.1) would
    fill every field we leave unset and change the output, so while we generate,
    target and assistant see library defaults and only what we set here.
    """

    def __init__(
        self,
        name: str,
        model: Any,
        stop_token_ids: Sequence[int],
        pad_token_id: int,
        assistant: Any = None,
        prompt_lookup_num_tokens: int | None = None,
        decoding: Decoding = GREEDY,
    ) -> None:
        self.name = name
        self.decoding = decoding
        self.model = model
        self.assistant = assistant
        self.stop_token_ids = sorted(stop_token_ids)
        self.pad_token_id = pad_token_id
        self.prompt_lookup_num_tokens = prompt_lookup_num_tokens

    def generation_config(self, max_new_tokens: int) -> Any:
        from transformers import GenerationConfig

        sampled = {} if self.decoding.greedy else {
            "temperature": self.decoding.temperature, "top_k": self.decoding.top_k or None,
            "top_p": self.decoding.top_p,
        }  # fmt: skip
        return GenerationConfig(
            do_sample=not self.decoding.greedy,
            **sampled,
            num_beams=1,
            max_new_tokens=max_new_tokens,
            eos_token_id=self.stop_token_ids,
            pad_token_id=self.pad_token_id,
            prompt_lookup_num_tokens=self.prompt_lookup_num_tokens,
        )

    def run(self, prompt_ids: Sequence[int], max_new_tokens: int) -> Run:
        input_ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=self.model.device)
        kwargs: dict[str, Any] = {}
        if self.assistant is not None:
            kwargs["assistant_model"] = self.assistant
        models = [self.model] if self.assistant is None else [self.model, self.assistant]
        # generate() has no step hook: the thread count is chosen once per call, as the
        # governor would at the first step of ours, so load hits both alike.
        default_governor().maybe_adjust()
        torch.manual_seed(self.decoding.seed)
        with _library_generation_defaults(models), torch.inference_mode():
            start = time.perf_counter()
            out = self.model.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                generation_config=self.generation_config(max_new_tokens),
                **kwargs,
            )
            seconds = time.perf_counter() - start
        return Run(token_ids=tuple(out[0, len(prompt_ids) :].tolist()), seconds=seconds)


@contextmanager
def _library_generation_defaults(models: Sequence[Any]) -> Iterator[None]:
    """Swap in default generation configs (restored after): no shipped defaults leak in,
    and an assistant's adaptive settings start fresh on every call."""
    from transformers import GenerationConfig

    saved = [m.generation_config for m in models]
    try:
        for m in models:
            m.generation_config = GenerationConfig()
        yield
    finally:
        for m, config in zip(models, saved, strict=True):
            m.generation_config = config


class EngineMethod:
    """Our engine with one drafter, timed around the whole event stream."""

    def __init__(
        self, name: str, engine: SpeculativeEngine, draft_length: int | None = None, decoding: Decoding = GREEDY
    ) -> None:
        self.name = name
        self.engine = engine
        self.draft_length = draft_length
        self.decoding = decoding

    def run(self, prompt_ids: Sequence[int], max_new_tokens: int) -> Run:
        # Empty caches, as transformers starts with: a fair prefill for every method.
        self.engine.target.reset()
        self.engine.drafter.reset()
        d = self.decoding
        params = GenerationParams(
            max_new_tokens=max_new_tokens, draft_length=self.draft_length, temperature=d.temperature,
            top_k=d.top_k, top_p=d.top_p, seed=d.seed,
        )  # fmt: skip
        done: DoneEvent | None = None
        start = time.perf_counter()
        for event in self.engine.generate(prompt_ids, params):
            if isinstance(event, DoneEvent):
                done = event
        seconds = time.perf_counter() - start
        assert done is not None
        return Run(token_ids=done.token_ids, seconds=seconds, stats=done.stats)


def needs_draft_model(method: str) -> bool:
    return method in DRAFT_MODEL_METHODS or (method == "ours-auto" and "draft" in AUTO_DRAFTER)


def build_methods(
    names: Sequence[str],
    target_model: Any,
    tokenizer: Any,
    stop_token_ids: Sequence[int],
    draft_model: Any = None,
    draft_name: str = "draft",
    calibrate: bool = True,
    draft_length: int | None = None,
    decoding: Decoding = GREEDY,
) -> dict[str, Method]:
    """The requested methods over one target (and draft) model, in `METHODS` order
    (the peer's, also accepted in `names`, are started by `llama_server.start_peers`).

    Each of our methods gets its own engine (own caches and measured costs) over the
    shared model objects; `calibrate` times them as the app does when it loads a pair.
    `draft_length` pins k for our methods (None: adaptive, as the app runs); `decoding`
    is every method's way of picking tokens.
    """
    unknown = sorted(set(names) - set(ALL_METHODS))
    if unknown:
        raise SpecdecError(f"unknown method(s) {', '.join(unknown)}: choose from {', '.join(ALL_METHODS)}")
    if BASELINE not in names:
        raise SpecdecError(f"the methods must include {BASELINE!r}: it is the reference output and speed")
    needs_draft = [n for n in names if needs_draft_model(n)]
    if needs_draft and draft_model is None:
        raise SpecdecError(f"{', '.join(needs_draft)} need a draft model: pass --draft REF")
    vocab_size = int(target_model.config.get_text_config().vocab_size)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(stop_token_ids, default=0)

    def drafter(kind: str) -> Drafter:
        if kind == "none":
            return NoDrafter()
        if kind == "ngram":
            return NgramDrafter()
        if kind == "suffix":
            return SuffixDrafter()
        model = ModelDrafter(draft_model, name=draft_name, vocab_size=vocab_size)
        if kind in ("ngram+draft", "cascade+draft"):
            return LookupThenModelDrafter(model, cascade=kind == "cascade+draft")
        return LookupThenModelDrafter(model, SuffixDrafter(min_match=2)) if kind == "suffix+draft" else model

    def engine_method(name: str, kind: str) -> EngineMethod:
        engine = SpeculativeEngine(target_model, tokenizer, drafter(kind), stop_token_ids=stop_token_ids)
        if calibrate and kind != "none":
            engine.calibrate()
        return EngineMethod(name, engine, draft_length, decoding)

    factories: dict[str, Callable[[], Method]] = {
        "target": lambda: HfMethod("target", target_model, stop_token_ids, pad, decoding=decoding),
        "hf-assisted": lambda: HfMethod(
            "hf-assisted", target_model, stop_token_ids, pad, assistant=draft_model, decoding=decoding
        ),
        "hf-prompt-lookup": lambda: HfMethod(
            "hf-prompt-lookup",
            target_model,
            stop_token_ids,
            pad,
            prompt_lookup_num_tokens=PROMPT_LOOKUP_TOKENS,
            decoding=decoding,
        ),
        "ours-off": lambda: engine_method("ours-off", "none"),
        "ours-draft": lambda: engine_method("ours-draft", "draft"),
        "ours-ngram": lambda: engine_method("ours-ngram", "ngram"),
        "ours-suffix": lambda: engine_method("ours-suffix", "suffix"),
        "ours-suffix-draft": lambda: engine_method("ours-suffix-draft", "suffix+draft"),
        "ours-ngram-draft": lambda: engine_method("ours-ngram-draft", "ngram+draft"),
        "ours-cascade": lambda: engine_method("ours-cascade", "cascade+draft"),
        "ours-auto": lambda: engine_method("ours-auto", AUTO_DRAFTER),
    }
    return {name: factories[name]() for name in METHODS if name in names}
