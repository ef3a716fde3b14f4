"""specdec_core: exact speculative decoding for local language models (Qt-free).

Start at `session.ChatSession` (load a target and a drafter, answer a chat, stream
typed events); `engine.speculative.SpeculativeEngine.generate()` is the loop underneath.
docs/architecture.md shows the parts: `engine`, `models`, `kernels` and `tools`.

`__all__` holds what a front end uses (the app, the CLI); tools and tests import the
submodules. The names are imported on first use (PEP 562), so importing the package
loads neither torch nor transformers and changes nothing in the process: `specdec
--help` stays fast, and Ctrl-C during start-up lands in the CLI's handler. A program
calls `prepare_process()` first, before torch loads (startup.py says why).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "ChatSession": "session",
    "LoadSpec": "session",
    "SessionInfo": "session",
    "GenerationParams": "engine.speculative",
    "MAX_DRAFT_LENGTH": "engine.speculative",
    "Event": "engine.events",
    "PrefillEvent": "engine.events",
    "ReadingEvent": "engine.events",
    "ReadAheadEvent": "engine.events",
    "StepEvent": "engine.events",
    "TokenEvent": "engine.events",
    "DoneEvent": "engine.events",
    "GenerationStats": "engine.stats",
    "Message": "models.chat",
    "Compatibility": "models.compat",
    "ModelEntry": "models.catalog",
    "load_catalog": "models.catalog",
    "DEFAULT_TARGET": "models.catalog",
    "DEFAULT_DRAFT": "models.catalog",
    "DEVICES": "models.loading",
    "PRECISIONS": "models.loading",
    "Progress": "progress",
    "SpecdecError": "errors",
    "Cancelled": "errors",
    "add_model_options": "tools.cli",
    "prepare_process": "startup",
}

__all__ = [
    "DEFAULT_DRAFT",
    "DEFAULT_TARGET",
    "DEVICES",
    "MAX_DRAFT_LENGTH",
    "PRECISIONS",
    "Cancelled",
    "ChatSession",
    "Compatibility",
    "DoneEvent",
    "Event",
    "GenerationParams",
    "GenerationStats",
    "LoadSpec",
    "Message",
    "ModelEntry",
    "PrefillEvent",
    "Progress",
    "ReadAheadEvent",
    "ReadingEvent",
    "SessionInfo",
    "SpecdecError",
    "StepEvent",
    "TokenEvent",
    "add_model_options",
    "load_catalog",
    "prepare_process",
]

if TYPE_CHECKING:
    from .engine.events import (
        DoneEvent,
        Event,
        PrefillEvent,
        ReadAheadEvent,
        ReadingEvent,
        StepEvent,
        TokenEvent,
    )
    from .engine.speculative import MAX_DRAFT_LENGTH, GenerationParams
    from .engine.stats import GenerationStats
    from .errors import Cancelled, SpecdecError
    from .models.catalog import DEFAULT_DRAFT, DEFAULT_TARGET, ModelEntry, load_catalog
    from .models.chat import Message
    from .models.compat import Compatibility
    from .models.loading import DEVICES, PRECISIONS
    from .progress import Progress
    from .session import ChatSession, LoadSpec, SessionInfo
    from .startup import prepare_process
    from .tools.cli import add_model_options


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'specdec_core' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value
