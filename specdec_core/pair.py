"""A target and its drafter, loaded and checked together: what the CLI and the app open.

The draft spec is a model reference, `ngram` (model-free prompt lookup) or `none`.
A model draft must map tokens to ids exactly as the target does, or the engine
refuses it with the compatibility check's reason.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from .chat import stop_token_ids
from .compat import check_draft_compatibility
from .drafters import Drafter, LookupThenModelDrafter, ModelDrafter, NgramDrafter, NoDrafter
from .engine import SpeculativeEngine
from .errors import IncompatibleDraftError
from .loading import LoadedModel, load_model
from .progress import ProgressCallback

MODEL_FREE_DRAFTS = ("ngram", "none")


@dataclass
class LoadedPair:
    target: LoadedModel
    draft: LoadedModel | None
    engine: SpeculativeEngine

    @property
    def description(self) -> str:
        return self.target.description


def make_drafter(spec: str, target: LoadedModel, draft: LoadedModel | None) -> Drafter:
    if spec == "none":
        return NoDrafter()
    if spec == "ngram":
        return NgramDrafter()
    assert draft is not None
    verdict = check_draft_compatibility(
        target.tokenizer,
        draft.tokenizer,
        target_vocab_size=target.vocab_size,
        draft_vocab_size=draft.vocab_size,
    )
    if not verdict.compatible:
        raise IncompatibleDraftError(
            f"draft {draft.name} does not fit target {target.name}: {verdict.reason}"
        )
    # Prompt lookup first (free: copied spans of the conversation), the model otherwise;
    # measured fastest overall in docs/benchmarks.md (`ours-auto`), exact either way.
    return LookupThenModelDrafter(ModelDrafter(draft.model, name=draft.name, vocab_size=target.vocab_size))


def load_draft(
    spec: str,
    target: LoadedModel,
    *,
    progress: ProgressCallback | None = None,
    cancel: threading.Event | None = None,
) -> tuple[Drafter, LoadedModel | None]:
    """The drafter for `spec`, loading a draft model on the target's device and precision."""
    if spec in MODEL_FREE_DRAFTS:
        return make_drafter(spec, target, None), None
    draft = load_model(
        spec, device=target.device, precision=target.precision, progress=progress, cancel=cancel
    )
    return make_drafter(spec, target, draft), draft


def load_pair(
    target_ref: str,
    draft_spec: str,
    *,
    device: str = "auto",
    precision: str = "auto",
    progress: ProgressCallback | None = None,
    cancel: threading.Event | None = None,
) -> LoadedPair:
    target = load_model(target_ref, device=device, precision=precision, progress=progress, cancel=cancel)
    drafter, draft = load_draft(draft_spec, target, progress=progress, cancel=cancel)
    engine = SpeculativeEngine(
        target.model, target.tokenizer, drafter, stop_token_ids=stop_token_ids(target.tokenizer, target.model)
    )
    return LoadedPair(target=target, draft=draft, engine=engine)
