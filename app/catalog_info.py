"""What the model menus need from the catalog, tolerant of a catalog that is absent or broken.

The catalog (issue 3) names models and groups them by tokenizer family (`vocab`).
Before a draft is downloaded its tokenizer cannot be compared with the target's,
so the family is the verdict; once both are local, `compat` has the final word
(the worker checks local folders with the real tokenizers).
"""

from __future__ import annotations

import logging

from specdec_core import catalog as catalog_module
from specdec_core.compat import Compatibility

log = logging.getLogger(__name__)


def entries() -> tuple[catalog_module.ModelEntry, ...]:
    """The catalog's models, or none when the packaged catalog cannot be read."""
    try:
        return catalog_module.load_catalog().models
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("model catalog unavailable: %s", exc)
        return ()


def entry(name: str) -> catalog_module.ModelEntry | None:
    return next((e for e in entries() if e.name == name.strip().lower()), None)


def default_target() -> str:
    return catalog_module.DEFAULT_TARGET


def default_draft() -> str:
    return catalog_module.DEFAULT_DRAFT


def catalog_verdict(target_ref: str, draft_name: str) -> Compatibility | None:
    """Draft compatibility from the catalog's tokenizer families; None when it cannot tell."""
    draft = entry(draft_name)
    target = entry(target_ref)
    if draft is None or target is None:
        return None  # decided by the real tokenizers once the draft is loaded
    if draft.vocab != target.vocab:
        return Compatibility(False, f"tokenizer {draft.vocab} vs the target's {target.vocab}")
    recommended = " (recommended)" if draft.name in target.recommended_drafts else ""
    return Compatibility(True, f"same tokenizer family {draft.vocab}{recommended}")


def describe(name: str) -> str:
    """A tooltip line for a catalog model: family, size, quantization, download size."""
    model = entry(name)
    if model is None:
        return name
    return (
        f"{model.family} {model.params} · {model.quantization} · {model.size_bytes / 2**30:.1f} GiB\n"
        f"{model.description}"
    )
