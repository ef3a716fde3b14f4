"""A batch-invariant forward: a token's logits do not depend on how tokens are grouped.

Speculative decoding verifies k tokens in one forward where plain decoding runs
them one at a time; the prompt is prefilled in one piece or several. Kernels pick
their blocking, and so their order of summation, from the shapes they are given,
so the same token gets different last bits in a 1-row and a k-row forward — and
after rounding (int8 activations, bf16) different enough to flip near-tied argmaxes.
Three changes make every token's numbers a function of the token sequence alone
(docs/engine.md#a-batch-invariant-forward-batch_invariantpy):

- Attention, row by row (`rowwise_attention`): each query row attends through the very
  computation a one-token step makes — one query over exactly its causal prefix, or
  its sliding window — honouring the layer's scaling, grouped KV heads, window and
  logit softcapping. On the CPU in fp32 one C call does every row (attention_cpu.py);
  elsewhere each row is its own SDPA call. A model whose attention needs more (sinks, chunked or
  recurrent layers) is refused (`rowwise_refusal`) and keeps its own attention.
- Linears at one shape (`FixedRowsLinear`): rows go through the matmul in chunks of
  exactly B rows (zero-padded), so the kernel sees one shape whatever the batch.
  fp32 rows are bitwise equal at small B but not natively (MKL's 1-row gemv differs
  from its gemm), and two fp32 rows cost one row's time (memory bound), so B = 2 keeps
  plain steps at full speed; bf16 rows are equal at B = 8 and 16, and bf16 with AMX
  costs the same from 1 to 16 rows, so B = 16 (the measurements: the docs section above;
  `scripts/linear-rows` reruns them). Our int8 linears (quant_cpu) are row-independent
  already; bitsandbytes layers run as dequantize + fixed-rows matmul (`_bnb`).
- Norms at one shape, on CUDA: a GPU reduction spreads its threads between rows and
  the reduced dimension by the row count, so norms run in fixed chunks there too.

The rest of a decoder (embeddings, rotary, activations, residual adds) is elementwise.
Single sequences only (batch 1, no padding): what the engine runs. Whether the result
is bitwise on the machine at hand is measured at load (selfcheck.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface

from .cpu import attention_cpu

NAME = "specdec_rowwise"
_PLAIN_LAYERS = {"full_attention", "sliding_attention"}
# Keyword arguments that change attention's result in ways row-wise attention does not model.
_UNSUPPORTED_KWARGS = ("s_aux", "sinks", "attention_chunk_size")
ROWS = {torch.float32: 2, torch.bfloat16: 16, torch.float16: 16}


def rowwise_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """query: [1, H, q, D]; key/value: [1, H_kv, kv, D] -> ([1, q, H, D], None).

    Keys hold the cache then the batch, in order, so row i is the token at
    kv - q + i and sees keys [lo, kv - q + i]; `sliding_window` w keeps the last w
    of them (transformers' mask: key > query - w). The mask itself is not read.
    """
    for name in _UNSUPPORTED_KWARGS:
        if kwargs.get(name) is not None:
            raise RuntimeError(f"row-wise attention does not support {name!r}; load without it")
    if softcap is None:
        native = attention_cpu.attend(query, key, value, scaling, sliding_window)
        if native is not None:  # the same per-row computation, one call for all rows (CPU, fp32)
            return native, None
    q_len, kv_len = query.shape[2], key.shape[2]
    rows = []
    for i in range(q_len):
        end = kv_len - q_len + i + 1
        start = max(0, end - sliding_window) if sliding_window else 0
        rows.append(
            _attend(query[:, :, i : i + 1], key[:, :, start:end], value[:, :, start:end], scaling, softcap)
        )
    out = rows[0] if q_len == 1 else torch.cat(rows, dim=2)
    return out.transpose(1, 2).contiguous(), None


def _attend(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float | None, softcap: float | None
) -> torch.Tensor:
    """One query row: [1, H, 1, D] over [1, H_kv, n, D] -> [1, H, 1, D]."""
    groups = query.shape[1] // key.shape[1]
    if softcap is None:
        return F.scaled_dot_product_attention(query, key, value, scale=scaling, enable_gqa=groups > 1)
    # As transformers' eager attention with softcapping (Gemma 2), which SDPA cannot express.
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scores = torch.matmul(query, key.transpose(2, 3)) * (
        scaling if scaling is not None else query.shape[-1] ** -0.5
    )
    scores = torch.tanh(scores / softcap) * softcap
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(weights, value)


AttentionInterface.register(NAME, rowwise_attention)


def rowwise_refusal(config: Any) -> str | None:
    """Why row-wise attention cannot reproduce this model's attention, or None when it can."""
    text = config.get_text_config(decoder=True)
    kinds = set(getattr(text, "layer_types", None) or ["full_attention"]) - _PLAIN_LAYERS
    if kinds:
        return f"its {', '.join(sorted(kinds))} layers"
    if getattr(text, "attention_chunk_size", None):
        return "chunked attention"
    if getattr(text, "use_bidirectional_attention", False):
        return "bidirectional attention"
    if "gpt_oss" in str(getattr(text, "model_type", "")):
        return "attention sinks"
    return None


class FixedRowsLinear(nn.Linear):
    """nn.Linear whose matmul always sees `ROWS[dtype]` rows (a class swap: weights untouched)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return in_fixed_rows(lambda rows: F.linear(rows, self.weight, self.bias), x, self.out_features)


def plain_linears(model: nn.Module) -> None:
    """Undo the linears' class swap: one matmul per call, whatever its rows. For a model
    whose numbers are a reference (fidelity), where a verify is never compared with steps."""
    for module in model.modules():
        if type(module) is FixedRowsLinear:
            module.__class__ = nn.Linear  # type: ignore[assignment]  # a class swap back


def in_fixed_rows(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, width: int) -> torch.Tensor:
    """Apply a row-local `fn` to x [..., d] in zero-padded chunks of exactly B rows -> [..., width]."""
    rows_per_call = ROWS.get(x.dtype, 16)
    flat = x.reshape(-1, x.shape[-1])
    n = flat.shape[0]
    pad = -n % rows_per_call
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad, flat.shape[1])])
    out = (
        torch.cat([fn(chunk) for chunk in flat.split(rows_per_call)])
        if flat.shape[0] > rows_per_call
        else fn(flat)
    )
    return out[:n].reshape(*x.shape[:-1], width)


class _FixedRowsNorm:
    """Mixin for a norm module: its forward runs on fixed chunks of rows."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return in_fixed_rows(super().forward, x, x.shape[-1])  # type: ignore[misc]


class _DequantizedBnb:
    """Mixin for a bitsandbytes linear: dequantize the weight, then a fixed-rows matmul.

    bitsandbytes runs a 1-row gemv kernel for a plain step and dequantize + matmul for
    more rows (nf4), and LLM.int8() picks outlier columns across the whole batch (int8):
    either way a verify does not compute what plain decoding computes. Here both take
    the same path: the weight is dequantized to the activations' dtype (the weights
    keep their quantized values; LLM.int8()'s outlier split is not used) and multiplied
    like a plain linear. The extra cost is one dequantization of each weight per forward.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = dequantize_bnb(self).to(x.dtype)  # type: ignore[arg-type]
        bias = None if self.bias is None else self.bias.to(x.dtype)  # type: ignore[attr-defined]
        return in_fixed_rows(lambda rows: F.linear(rows, weight, bias), x, weight.shape[0])


def is_bnb_linear(module: nn.Module) -> bool:
    """A bitsandbytes linear, also under a class mixed into it here or in nf4_rows."""
    return isinstance(module, nn.Linear) and any(
        cls.__module__.startswith("bitsandbytes") for cls in type(module).__mro__
    )


def dequantize_bnb(module: nn.Linear) -> torch.Tensor:
    """The weight [out, in] of a bitsandbytes Linear4bit / Linear8bitLt, dequantized."""
    weight = module.weight
    state = getattr(weight, "quant_state", None)
    if state is not None:  # 4-bit: blockwise absmax with the nf4/fp4 code book
        import bitsandbytes.functional as bnbf

        if getattr(state, "packing_format_for_cpu", False):
            # bitsandbytes repacks CPU weights at its first forward; undo it once.
            weight.data, state = bnbf._convert_weight_packed_for_cpu_inverse(weight.data, state)
            weight.quant_state = state  # type: ignore[attr-defined]  # a bitsandbytes Params4bit
        return bnbf.dequantize_4bit(weight.data, state)
    # 8-bit: int8 rows with one absmax per output row (SCB), as int8_vectorwise_dequant.
    # After a first forward bitsandbytes keeps CB/SCB on the module's state, not the weight.
    held = getattr(module, "state", None)
    scales = getattr(weight, "SCB", None)
    scales = scales if scales is not None else held.SCB  # type: ignore[union-attr]
    return weight.data.float() * scales.float().view(-1, 1) * (1.0 / 127.0)


def mixed_class(cls: type, mixin: type, cache: dict[type, type]) -> type:
    """`cls` with `mixin` first in its bases, made once per class (a class swap keeps the weights)."""
    if cls not in cache:
        cache[cls] = type(f"{mixin.__name__.strip('_')}{cls.__name__}", (mixin, cls), {})
    return cache[cls]


def _is_norm(module: nn.Module) -> bool:
    return isinstance(module, nn.LayerNorm) or type(module).__name__.endswith("RMSNorm")


def make_batch_invariant(model: Any) -> str | None:
    """Make a loaded model's forward batch-invariant in place (any device, any precision).

    Returns None when done, or why attention had to stay the model's own (the
    linears are still fixed; the self-check then reports what remains). Class swaps
    only: weights, state dict and module names stay as they are.
    """
    on_cuda = next(model.parameters()).device.type == "cuda"
    classes: dict[type, type] = {}
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = FixedRowsLinear
        elif is_bnb_linear(module) and not isinstance(module, _DequantizedBnb):
            module.__class__ = mixed_class(type(module), _DequantizedBnb, classes)
        elif on_cuda and _is_norm(module):
            module.__class__ = mixed_class(type(module), _FixedRowsNorm, classes)
    refusal = rowwise_refusal(model.config)
    if refusal is None:
        model.set_attn_implementation(NAME)
        if model.config._attn_implementation != NAME:  # transformers only warns
            refusal = "attention code that takes no pluggable attention function"
    return refusal
