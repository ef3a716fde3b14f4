"""A cache layer written in place, for decoder layers that write their keys and values themselves."""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer


class BufferLayer(DynamicLayer):
    """A full-attention layer whose keys and values live in buffers with room to grow.

    The one-call decoder layers on the CPU (layers_cpu.py) write a step's keys and values
    straight into the buffers, where transformers' layer concatenates and so copies the
    whole cache every step. `keys` and `values` are views of the filled part, so the
    length, `crop` and the mask sizes work as in transformers' layer; a crop only shortens
    the views, and the next write overwrites the dropped positions.
    """

    _layer_type = None  # never register this class in transformers' layer mappings
    key_buffer: torch.Tensor
    value_buffer: torch.Tensor

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.reserve(key_states.shape[-2], key_states.shape[1], key_states.shape[-1], key_states.dtype)

    def reserve(
        self, rows: int, heads: int, dim: int, dtype: torch.dtype = torch.float32
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Buffers [1, heads, capacity, dim] with room for `rows` more positions, and how many they hold."""
        past = self.get_seq_length()
        if not self.is_initialized:
            self.device = torch.device("cpu")
            self.key_buffer = self.value_buffer = torch.empty(1, heads, 0, dim, dtype=dtype)
            self.is_initialized = True
            self._commit(0)
        if past + rows > self.key_buffer.shape[2]:
            capacity = max(past + rows, 2 * self.key_buffer.shape[2], 256)
            self.key_buffer = self._grown(self.key_buffer, past, capacity)
            self.value_buffer = self._grown(self.value_buffer, past, capacity)
            self._commit(past)  # the views now point into the new buffers
        return self.key_buffer, self.value_buffer, past

    def commit(self, rows: int) -> None:
        """`rows` more positions were written after the held ones."""
        self._commit(self.get_seq_length() + rows)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        _, heads, rows, dim = key_states.shape
        keys, values, past = self.reserve(rows, heads, dim, key_states.dtype)
        keys[:, :, past : past + rows] = key_states
        values[:, :, past : past + rows] = value_states
        self.commit(rows)
        assert self.keys is not None and self.values is not None
        return self.keys, self.values

    def _commit(self, length: int) -> None:
        self.keys, self.values = self.key_buffer.narrow(2, 0, length), self.value_buffer.narrow(2, 0, length)

    @staticmethod
    def _grown(buffer: torch.Tensor, held: int, capacity: int) -> torch.Tensor:
        grown = buffer.new_empty(buffer.shape[0], buffer.shape[1], capacity, buffer.shape[3])
        grown[:, :, :held] = buffer[:, :, :held]
        return grown
