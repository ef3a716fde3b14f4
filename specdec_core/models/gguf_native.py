"""A GGUF model run from its blocks as stored: the weights of the user's file, not a copy.

The model is built from its config with empty weights; each linear then becomes a
`GGUFLinear` over the file's mapped blocks (kernels/cpu/gguf_blocks.py), the embedding reads
rows from the same blocks, and only the small F32 tensors (norms, biases) are copied.
Nothing is de-quantized ahead of time and nothing is re-quantized, so the forward is
the function of the file's weights de-quantized, up to summation order and the rounding of
the activations: Q4_K and Q6_K tensors are repacked losslessly for the int4 kernel, whose
rows are int8 per 32 inputs (finer than llama.cpp's Q8_K, one scale per 256), and every
other type keeps fp32 rows (`_activations`).

Families whose GGUF tensors map onto transformers' modules name by name are listed in
`ARCHITECTURES`; llama.cpp stores a Llama's q/k rows in its own rotary order, which
`llama_rows` undoes by reordering whole rows (each row is whole blocks, kept as they
are). Any other family, or a tensor of a type without a kernel, is refused in one line
and the caller falls back to the converted copy.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
import torch
from torch import nn

from ..errors import ModelLoadError
from ..kernels.cpu import native
from ..kernels.cpu.gguf_blocks import F32 as F32_ROWS
from ..kernels.cpu.gguf_blocks import (
    FALLBACK,
    FALLBACK_NOTE,
    I8,
    GGUFLinear,
    UnsupportedBlockType,
    block_type,
    repacks,
)
from ..kernels.cpu.int4_cpu import K_SCALES, Int4Linear
from .gguf_file import GGUFFile

F32 = 0
ARCHITECTURES = ("qwen2", "llama")
# The block types whose kernels read a step's weights at about the pace of the re-quantized
# int4 path: `auto` runs a file as stored only when all its quantized tensors are of these
# (docs/models.md#fidelity); `--precision gguf` runs any supported type.
Q4_K, Q6_K = 12, 14
FAST_TYPES: frozenset[int] = frozenset({F32, Q4_K, Q6_K})
LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


class GGUFEmbedding(nn.Module):
    """Token embeddings read from the file's blocks: each forward de-quantizes its rows only."""

    def __init__(self, qtype: int, rows: np.ndarray, dim: int) -> None:
        super().__init__()
        self.qtype, self.rows, self.embedding_dim = qtype, rows, dim
        self.num_embeddings = rows.shape[0]

    def dense_weight(self) -> torch.Tensor:
        """All rows de-quantized [num_embeddings, dim], exactly as `forward` reads them."""
        return GGUFLinear(self.qtype, self.rows, self.embedding_dim, self.num_embeddings).dense_weight()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        flat = ids.reshape(-1).cpu().numpy()
        values = dequantize(self.rows[flat], GGMLQuantizationType(self.qtype)).reshape(len(flat), self.embedding_dim)
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).view(*ids.shape, -1)


def refusal(file: GGUFFile) -> str | None:
    """Why `file` cannot run as stored (one line), or None when it can."""
    if file.architecture not in ARCHITECTURES:
        return f"{file.architecture or 'an unnamed'} models do not run as stored yet (only {', '.join(ARCHITECTURES)})"
    for info in file.tensors.values():
        try:
            block_type(info.qtype)
        except UnsupportedBlockType as exc:
            return f"{info.name}: {exc}"
    return None


def runs_fast(file: GGUFFile) -> bool:
    """Every tensor of a type in FAST_TYPES, and any quantized ones run by a vector build of the
    kernels: not by the fallback (torch's matmul over de-quantized weights), nor by the scalar build,
    where `auto` takes int8 (README's precisions; loading.resolve_precision)."""
    quantized = {info.qtype for info in file.tensors.values()} - {F32}
    return quantized <= FAST_TYPES and (not quantized or native.vector_build())


def fidelity(file: GGUFFile, model: nn.Module) -> str:
    """The fidelity label of a model built from `file`: as stored, and how its kernels run."""
    return f"as stored ({file.file_type or 'GGUF'})" + kernel_notes(model)


def kernel_notes(model: nn.Module) -> str:
    """What the kernels do beside the stored weights, for a fidelity label: ", activations int8
    per 32 inputs", linears that fall back; "" when nothing."""
    linears = [m for m in model.modules() if isinstance(m, GGUFLinear)]
    repacked = any(isinstance(m, Int4Linear) and m.bits & K_SCALES for m in model.modules())
    notes = ", activations int8 per 32 inputs" if repacked or any(m.activations == I8 for m in linears) else ""
    fallbacks = [m for m in linears if m.path == FALLBACK]
    return notes + (f", {len(fallbacks)} linears {FALLBACK_NOTE} ({fallbacks[0].fallback_reason})" if fallbacks else "")


def type_counts(file: GGUFFile) -> dict[str, int]:
    """How many tensors of each block type the file holds ("Q4_K": 169, ...)."""
    from gguf import GGMLQuantizationType

    return dict(Counter(GGMLQuantizationType(info.qtype).name for info in file.tensors.values()))


def build_model(file: GGUFFile, config: Any, *, as_stored: bool = True) -> nn.Module:
    """The model of `config` computing with `file`'s tensors as stored, or (`as_stored=False`)
    with plain fp32 modules holding them de-quantized: the values a conversion would write,
    made in memory, for the CPU's own precisions to quantize from."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    reason = refusal(file)
    if reason is not None:
        raise ModelLoadError(f"{file.path.name}: {reason}")
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    inner = model.model
    rows = llama_rows(config) if file.architecture == "llama" else {}
    for index, layer in enumerate(inner.layers):
        for short, path in LAYER_TENSORS.items():
            _place(layer, path, file, f"blk.{index}.{short}", rows.get(short))
    embd = file.tensors["token_embd.weight"]
    inner.embed_tokens = GGUFEmbedding(embd.qtype, file.raw("token_embd.weight"), embd.dims[0])
    _set_weight(inner.norm, file.floats("output_norm.weight"))
    head = "output.weight" if "output.weight" in file.tensors else "token_embd.weight"
    model.lm_head = _linear(file, head, None)
    _check_no_empty_weights(model, file)
    if not as_stored:
        _dequantize(model, tied=head == "token_embd.weight")
    return model.eval()


def _dequantize(model: Any, *, tied: bool) -> None:
    """Each block-reading module replaced by its plain fp32 counterpart, one tensor at a time."""
    head = model.lm_head
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, GGUFEmbedding):
                setattr(module, name, nn.Embedding.from_pretrained(child.dense_weight(), freeze=True))
            elif isinstance(child, GGUFLinear) and not (tied and child is head):
                setattr(module, name, _dense_linear(child))
    if tied:  # one tensor, as transformers ties them
        embedding = model.model.embed_tokens
        model.lm_head = nn.Linear(embedding.embedding_dim, embedding.num_embeddings, bias=False, device="meta")
        model.lm_head.weight = embedding.weight


def _dense_linear(blocks: GGUFLinear) -> nn.Linear:
    linear = nn.Linear(blocks.in_features, blocks.out_features, bias=blocks.bias is not None, device="meta")
    linear.weight = nn.Parameter(blocks.dense_weight(), requires_grad=False)
    if blocks.bias is not None:
        linear.bias = nn.Parameter(blocks.bias.detach().clone(), requires_grad=False)
    return linear


def _place(layer: nn.Module, path: str, file: GGUFFile, stem: str, order: np.ndarray | None) -> None:
    parent_path, _, name = path.rpartition(".")
    parent = layer.get_submodule(parent_path) if parent_path else layer
    module = getattr(parent, name)
    if isinstance(module, nn.Linear):
        setattr(parent, name, _linear(file, f"{stem}.weight", order))
    else:
        _set_weight(module, file.floats(f"{stem}.weight"))


def _linear(file: GGUFFile, name: str, order: np.ndarray | None) -> GGUFLinear:
    info = file.tensors[name]
    blocks = file.raw(name)
    bias_name = name.removesuffix(".weight") + ".bias"
    bias = torch.from_numpy(np.array(file.floats(bias_name))) if bias_name in file.tensors else None
    if order is not None:  # a copy of these rows only, each row's blocks unchanged
        blocks = np.ascontiguousarray(blocks[order])
        bias = bias[torch.from_numpy(order)] if bias is not None else None
    in_features, out_features = info.dims[0], int(np.prod(info.dims[1:]))
    linear = GGUFLinear(info.qtype, blocks, in_features, out_features, bias, activations=_activations(info.qtype))
    if linear.packed is not None:
        file.drop_pages(name)  # the repacked copy is what runs: the file's pages need not stay resident
    return linear


def _activations(qtype: int) -> str:
    """Int8 rows per 32 inputs where the int4 kernel runs the type repacked: its pace, and
    rounding finer than llama.cpp's for these types. Elsewhere fp32 rows: the answer then
    carries the file's rounding and no other."""
    return I8 if repacks(qtype) else F32_ROWS


def _set_weight(module: nn.Module, values: np.ndarray) -> None:
    module.weight = nn.Parameter(torch.from_numpy(np.array(values, dtype=np.float32)), requires_grad=False)


def llama_rows(config: Any) -> dict[str, np.ndarray]:
    """The file's row for each of transformers' q and k rows (llama.cpp interleaves the rotary halves)."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads

    def order(heads: int) -> np.ndarray:
        half = head_dim // 2
        return np.array(
            [h * head_dim + 2 * j + t for h in range(heads) for t in range(2) for j in range(half)], dtype=np.int64
        )

    return {"attn_q": order(config.num_attention_heads), "attn_k": order(config.num_key_value_heads)}


def _check_no_empty_weights(model: nn.Module, file: GGUFFile) -> None:
    empty = [name for name, p in model.named_parameters() if p.device.type == "meta"]
    if empty:
        raise ModelLoadError(f"{file.path.name}: no tensor in the file for {', '.join(empty[:3])}")
