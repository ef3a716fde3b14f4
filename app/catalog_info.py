"""What the model menus need from the catalog, tolerant of a catalog that is absent or broken.

The catalog names the models the menus offer. Whether a draft fits a target is not
decided here: the one verdict is the core's (`ChatSession.rate_drafts`, from
`compat.rate_draft`), which the worker sends to the draft menu.
"""

from __future__ import annotations

import logging

from specdec_core import DEFAULT_DRAFT, DEFAULT_TARGET, ModelEntry, load_catalog

log = logging.getLogger(__name__)


def entries() -> tuple[ModelEntry, ...]:
    """The catalog's models, or none when the packaged catalog cannot be read."""
    try:
        return load_catalog().models
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("model catalog unavailable: %s", exc)
        return ()


def entry(name: str) -> ModelEntry | None:
    return next((e for e in entries() if e.name == name.strip().lower()), None)


def default_target() -> str:
    return DEFAULT_TARGET


def default_draft() -> str:
    return DEFAULT_DRAFT


def describe(name: str) -> str:
    """A tooltip line for a catalog model: family, size, quantization, download size."""
    model = entry(name)
    if model is None:
        return name
    return (
        f"{model.family} {model.params} · {model.quantization} · {model.size_bytes / 2**30:.1f} GiB\n"
        f"{model.description}"
    )
