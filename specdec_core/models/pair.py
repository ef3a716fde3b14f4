"""A target and its drafter, loaded and checked together: what the session and the bench open.

The draft is named by a `DraftSpec`, parsed once from what the user typed: a model
reference, `ngram` (model-free prompt lookup), `suffix` (model-free copies from the suffix
index of the conversation and the user's library) or `none` (speculation off).
A model draft must map tokens to ids exactly as the target does; that is judged on its
tokenizer files (`compat.rate_draft`) before its weights are loaded, and refused with the reason.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, replace
from pathlib import Path

from ..engine.drafters import (
    NGRAM,
    NONE,
    SUFFIX,
    Drafter,
    LookupThenModelDrafter,
    ModelDrafter,
    NgramDrafter,
    NoDrafter,
)
from ..engine.speculative import SpeculativeEngine
from ..engine.suffix_drafter import SuffixDrafter
from ..errors import IncompatibleDraftError, InvalidParameter
from ..progress import ProgressCallback
from .chat import stop_token_ids, template_token_ids
from .compat import rate_draft
from .cpu_backend import prepare_draft_for_cpu
from .loading import LoadedModel, load_model, tokenizer_folder

MODEL = "model"


@dataclass(frozen=True)
class DraftSpec:
    """What drafts for the target: a model (`ref`), prompt lookup, or nothing."""

    kind: str  # MODEL | NGRAM | SUFFIX | NONE
    ref: str = ""  # the model reference when kind == MODEL

    @classmethod
    def parse(cls, text: str | DraftSpec) -> DraftSpec:
        if isinstance(text, DraftSpec):
            return text
        cleaned = text.strip()
        if not cleaned:
            raise InvalidParameter("the draft is empty: give a model, 'ngram', 'suffix' or 'none'")
        lowered = cleaned.lower()
        if lowered in (NGRAM, "n-gram"):
            return cls(NGRAM)
        if lowered == SUFFIX:
            return cls(SUFFIX)
        if lowered == NONE:
            return cls(NONE)
        return cls(MODEL, cleaned)

    @property
    def is_model(self) -> bool:
        return self.kind == MODEL

    @property
    def display_name(self) -> str:
        if self.kind == NGRAM:
            return "n-gram"
        if self.kind in (SUFFIX, NONE):
            return self.kind
        return Path(self.ref).name if Path(self.ref).expanduser().exists() else self.ref

    def __str__(self) -> str:
        return self.ref if self.is_model else self.kind


@dataclass
class LoadedPair:
    target: LoadedModel
    draft: LoadedModel | None
    engine: SpeculativeEngine

    @property
    def description(self) -> str:
        return self.target.description


def make_drafter(spec: DraftSpec | str, target: LoadedModel, draft: LoadedModel | None) -> Drafter:
    """The drafter object for a spec; a model draft must already have been judged compatible."""
    spec = DraftSpec.parse(spec)
    if spec.kind == NONE:
        return NoDrafter()
    if spec.kind == NGRAM:
        return NgramDrafter()
    if spec.kind == SUFFIX:
        return SuffixDrafter()
    assert draft is not None
    return auto_drafter(ModelDrafter(draft.model, name=draft.name, vocab_size=target.vocab_size))


def auto_drafter(model: ModelDrafter) -> LookupThenModelDrafter:
    """What a model draft means: prompt lookup and the model, the best of them each step
    (free copies of the conversation where they pay), exact either way (docs/engine.md#drafters).
    Prompt lookup rather than the suffix index: the interleaved A/B on held-out rewrite turns
    gave the suffix index no gain (docs/engine.md, "Copies from a suffix index"). Under
    greedy decoding the model checks the copies first (the cascade: docs/engine.md#drafters)."""
    return LookupThenModelDrafter(model, cascade=True)


def load_draft(
    spec: DraftSpec | str,
    target: LoadedModel,
    *,
    trust_remote_code: bool = False,
    progress: ProgressCallback | None = None,
    cancel: threading.Event | None = None,
) -> tuple[Drafter, LoadedModel | None]:
    """The drafter for `spec`, loading a draft model on the target's device and precision.

    A model draft is judged on its tokenizer files first (`compat.rate_draft`, the verdict
    every front end shows), so an incompatible draft is refused before its weights are read.
    """
    spec = DraftSpec.parse(spec)
    if not spec.is_model:
        return make_drafter(spec, target, None), None
    path = tokenizer_folder(spec.ref, progress=progress, cancel=cancel)
    verdict = rate_draft(str(target.path), str(path))
    if not verdict.compatible:
        raise IncompatibleDraftError(
            f"draft {spec.display_name} does not fit target {target.name}: {verdict.reason}"
        )
    draft = load_model(
        spec.ref,
        device=target.device,
        precision=target.precision,
        offload=target.offloaded,
        trust_remote_code=trust_remote_code,
        progress=progress,
        cancel=cancel,
        as_stored=False,  # its numbers never reach the answer: the fastest path, not the file's
    )
    if draft.device == "cpu":
        stops = stop_token_ids(target.tokenizer, target.model) | stop_token_ids(draft.tokenizer, draft.model)
        # Then every conversation's wrapping (rank_order keeps an id's first place): counted
        # outside a tier, its turn markers and role names alone kept a short chat from any tier.
        wrapping = template_token_ids(target.tokenizer)
        first_ids = [*sorted(stops), *sorted(wrapping)]
        precision = prepare_draft_for_cpu(
            draft.model, draft.precision, first_ids, progress=progress, cancel=cancel
        )
        draft = replace(draft, precision=precision)
    return make_drafter(spec, target, draft), draft


def make_engine(target: LoadedModel, drafter: Drafter) -> SpeculativeEngine:
    return SpeculativeEngine(
        target.model,
        target.tokenizer,
        drafter,
        stop_token_ids=sorted(stop_token_ids(target.tokenizer, target.model)),
    )
