"""The typed events a generation streams, one vocabulary used everywhere.

Provenance of a committed token (after vLLM's rejection sampler vocabulary):
- `accepted`:  a draft token the target confirmed;
- `corrected`: the target's token replacing the first rejected draft token;
- `bonus`:     the target's extra token after every draft token was accepted;
- `target`:    a token from a plain target step (speculation off, or k = 0 chosen);
- `unknown`:   a served engine's token: the server does not say whether a draft proposed it.

Events are frozen dataclasses so a UI thread can hold them without copying.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from .stats import GenerationStats


class Source(str, Enum):
    ACCEPTED = "accepted"
    CORRECTED = "corrected"
    BONUS = "bonus"
    TARGET = "target"
    UNKNOWN = "unknown"


@dataclass(frozen=True)
class PrefillEvent:
    """The prompt went through the target (and is waiting for the first step)."""

    prompt_tokens: int
    reused_tokens: int  # prompt tokens whose KV was kept from the previous turn
    seconds: float


@dataclass(frozen=True)
class ReadingEvent:
    """A long prompt is going through the target in chunks: `read` of its `total` new tokens so far.

    Sent before each chunk (the first with read 0); the `PrefillEvent` follows the last
    chunk. A prompt read in one forward sends none.
    """

    read: int
    total: int


@dataclass(frozen=True)
class ReadAheadEvent:
    """A read ahead of a message still being typed (`SpeculativeEngine.read_ahead`): the
    target's cache holds `cached` of the `total` tokens it reads.

    Sent once before the first chunk, then after each chunk the target reads.
    """

    cached: int
    total: int


@dataclass(frozen=True)
class TokenEvent:
    """One committed token; `text` is the text it adds (may be "" mid-character)."""

    token_id: int  # -1 where a served engine did not report the id
    text: str
    source: Source
    step: int
    target_prob: float | None = None  # target's probability of this token at its position
    draft_prob: float | None = None  # draft's probability (model drafter only)
    is_stop: bool = False  # an end-of-turn/EOS token: counted, not shown (its text is "")


@dataclass(frozen=True)
class StepEvent:
    """One verify step: k proposed, n accepted, how long it took, running gauges."""

    step: int
    k: int  # draft length the controller asked for
    proposed: int  # draft tokens actually proposed (the n-gram drafter may find fewer)
    accepted: int
    committed: int  # tokens committed by this step (accepted + corrected/bonus, after stops)
    draft_seconds: float
    verify_seconds: float
    tokens_per_second: float  # running, over the decode phase
    acceptance_rate: float  # running accepted / proposed
    measured_speedup: float  # running, see GenerationStats.measured_speedup
    theoretical_speedup: float = 0.0  # running bound for the measured a_i, k and c
    mean_accepted_length: float = 0.0  # running tokens committed per verify
    exactness: str = "unchecked"  # the engine's self-check label (GenerationStats.exactness)


@dataclass(frozen=True)
class DoneEvent:
    """The generation ended (eos, max tokens or cancelled); final stats.

    `text` never holds stop tokens: a final end-of-turn token is in `token_ids` only.
    """

    token_ids: tuple[int, ...]
    text: str
    stats: GenerationStats = field(repr=False)


Event = ReadingEvent | PrefillEvent | TokenEvent | StepEvent | DoneEvent
