"""Decoder layers in fewer, bigger calls on the CPU, for the plain Llama layer shape.

Once the weights are at 4 bits, much of a one-token step is spent outside the matmuls:
~40 small torch ops per layer (the norms' six ops each, the rotary embedding's ten,
views, slices), each paying its dispatch, through transformers' generic layer and
attention code. The draft makes most of a model draft's forwards, so that fixed cost is
most of what speculation pays for drafting. The figures:
docs/engine.md#fewer-bigger-calls-on-the-cpu-nativepy-attention_cpuc-layers_cpuc-kv_inplacepy

For a layer of the plain shape (Llama, Qwen2, Mistral: two RMSNorms, q/k/v/o with one
rotary embedding over whole heads, SiLU-gated MLP, row-wise attention) this forward
does the same arithmetic in ~15 calls: the norms and the rotary embedding in C
(layers_cpu.c), the projections through the model's own linear modules, attention
through attention_cpu. Every row's numbers depend on that row alone, so
a verify, a prefill and a one-token step agree bitwise (tests/test_layers_cpu.py).
The rotary embedding computes exactly transformers' operations; the norm sums its
squares in its own order, so its last bits can differ from transformers' norm.

Where all four linears are 4/6-bit ones (int4_cpu) the layer goes further: one C call
(`decoder_layer`) runs the whole layer, writing its keys and values straight into the
cache's buffers (kvcache.BufferLayer), so a step pays no Python, no allocations and no
cache copy per layer. It computes exactly what the forward below computes, step for step
(tests/test_layers_cpu.py checks it bitwise), so a model gives the same numbers whichever
cache it runs with: transformers' generate with its own cache takes the forward below.

Where every layer of a Llama, Qwen2 or Mistral model runs in one call, the model's
forward can too (`OneCallStack`, used by kvcache.CachedModel): the embedding, transformers'
own rotary embedding, then all layers in one C call (`decoder_stack`), then the model's
own final norm and head. The Python between the layers (the buffers' bookkeeping, views,
the call itself) and transformers' mask construction are gone; the
arithmetic is the same calls in the same order (tests/test_layers_cpu.py checks it bitwise).

It is installed where the linears are this project's int8 or int4 ones (the CPU
precisions); a layer of any other shape keeps transformers' forward.
"""

from __future__ import annotations

import ctypes
import sys
from typing import Any

import torch
from torch import nn

from ..batch_invariant import NAME as ROWWISE
from . import attention_cpu, native
from .fused_int8 import FusedGateUpMLP, FusedProjection
from .int4_cpu import Int4Linear
from .kv_inplace import BufferLayer

_PLAIN_MODELS = {"LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM"}
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
            module.one_call = _one_call_weights(module)
            count += 1
    return count


def writes_cache_in_place(model: Any) -> bool:
    """Whether the model's layers run in one call, so its cache should be kvcache.BufferLayers."""
    return any(getattr(module, "one_call", None) is not None for module in model.modules())


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


class _Linear(ctypes.Structure):
    """layers_cpu.c's linear_weights: a 4/6-bit linear as int4_linear takes it."""

    _fields_ = [
        ("packed", ctypes.c_void_p), ("bias", ctypes.c_void_p),
        ("n_out", ctypes.c_int64), ("k", ctypes.c_int64), ("bits", ctypes.c_int64),
    ]  # fmt: skip


class _LayerWeights(ctypes.Structure):
    """layers_cpu.c's layer_weights. It points into the layer's tensors, which stay as loaded."""

    _fields_ = [
        ("qkv", _Linear), ("o", _Linear), ("gate_up", _Linear), ("down", _Linear),
        ("input_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p),
        ("input_eps", ctypes.c_float), ("post_eps", ctypes.c_float),
        ("scaling", ctypes.c_float), ("unused", ctypes.c_float),
        ("hidden", ctypes.c_int64), ("heads", ctypes.c_int64), ("kv_heads", ctypes.c_int64),
        ("head_dim", ctypes.c_int64), ("intermediate", ctypes.c_int64), ("window", ctypes.c_int64),
    ]  # fmt: skip


def _one_call_weights(layer: Any) -> _LayerWeights | None:
    """The C description of a layer whose linears are all 4/6-bit, q/k/v fused in that order; else None."""
    attention, mlp = layer.self_attn, layer.mlp
    parts = [attention.q_proj, attention.k_proj, attention.v_proj]
    if not all(isinstance(p, FusedProjection) and p.shared is parts[0].shared for p in parts):
        return None
    qkv = parts[0].shared.linear
    dim = attention.head_dim
    heads, kv_heads = parts[0].out_features // dim, parts[1].out_features // dim
    linears = (qkv, attention.o_proj, mlp.gate_up, mlp.down_proj)
    if not all(isinstance(linear, Int4Linear) for linear in linears) or [p.start for p in parts] != [
        0, heads * dim, (heads + kv_heads) * dim,
    ]:  # fmt: skip
        return None
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    return _LayerWeights(
        *(_c_linear(linear) for linear in linears),
        norms[0].weight.data_ptr(), norms[1].weight.data_ptr(),
        norms[0].variance_epsilon, norms[1].variance_epsilon,
        attention.scaling if attention.scaling is not None else dim**-0.5, 0.0,
        qkv.in_features, heads, kv_heads, dim, mlp.intermediate, layer.fast_window or 0,
    )  # fmt: skip


def _c_linear(linear: Int4Linear) -> _Linear:
    bias = None if linear.bias is None else linear.bias.data_ptr()
    return _Linear(linear.packed.data_ptr(), bias, linear.out_features, linear.in_features, linear.bits)


class FastLayer:
    """Mixin for a decoder layer: its forward in fewer calls (see the module docstring)."""

    # Forwards of this many rows or more skip the one call, so that linears with a path
    # of their own for many rows (a draft's reads, draft_bulk) run it.
    bulk_rows: int = sys.maxsize

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
        layer_cache = cache.layers[attention.layer_idx] if cache is not None else None
        if layer.one_call is not None and isinstance(layer_cache, BufferLayer) and rows < layer.bulk_rows:
            return _one_call(layer, hidden_states, cos, sin, layer_cache)
        normed = rms_norm(hidden_states, layer.input_layernorm)
        query = rotary(attention.q_proj(normed), cos, sin, head_dim)
        key = rotary(attention.k_proj(normed), cos, sin, head_dim)
        value = attention.v_proj(normed).view(1, rows, -1, head_dim).transpose(1, 2)
        if cache is not None:
            key, value = cache.update(key, value, attention.layer_idx, kwargs=kwargs)
        attended = attention_cpu.attend(query, key, value, attention.scaling, layer.fast_window)
        assert attended is not None  # _model_fits and _layer_fits checked what attend needs
        hidden_states = hidden_states + attention.o_proj(attended.view(1, rows, -1))
        mlp = layer.mlp
        gate_up = mlp.gate_up(rms_norm(hidden_states, layer.post_attention_layernorm))
        return hidden_states + mlp.down_proj(silu_mul(gate_up, mlp.intermediate))


def _one_call(
    layer: Any, hidden_states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layer_cache: BufferLayer
) -> torch.Tensor:
    """The layer as one C call; its keys and values go straight into the cache's buffers."""
    weights: _LayerWeights = layer.one_call
    rows, dim = hidden_states.shape[1], weights.head_dim
    keys, values, past = layer_cache.reserve(rows, weights.kv_heads, dim)
    out = hidden_states.float().clone(memory_format=torch.contiguous_format)  # updated in place
    cos, sin = cos.reshape(rows, dim).contiguous(), sin.reshape(rows, dim).contiguous()
    status = native.library().decoder_layer(
        ctypes.byref(weights), out.data_ptr(), rows, cos.data_ptr(), sin.data_ptr(),
        keys.data_ptr(), values.data_ptr(), keys.shape[2], past, torch.get_num_threads(),
    )  # fmt: skip
    if status != 0:
        raise MemoryError(f"out of memory in a decoder layer of {rows} rows over {past + rows} positions")
    layer_cache.commit(rows)
    return out


class OneCallStack:
    """A model whose every decoder layer runs in one call, run as one call for all of them.

    The model's own forward does: embed, rotary embedding for the positions after the
    cache, each layer, final norm, the head on the last `logits_to_keep` rows. This does
    the same with the same modules and C functions, minus the Python between them.
    """

    def __init__(self, model: Any) -> None:
        self.model = model
        layers = self.layers = model.model.layers
        self.weights = [layer.one_call for layer in layers]
        self._pointers = (ctypes.c_void_p * len(layers))(*(ctypes.addressof(w) for w in self.weights))

    @staticmethod
    def fits(model: Any) -> bool:
        """Llama/Qwen2/Mistral with every layer in one call (their forwards do nothing else)."""
        inner = getattr(model, "model", None)
        layers = getattr(inner, "layers", None)
        return (
            type(model).__name__ in _PLAIN_MODELS
            and layers is not None
            and len(layers) == model.config.num_hidden_layers
            and all(getattr(layer, "one_call", None) is not None for layer in layers)
        )

    def forward(self, cache: Any, input_ids: torch.Tensor, logits_to_keep: int) -> torch.Tensor | None:
        """Logits [1, logits_to_keep, V] after appending `input_ids` [1, rows] to `cache`;
        None (nothing done) when a cache layer is not a BufferLayer."""
        layer_caches = cache.layers[: len(self.weights)]
        if len(layer_caches) != len(self.weights) or not all(isinstance(c, BufferLayer) for c in layer_caches):
            return None
        inner, rows = self.model.model, input_ids.shape[1]
        if rows >= self.layers[0].bulk_rows:
            return None  # the layers' own forwards, with their linears' paths for many rows
        hidden = inner.embed_tokens(input_ids).float().contiguous()  # updated in place by the layers
        past = layer_caches[0].get_seq_length()
        positions = torch.arange(past, past + rows, device=hidden.device).unsqueeze(0)
        cos, sin = inner.rotary_emb(hidden, positions)
        dim = self.weights[0].head_dim
        cos, sin = cos.reshape(rows, dim).contiguous(), sin.reshape(rows, dim).contiguous()
        buffers = [c.reserve(rows, w.kv_heads, dim) for c, w in zip(layer_caches, self.weights, strict=True)]
        if any(held != past for _, _, held in buffers):
            return None
        keys = (ctypes.c_void_p * len(buffers))(*(k.data_ptr() for k, _, _ in buffers))
        values = (ctypes.c_void_p * len(buffers))(*(v.data_ptr() for _, v, _ in buffers))
        capacity = (ctypes.c_int64 * len(buffers))(*(k.shape[2] for k, _, _ in buffers))
        status = native.library().decoder_stack(
            self._pointers, len(buffers), hidden.data_ptr(), rows, cos.data_ptr(), sin.data_ptr(),
            keys, values, capacity, past, torch.get_num_threads(),
        )  # fmt: skip
        if status != 0:
            raise MemoryError(f"out of memory in the decoder layers, {rows} rows over {past + rows} positions")
        for layer_cache in layer_caches:
            layer_cache.commit(rows)
        hidden = inner.norm(hidden)
        return self.model.lm_head(hidden[:, -logits_to_keep:, :])


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
        x.data_ptr(), x.stride(1), cos.data_ptr(), sin.data_ptr(), out.data_ptr(), rows * head_dim, rows,
        heads, head_dim,
    )  # fmt: skip
    return out


def silu_mul(gate_up: torch.Tensor, intermediate: int) -> torch.Tensor:
    """silu(gate) * up from gate_up [..., 2 * intermediate] (gate first), fp32, in C (layers_cpu.c)."""
    gate_up = gate_up.float().contiguous()
    out = torch.empty(*gate_up.shape[:-1], intermediate)
    rows = gate_up.numel() // (2 * intermediate)
    native.library().silu_mul(gate_up.data_ptr(), out.data_ptr(), rows, intermediate, torch.get_num_threads())
    return out
