"""specdec_core: exact speculative decoding for local language models (Qt-free).

Start at `pair.load_pair()` (load a target and a drafter) and
`engine.SpeculativeEngine.generate()` (stream typed events).
"""

from .chat import Message, encode_chat, stop_token_ids
from .drafters import Drafter, ModelDrafter, NgramDrafter, NoDrafter
from .engine import GenerationParams, SpeculativeEngine
from .errors import SpecdecError
from .events import DoneEvent, Event, PrefillEvent, Source, StepEvent, TokenEvent
from .stats import GenerationStats, theoretical_speedup

__all__ = [
    "DoneEvent",
    "Drafter",
    "Event",
    "GenerationParams",
    "GenerationStats",
    "Message",
    "ModelDrafter",
    "NgramDrafter",
    "NoDrafter",
    "PrefillEvent",
    "Source",
    "SpecdecError",
    "SpeculativeEngine",
    "StepEvent",
    "TokenEvent",
    "encode_chat",
    "stop_token_ids",
    "theoretical_speedup",
]
