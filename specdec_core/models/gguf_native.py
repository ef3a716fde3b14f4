"""A GGUF model run from its blocks as stored: the weights of the user's file, not a copy.

The model is built from its config with empty weights; each linear then becomes a
`GGUFLinear` over the file's mapped blocks (kernels/cpu/gguf_blocks.py), the embedding reads
rows from the same blocks, and only the small F32 tensors (norms, biases) are copied.
Nothing is de-quantized ahead of time and nothing is re-quantized, so the forward is
the function of the file's weights de-quantized, up to summation order and the rounding of
the activations: Q4_K, Q6_K and the 32-weight 4- and 5-bit types are repacked losslessly for
the int4 kernel, whose rows are int8 per 32 inputs (finer than llama.cpp's Q8_K, one scale per 256), and every
other type keeps fp32 rows (`_activations`).

The model computes what llama.cpp computes from the file, family by family
(`ARCHITECTURES`: Llama, Mistral files included, Qwen2, Qwen3, Gemma 2, Gemma 3, Phi-3):
its config is the header's as llama.cpp's loader reads it (gguf_to_hf.config_from_header),
its rotary embedding the header's and the rope tensors' (gguf_rope.py), and each family's
tensors map onto transformers' modules (`FAMILY_TENSORS`). llama.cpp stores a Llama's q/k
rows in its own rotary order, which `llama_rows` undoes by reordering whole rows (each row
is whole blocks, kept as they are); Gemma's norm weights hold the 1 transformers adds, so
its norms become ones multiplying by the weight as stored (`StoredRMSNorm`). A tensor the
model has no place for is one line, never dropped. Any other family, or a tensor of a type
without a kernel, is refused in one line and the caller falls back to the converted copy.
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
    REPACKED_BITS,
    GGUFLinear,
    UnsupportedBlockType,
    block_type,
    repacks,
)
from ..kernels.cpu.int4_cpu import Int4Linear
from .gguf_file import GGUFFile
from .gguf_rope import FULL, read_rope, set_rotation
from .gguf_to_hf import MODEL_TYPES

F32 = 0
ARCHITECTURES = tuple(MODEL_TYPES)  # the families whose config the header gives (gguf_to_hf)
# The block types whose kernels read a step's weights at about the pace of the re-quantized
# int4 path: those the int4 kernel runs repacked (docs/models.md#fidelity).
FAST_TYPES: frozenset[int] = frozenset({F32, *map(int, REPACKED_BITS)})
# A layer's GGUF tensors (after "blk.N.") and the modules of transformers' decoder layer that
# hold them: a Llama's and a Qwen2's (hf_blocks.py writes these), then each family's own.
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
_QK_NORMS = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
# Gemma: a norm after attention and after the MLP; llama.cpp's `ffn_norm` is the one before it.
_GEMMA_NORMS = {
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
FAMILY_TENSORS: dict[str, dict[str, str]] = {
    "llama": LAYER_TENSORS,
    "qwen2": LAYER_TENSORS,
    "qwen3": {**LAYER_TENSORS, **_QK_NORMS},
    "gemma2": {**LAYER_TENSORS, **_GEMMA_NORMS},
    "gemma3": {**LAYER_TENSORS, **_GEMMA_NORMS, **_QK_NORMS},
    # Phi-3's q/k/v and gate/up are one matrix each, in the file as in transformers' modules.
    "phi3": {
        "attn_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
        "attn_qkv": "self_attn.qkv_proj",
        "attn_output": "self_attn.o_proj",
        "ffn_up": "mlp.gate_up_proj",
        "ffn_down": "mlp.down_proj",
    },
}
# Families whose RMS norms transformers computes as x * (1 + w): llama.cpp's converter stores
# their weights with the 1 added and multiplies by them as stored (its `build_norm`), and so
# does the plain norm put in their place here. The embedding is scaled by sqrt(width) in both.
_OFFSET_NORMS = ("gemma2", "gemma3")


class GGUFEmbedding(nn.Module):
    """Token embeddings read from the file's blocks: each forward de-quantizes its rows only,
    times `scale` where the family's graph scales them (Gemma: sqrt(width), in fp32)."""

    def __init__(self, qtype: int, rows: np.ndarray, dim: int, scale: float | None = None) -> None:
        super().__init__()
        self.qtype, self.rows, self.embedding_dim, self.scale = qtype, rows, dim, scale
        self.num_embeddings = rows.shape[0]

    def dense_weight(self) -> torch.Tensor:
        """All rows de-quantized [num_embeddings, dim], exactly as `forward` reads them (unscaled)."""
        return GGUFLinear(self.qtype, self.rows, self.embedding_dim, self.num_embeddings).dense_weight()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        flat = ids.reshape(-1).cpu().numpy()
        values = dequantize(self.rows[flat], GGMLQuantizationType(self.qtype)).reshape(len(flat), self.embedding_dim)
        rows = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).view(*ids.shape, -1)
        return rows if self.scale is None else rows * torch.tensor(self.scale, dtype=rows.dtype)


class ScaledEmbedding(nn.Embedding):
    """A plain embedding whose rows are multiplied by `scale` (a de-quantized GGUFEmbedding's)."""

    scale: float

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(ids) * torch.tensor(self.scale, dtype=self.weight.dtype)


class StoredRMSNorm(nn.Module):
    """RMS norm multiplying by its weight as stored, as llama.cpp's `build_norm` does (where
    transformers' Gemma norm multiplies by 1 + weight, the converter having added the 1)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size, device="meta"), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * self.weight.float()).to(x.dtype)


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


def auto_runs_as_stored(file: GGUFFile) -> bool:
    """Whether `auto` runs a target from `file` as stored: wherever a vector build of the kernels
    runs its quantized tensors, whatever their types (the user's weights come first; a type outside
    FAST_TYPES is slower than our int4 path, never further from the file). Not where the fallback
    would (torch's matmul over de-quantized weights), nor on the scalar build, where `auto` takes
    int8 (README's precisions; loading.resolve_precision)."""
    quantized = {info.qtype for info in file.tensors.values()} - {F32}
    return not quantized or native.vector_build()


def fidelity(file: GGUFFile, model: nn.Module) -> str:
    """The fidelity label of a model built from `file`: as stored, and how its kernels run."""
    return f"as stored ({file.file_type or 'GGUF'})" + kernel_notes(model)


def kernel_notes(model: nn.Module) -> str:
    """What the kernels do beside the stored weights, for a fidelity label: ", activations int8
    per 32 inputs", linears that fall back; "" when nothing."""
    linears = [m for m in model.modules() if isinstance(m, GGUFLinear)]
    repacked = any(isinstance(m, Int4Linear) for m in model.modules())  # as stored, only repacked blocks are
    notes = ", activations int8 per 32 inputs" if repacked or any(m.activations == I8 for m in linears) else ""
    fallbacks = [m for m in linears if m.path == FALLBACK]
    return notes + (f", {len(fallbacks)} linears {FALLBACK_NOTE} ({fallbacks[0].fallback_reason})" if fallbacks else "")


def type_counts(file: GGUFFile) -> dict[str, int]:
    """How many tensors of each block type the file holds ("Q4_K": 169, ...)."""
    from gguf import GGMLQuantizationType

    return dict(Counter(GGMLQuantizationType(info.qtype).name for info in file.tensors.values()))


def build_model(file: GGUFFile, config: Any, *, as_stored: bool = True, rope_from_file: bool = True) -> nn.Module:
    """The model of `config` computing with `file`'s tensors as stored, or (`as_stored=False`)
    with plain fp32 modules holding them de-quantized: the values a conversion would write,
    made in memory, for the CPU's own precisions to quantize from.

    The rotary embedding rotates as the file's header and rope tensors say (gguf_rope.py);
    `rope_from_file=False` keeps the config's (a file hf_blocks.py wrote from a folder, whose
    config is the source). Every tensor of the file is used, or the load is one line."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    reason = refusal(file)
    if reason is not None:
        raise ModelLoadError(f"{file.path.name}: {reason}")
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    arch, inner = file.architecture, model.model
    tensors = _Tensors(file)
    if arch in _OFFSET_NORMS:
        _stored_norms(model)
    rows = llama_rows(config) if arch == "llama" else {}
    for index, layer in enumerate(inner.layers):
        for short, path in FAMILY_TENSORS[arch].items():
            _place(layer, path, tensors, f"blk.{index}.{short}", rows.get(short))
    embd = file.tensors["token_embd.weight"]
    scale = float(config.hidden_size) ** 0.5 if arch in _OFFSET_NORMS else None
    inner.embed_tokens = GGUFEmbedding(embd.qtype, tensors.raw("token_embd.weight"), embd.dims[0], scale)
    _set_weight(inner.norm, tensors.floats("output_norm.weight"))
    # llama.cpp's Gemma 2 reads its head from the embedding whatever else the file holds.
    head = "output.weight" if "output.weight" in file.tensors and arch != "gemma2" else "token_embd.weight"
    model.lm_head = _linear(tensors, head, None)
    if rope_from_file:
        rope = read_rope(file, list(getattr(config, "layer_types", None) or [FULL]), _head_dim(config))
        tensors.used.update(rope.tensors)
        set_rotation(model, rope)
    _check_no_empty_weights(model, file)
    tensors.check_all_used()
    if not as_stored:
        _dequantize(model, tied=head == "token_embd.weight")
    return model.eval()


class _Tensors:
    """The file's tensors, noting which the model takes: a tensor no module takes would be
    a part of the model left out, so the load refuses it in one line rather than run without."""

    def __init__(self, file: GGUFFile) -> None:
        self.file = file
        self.used: set[str] = set()

    def info(self, name: str) -> Any:
        if name not in self.file.tensors:
            raise ModelLoadError(f"{self.file.path.name}: no tensor {name} in the file")
        self.used.add(name)
        return self.file.tensors[name]

    def raw(self, name: str) -> np.ndarray:
        self.info(name)
        return self.file.raw(name)

    def floats(self, name: str) -> np.ndarray:
        self.info(name)
        return self.file.floats(name)

    def check_all_used(self) -> None:
        unused = [name for name in self.file.tensors if name not in self.used]
        if unused:
            more = f" and {len(unused) - 3} more" if len(unused) > 3 else ""
            raise ModelLoadError(
                f"{self.file.path.name}: tensors this {self.file.architecture} model has no place for: "
                f"{', '.join(unused[:3])}{more}"
            )


def _head_dim(config: Any) -> int:
    return int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)


def _stored_norms(model: nn.Module) -> None:
    """Every RMS norm of the model replaced by one multiplying by its weight as stored."""
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            weight = getattr(child, "weight", None)
            if type(child).__name__.endswith("RMSNorm") and isinstance(weight, torch.Tensor):
                setattr(module, name, StoredRMSNorm(int(weight.shape[0]), float(getattr(child, "eps", 1e-6))))


def _dequantize(model: Any, *, tied: bool) -> None:
    """Each block-reading module replaced by its plain fp32 counterpart, one tensor at a time."""
    head = model.lm_head
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, GGUFEmbedding):
                setattr(module, name, _dense_embedding(child))
            elif isinstance(child, GGUFLinear) and not (tied and child is head):
                setattr(module, name, _dense_linear(child))
    if tied:  # one tensor, as transformers ties them
        embedding = model.model.embed_tokens
        model.lm_head = nn.Linear(embedding.embedding_dim, embedding.num_embeddings, bias=False, device="meta")
        model.lm_head.weight = embedding.weight


def _dense_embedding(blocks: GGUFEmbedding) -> nn.Embedding:
    if blocks.scale is None:
        return nn.Embedding.from_pretrained(blocks.dense_weight(), freeze=True)
    embedding = ScaledEmbedding.from_pretrained(blocks.dense_weight(), freeze=True)
    embedding.scale = blocks.scale
    return embedding


def _dense_linear(blocks: GGUFLinear) -> nn.Linear:
    linear = nn.Linear(blocks.in_features, blocks.out_features, bias=blocks.bias is not None, device="meta")
    linear.weight = nn.Parameter(blocks.dense_weight(), requires_grad=False)
    if blocks.bias is not None:
        linear.bias = nn.Parameter(blocks.bias.detach().clone(), requires_grad=False)
    return linear


def _place(layer: nn.Module, path: str, tensors: _Tensors, stem: str, order: np.ndarray | None) -> None:
    parent_path, _, name = path.rpartition(".")
    parent = layer.get_submodule(parent_path) if parent_path else layer
    module = getattr(parent, name)
    if isinstance(module, nn.Linear):
        setattr(parent, name, _linear(tensors, f"{stem}.weight", order))
    else:
        _set_weight(module, tensors.floats(f"{stem}.weight"))


def _linear(tensors: _Tensors, name: str, order: np.ndarray | None) -> GGUFLinear:
    file = tensors.file
    info = tensors.info(name)
    blocks = file.raw(name)
    bias_name = name.removesuffix(".weight") + ".bias"
    bias = torch.from_numpy(np.array(tensors.floats(bias_name))) if bias_name in file.tensors else None
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
