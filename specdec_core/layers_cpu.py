"""Decoder layers in fewer, bigger calls on the CPU, for the plain Llama layer shape.

A one-token step of the 0.5B draft at int4 took ~15 ms, ~6 of them outside the
matmuls: ~40 small torch ops per layer (the norms' six ops each, the rotary
embedding's ten, views, slices), each a few microseconds of dispatch, through
transformers' generic layer and attention code. The draft makes most of a model
draft's forwards, so that fixed cost is most of what speculation pays for drafting.

For a layer of the plain shape (Llama, Qwen2, Mistral: two RMSNorms, q/k/v/o with one
rotary embedding over whole heads, SiLU-gated MLP, row-wise attention) this forward
does the same arithmetic in ~15 calls: the norms and the rotary embedding in C
(layers_cpu.c), the projections through the model's own linear modules, attention
through attention_cpu. Every row's numbers depend on that row alone, as before, so
a verify, a prefill and a one-token step still agree bitwise (tests/test_layers_cpu.py).
The rotary embedding computes exactly transformers' operations; the norm sums its
squares in its own order, so its last bits can differ from transformers' norm.

It is installed where the linears are this project's int8 or int4 ones (the CPU
precisions); a layer of any other shape keeps transformers' forward.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from . import attention_cpu, native
from .batch_invariant import NAME as ROWWISE
from .fused_int8 import FusedGateUpMLP

_PLAIN_LAYERS = {"LlamaDecoderLayer", "Qwen2DecoderLayer", "MistralDecoderLayer"}
_PLAIN_NORMS = {"LlamaRMSNorm", "Qwen2RMSNorm", "MistralRMSNorm"}
_PLAIN_ROTARY = {"LlamaRotaryEmbedding", "Qwen2RotaryEmbedding", "MistralRotaryEmbedding"}
_LAYER_PARTS = {"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"}
_ATTENTION_PARTS = {"q_proj", "k_proj", "v_proj", "o_proj"}


def speed_up_layers(model: Any) -> int:
    """Give every decoder layer of the plain shape the fast forward (a class swap); returns how many."""
    if not _model_fits(model):
        return 0
    classes: dict[type, type] = {}
    count = 0
    for module in model.modules():
        if type(module).__name__ in _PLAIN_LAYERS and _layer_fits(module):
            cls = type(module)
            classes.setdefault(cls, type(f"Fast{cls.__name__}", (FastLayer, cls), {}))
            module.__class__ = classes[cls]
            module.fast_window = _window(module.self_attn)
            count += 1
    return count


def _window(attention: nn.Module) -> int | None:
    """The sliding window transformers' attention code passes for this layer (None: none)."""
    if hasattr(attention, "sliding_window"):  # Qwen2: per layer type
        return attention.sliding_window  # type: ignore[return-value]
    return getattr(attention.config, "sliding_window", None)  # Mistral: the config's; Llama: none


def _model_fits(model: Any) -> bool:
    config = getattr(model, "config", None)
    rotary = getattr(getattr(model, "model", None), "rotary_emb", None)
    if config is None or type(rotary).__name__ not in _PLAIN_ROTARY or native.unavailable() is not None:
        return False
    text = config.get_text_config(decoder=True)
    parameter = next(model.parameters(), None)
    return (
        config._attn_implementation == ROWWISE
        and parameter is not None
        and parameter.device.type == "cpu"
        and float(getattr(text, "partial_rotary_factor", 1.0) or 1.0) == 1.0
        and getattr(text, "attn_logit_softcapping", None) is None
    )


def _layer_fits(layer: Any) -> bool:
    attention, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    if set(dict(layer.named_children())) != _LAYER_PARTS or attention is None:
        return False
    if set(dict(attention.named_children())) != _ATTENTION_PARTS:
        return False  # extra parts (per-head norms, sinks) are not modelled here
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    head_dim = getattr(attention, "head_dim", 0)
    return (
        all(type(norm).__name__ in _PLAIN_NORMS and norm.weight.dtype == torch.float32 for norm in norms)
        and isinstance(mlp, FusedGateUpMLP)
        and type(mlp.act_fn).__name__ in ("SiLUActivation", "SiLU")
        and head_dim % 16 == 0
        and 0 < head_dim <= 512
    )


class FastLayer:
    """Mixin for a decoder layer: its forward in fewer calls (see the module docstring)."""

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: Any = None,  # row-wise attention reads positions, not the mask
        position_ids: Any = None,
        cache: Any = None,
        use_cache: bool | None = False,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        past_key_values: Any = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        layer: Any = self
        cache = cache if cache is not None else past_key_values
        if hidden_states.shape[0] != 1 or position_embeddings is None:  # not what the engine runs
            return super().forward(  # type: ignore[misc]
                hidden_states, attention_mask=attention_mask, position_ids=position_ids, cache=cache,
                use_cache=use_cache, position_embeddings=position_embeddings, **kwargs,
            )  # fmt: skip
        attention = layer.self_attn
        cos, sin = position_embeddings
        rows, head_dim = hidden_states.shape[1], attention.head_dim
        normed = rms_norm(hidden_states, layer.input_layernorm)
        query = rotary(attention.q_proj(normed), cos, sin, head_dim)
        key = rotary(attention.k_proj(normed), cos, sin, head_dim)
        value = attention.v_proj(normed).view(1, rows, -1, head_dim).transpose(1, 2)
        if cache is not None:
            key, value = cache.update(key, value, attention.layer_idx, kwargs=kwargs)
        attended = attention_cpu.attend(query, key, value, attention.scaling, layer.fast_window)
        assert attended is not None  # _model_fits and _layer_fits checked what attend needs
        hidden_states = hidden_states + attention.o_proj(attended.view(1, rows, -1))
        return hidden_states + layer.mlp(rms_norm(hidden_states, layer.post_attention_layernorm))


def rms_norm(x: torch.Tensor, norm: Any) -> torch.Tensor:
    """Llama's RMSNorm of x [..., d] (fp32) with the module's weight and epsilon."""
    x = x.contiguous()
    out = torch.empty_like(x)
    dim = x.shape[-1]
    native.library().rms_norm(
        x.data_ptr(), norm.weight.data_ptr(), out.data_ptr(), x.numel() // dim, dim, norm.variance_epsilon
    )
    return out


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int) -> torch.Tensor:
    """x [1, rows, heads * head_dim] (rows may be strided) -> [1, heads, rows, head_dim] rotated."""
    rows = x.shape[1]
    if x.stride(-1) != 1:
        x = x.contiguous()
    heads = x.shape[-1] // head_dim
    cos, sin = cos.reshape(rows, head_dim).contiguous(), sin.reshape(rows, head_dim).contiguous()
    out = torch.empty(1, heads, rows, head_dim)
    native.library().rotary(
        x.data_ptr(), x.stride(1), cos.data_ptr(), sin.data_ptr(), out.data_ptr(), rows, heads, head_dim
    )
    return out
