"""specdec_core: exact speculative decoding for local language models (Qt-free).

Start at `session.ChatSession` (load a target and a drafter, answer a chat, stream
typed events); `engine.SpeculativeEngine.generate()` is the engine underneath.

The public names below are imported on first use (PEP 562), so that importing the
package — which every `specdec` command does first — loads neither torch nor
transformers: `specdec --help` stays fast and Ctrl-C during start-up lands in the
CLI's handler, not in the middle of an import.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from . import openmp
from ._requirements import check_requirements

check_requirements()
openmp.apply_defaults()  # before torch loads libgomp, which reads it once (openmp.py)

_EXPORTS = {
    "add_model_options": "cli",
    "DEFAULT_DRAFT": "catalog",
    "DEFAULT_TARGET": "catalog",
    "ModelEntry": "catalog",
    "load_catalog": "catalog",
    "ChatSession": "session",
    "check_params": "session",
    "DEVICES": "loading",
    "PRECISIONS": "loading",
    "Compatibility": "compat",
    "rate_draft": "compat",
    "Progress": "progress",
    "ProgressCallback": "progress",
    "Cancelled": "errors",
    "ContextTooLong": "errors",
    "InternalError": "errors",
    "OutOfMemory": "errors",
    "LoadSpec": "session",
    "SessionInfo": "session",
    "DraftSpec": "pair",
    "Message": "chat",
    "encode_chat": "chat",
    "stop_token_ids": "chat",
    "Drafter": "drafters",
    "ModelDrafter": "drafters",
    "NgramDrafter": "drafters",
    "NoDrafter": "drafters",
    "GenerationParams": "engine",
    "MAX_DRAFT_LENGTH": "engine",
    "SpeculativeEngine": "engine",
    "SpecdecError": "errors",
    "DoneEvent": "events",
    "Event": "events",
    "PrefillEvent": "events",
    "ReadingEvent": "events",
    "Source": "events",
    "StepEvent": "events",
    "TokenEvent": "events",
    "GenerationStats": "stats",
    "theoretical_speedup": "stats",
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
    "ContextTooLong",
    "DoneEvent",
    "DraftSpec",
    "Drafter",
    "Event",
    "GenerationParams",
    "GenerationStats",
    "InternalError",
    "LoadSpec",
    "Message",
    "ModelDrafter",
    "ModelEntry",
    "NgramDrafter",
    "NoDrafter",
    "OutOfMemory",
    "PrefillEvent",
    "Progress",
    "ProgressCallback",
    "ReadingEvent",
    "SessionInfo",
    "Source",
    "SpecdecError",
    "SpeculativeEngine",
    "StepEvent",
    "TokenEvent",
    "add_model_options",
    "check_params",
    "encode_chat",
    "load_catalog",
    "rate_draft",
    "stop_token_ids",
    "theoretical_speedup",
]

if TYPE_CHECKING:
    from .catalog import DEFAULT_DRAFT, DEFAULT_TARGET, ModelEntry, load_catalog
    from .chat import Message, encode_chat, stop_token_ids
    from .cli import add_model_options
    from .compat import Compatibility, rate_draft
    from .drafters import Drafter, ModelDrafter, NgramDrafter, NoDrafter
    from .engine import MAX_DRAFT_LENGTH, GenerationParams, SpeculativeEngine
    from .errors import Cancelled, ContextTooLong, InternalError, OutOfMemory, SpecdecError
    from .events import DoneEvent, Event, PrefillEvent, ReadingEvent, Source, StepEvent, TokenEvent
    from .loading import DEVICES, PRECISIONS
    from .pair import DraftSpec
    from .progress import Progress, ProgressCallback
    from .session import ChatSession, LoadSpec, SessionInfo, check_params
    from .stats import GenerationStats, theoretical_speedup


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'specdec_core' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value
