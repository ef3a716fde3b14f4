"""A fixed-shape step: one preallocated KV cache, a fixed row count, one CUDA graph per shape.

On a GPU a step of a small model is bound by Python and kernel launches, not by the
weights' bytes, unless the whole forward is captured once and replayed. Capture needs
every tensor at a fixed address and every shape fixed, so `StaticRunner` keeps:

- **A static KV cache.** Every attention layer holds all positions in buffers of
  `capacity` slots; a forward writes its rows at their positions, and a rollback (a
  rejected draft, a new chat turn) only moves `len(ids)` back: stale slots are never
  read and are overwritten later. Capacity grows by doubling (a new capture per shape).
- **A fixed row count.** Every forward runs at one of `rows` (padded with copies of its
  last token; longer inputs in chunks of the largest). A target uses one count R, so a
  plain step and a verify of up to R rows run the same kernels on the same shapes.
- **Attention by position** (`kernels/cuda/attention_static.py`): each row reads exactly the
  keys up to its own position (its window on a sliding layer), whatever the capacity,
  so growth, stale slots and the pad rows after the real ones change no real row's numbers.

Together: batch invariance by construction. On CUDA each shape is captured on its first
use and replayed after (`graphs`); a capture that fails leaves the runner eager and says
why (`graphs_off`). Elsewhere it runs eagerly: the same code, which the CPU tests check.

The interface is `kvcache.CachedModel`'s (`kvcache.Runner`), so the engine, drafters and
self-check run on either (`runner_for`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

import torch
from transformers.cache_utils import Cache, StaticLayer

from ..batch_invariant import plain_linears, rowwise_refusal
from ..runner import Runner, is_finite, overflow_error
from . import attention_static
from .nf4_rows import use_row_kernels

log = logging.getLogger(__name__)

TARGET_ROWS = 16  # one verify of up to 15 drafts (MAX_DRAFT_LENGTH) after the last committed token
FIRST_CAPACITY = 256
_FULL = "full_attention"


def static_refusal(model: torch.nn.Module) -> str | None:
    """Why `model` cannot run as a `StaticRunner`, or None when it can."""
    reason = rowwise_refusal(model.config)
    if reason is not None:
        return reason
    if not hasattr(model, "set_attn_implementation"):
        return "a model without transformers' pluggable attention"
    return None


class StaticRunner(Runner):
    """`model` behind a static KV cache, run at fixed row counts (module doc).

    Its attention becomes `attention_static`'s (which still runs a `CachedModel`'s forwards
    row-wise, as the loader made them) and, on CUDA, its linears one matmul per call."""

    row_invariant = True  # by construction (module doc)

    def __init__(
        self, model: torch.nn.Module, rows: Sequence[int] = (TARGET_ROWS,), capacity: int = FIRST_CAPACITY
    ) -> None:
        reason = static_refusal(model)
        if reason is not None:
            raise ValueError(f"the fixed-shape step cannot run this model: {reason}")
        self.model = model
        self.rows = tuple(sorted(set(rows)))
        self.ids: list[int] = []
        self.forwards = 0
        pretrained: Any = model  # a transformers PreTrainedModel
        self._dtype: torch.dtype = pretrained.dtype
        text = pretrained.config.get_text_config(decoder=True)
        self._layers = int(text.num_hidden_layers)
        self._kinds = set(getattr(text, "layer_types", None) or [_FULL])
        pretrained.set_attn_implementation(attention_static.NAME)
        if pretrained.config._attn_implementation != attention_static.NAME:  # transformers only warns
            raise ValueError("the fixed-shape step cannot run this model: its attention is not pluggable")
        if self.device.type == "cuda":
            plain_linears(model)  # one shape per forward already: fixed-rows chunks would only cost
        # nf4 linears read as stored (nf4_rows.py), where its kernel runs: CUDA (or Triton's interpreter).
        self.nf4_row_kernels = use_row_kernels(model)
        self.graphs = self.device.type == "cuda" and os.environ.get("SPECDEC_CUDA_GRAPHS") != "0"
        self.graphs_off = "" if self.graphs else "not on CUDA"
        self._pool: Any = None
        self._shapes: dict[int, _Shape] = {}
        self._allocate(capacity)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def warm_up(self) -> None:
        """One forward of each row count, then an empty cache: on CUDA the first forward of a
        shape compiles its Triton kernels and records its graph, which no timed forward (the
        calibration) or budgeted one (the self-check's) should pay for."""
        for rows in self.rows:
            self.forward([0] * rows, logits_to_keep=1)
        self.reset()

    @property
    def capacity(self) -> int:
        return self._capacity

    def reset(self) -> None:
        self.ids = []

    def crop(self, length: int) -> None:
        """Keep the first `length` positions (the slots past them are unread until rewritten)."""
        del self.ids[length:]

    @torch.inference_mode()
    def forward(self, new_ids: Sequence[int], logits_to_keep: int) -> torch.Tensor:
        """Append `new_ids`; return logits [logits_to_keep, V] (fp32), as `CachedModel.forward`."""
        if not new_ids:
            raise ValueError("a forward needs at least one token")
        kept: list[torch.Tensor] = []
        widest = self.rows[-1]
        try:
            for first in range(0, len(new_ids), widest):
                chunk = list(new_ids[first : first + widest])
                wanted = logits_to_keep - (len(new_ids) - first - len(chunk))
                logits = self._step(chunk)
                if wanted > 0:
                    kept.append(logits[max(0, len(chunk) - wanted) :])
        except BaseException:
            self.reset()  # a chunk may be half-written: re-feed from the start
            raise
        logits = torch.cat(kept) if len(kept) > 1 else kept[0]
        if not is_finite(logits):
            self.reset()
            raise overflow_error(self.model)
        return logits

    # -- one padded forward ------------------------------------------------------

    def _step(self, chunk: list[int]) -> torch.Tensor:
        """`chunk` (at most the widest row count) at the next positions -> fp32 logits [len(chunk), V]."""
        start = len(self.ids)
        rows = next(r for r in self.rows if r >= len(chunk))
        if start + rows > self._capacity:
            self._allocate(max(2 * self._capacity, start + rows))
        shape = self._shapes.get(rows) or self._shapes.setdefault(rows, _Shape(rows, self.device))
        padded = chunk + [chunk[-1]] * (rows - len(chunk))
        shape.ids.copy_(torch.tensor([padded], dtype=torch.long))
        shape.positions.copy_(torch.arange(start, start + rows).unsqueeze(0))
        if self.graphs and shape.graph is None:
            self._capture(shape)  # its warm-up runs write this step's own slots: harmless
        if shape.graph is not None:
            shape.graph.replay()
        else:
            shape.logits = self._run(shape)
        self.ids.extend(chunk)
        self.forwards += 1
        return shape.logits[0, : len(chunk)].to(torch.float32, copy=True)

    def _run(self, shape: _Shape) -> torch.Tensor:
        """The forward on the shape's buffers: cache writes, attention and logits, all on the device.

        The rows' positions go where a mask would (attention_static.py reads them), once per
        kind of layer the model's forward looks up."""
        self._cache.positions = shape.positions[0]
        where = shape.positions.view(1, 1, -1, 1)
        mask: Any = {kind: where for kind in self._kinds} if len(self._kinds) > 1 else where
        out = self.model(
            input_ids=shape.ids,
            position_ids=shape.positions,
            attention_mask=mask,
            cache=self._cache,
            use_cache=True,
            logits_to_keep=0,
        )
        return out.logits

    def _capture(self, shape: _Shape) -> None:
        """Record the shape's forward as a CUDA graph, after warm-up runs on a side stream."""
        try:
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self._run(shape)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                shape.logits = self._run(shape)
            shape.graph = graph
        except torch.OutOfMemoryError:
            raise  # the session's one-line out-of-memory error, not a quiet eager fallback
        except Exception as exc:  # whatever fails to capture runs eagerly; a real error recurs there
            self.graphs = False
            self.graphs_off = f"CUDA graph capture failed: {(str(exc) or type(exc).__name__).splitlines()[0]}"
            log.warning("the fixed-shape step runs eagerly: %s", self.graphs_off)
            for each in self._shapes.values():
                each.graph = None

    def _allocate(self, capacity: int) -> None:
        """(Re)build the cache at `capacity` slots, keeping the live positions; drops captured graphs."""
        old = getattr(self, "_cache", None)
        self._capacity = capacity
        self._cache = _PositionedCache(self._layers, capacity)
        if old is not None:
            self._cache.take_over(old, len(self.ids))
        self._shapes = {}


class _Shape:
    """The fixed input buffers of one row count, and its graph once captured."""

    def __init__(self, rows: int, device: torch.device) -> None:
        self.ids = torch.zeros((1, rows), dtype=torch.long, device=device)
        self.positions = torch.zeros((1, rows), dtype=torch.long, device=device)
        self.graph: Any = None
        self.logits = torch.empty(0)


class _PositionedLayer(StaticLayer):
    """transformers' static layer, written at the runner's row positions rather than appended."""

    def __init__(self, cache: _PositionedCache, capacity: int) -> None:
        super().__init__(max_cache_len=capacity)
        self._owner = cache

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        keys, values = self.buffers()
        keys.index_copy_(2, self._owner.positions, key_states)
        values.index_copy_(2, self._owner.positions, value_states)
        return keys, values

    def buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.keys is not None and self.values is not None
        return self.keys, self.values


class _PositionedCache(Cache):
    def __init__(self, layers: int, capacity: int) -> None:
        self.positions = torch.zeros(0, dtype=torch.long)
        self.slots = [_PositionedLayer(self, capacity) for _ in range(layers)]
        super().__init__(layers=list(self.slots))

    def take_over(self, old: _PositionedCache, live: int) -> None:
        """Copy the first `live` positions of every layer of `old` into this (larger) cache."""
        for mine, theirs in zip(self.slots, old.slots, strict=True):
            if not theirs.is_initialized:
                continue
            keys, values = theirs.buffers()
            mine.lazy_initialization(keys[:, :, :0], values[:, :, :0])
            new_keys, new_values = mine.buffers()
            new_keys[:, :, :live] = keys[:, :, :live]
            new_values[:, :, :live] = values[:, :, :live]
