"""A GGUF's rotary embedding computed as llama.cpp computes it from the file.

transformers derives its rotary frequencies from a config's `rope_parameters`; a GGUF
holds llama.cpp's own description instead: the header's `<arch>.rope.*` keys and, for
some families, a tensor of per-frequency divisors (`rope_freqs`, which llama.cpp's
converter writes for a Llama 3's `llama3` scaling; `rope_factors_short`/`_long`, a Phi-3's
longrope). This module turns them into the frequencies and the cos/sin factor llama.cpp's
`ggml_rope_ext` uses (ggml-cpu's `rope_yarn`, `ggml_rope_cache_init`; the context
parameters of `llama_context`), and writes them into the model's rotary module, so the
model rotates exactly as the file says whatever transformers would make of a config.

Per rotary pair i of `n_rot` (the header's `rope.dimension_count`):
    extrapolated  theta_i = base^(-2i/n_rot) / factor_i
    interpolated          = freq_scale * theta_i            (freq_scale = 1 / rope.scaling.factor)
    yarn only             = interpolated * (1 - ramp_i) + extrapolated * ramp_i
and cos/sin are multiplied by the attention factor (yarn: 1 + 0.1 ln(1/freq_scale), times
`rope.scaling.attn_factor`). The yarn ramp uses llama.cpp's defaults (beta_fast 32,
beta_slow 1): these families' loaders read no yarn keys beyond the type, factor and
original context length.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from ..errors import ModelLoadError
from .gguf_file import GGUFFile

SCALING_TYPES = ("none", "linear", "yarn", "longrope")  # llama.cpp's; any other it refuses too
YARN_BETA_FAST, YARN_BETA_SLOW = 32.0, 1.0
DEFAULT_BASE = 10000.0  # llama.cpp's base when the header names none (and Gemma 3's local one)
ROPE_FREQS = "rope_freqs.weight"
LONG_FACTORS, SHORT_FACTORS = "rope_factors_long.weight", "rope_factors_short.weight"
FULL, SLIDING = "full_attention", "sliding_attention"


@dataclass(frozen=True)
class Rotation:
    """One kind of layer's rotation: llama.cpp's `freq_base`, `freq_scale` and factors."""

    base: float
    freq_scale: float
    factors: np.ndarray | None  # per pair: llama.cpp divides each frequency by it


@dataclass(frozen=True)
class Rope:
    """What a file says of its rotary embedding, for every layer type it has."""

    dims: int  # n_rot
    ext_factor: float  # 1 for yarn, else 0
    attn_factor: float  # llama.cpp's cparams.yarn_attn_factor
    n_ctx_orig: int
    rotations: dict[str, Rotation]  # by transformers' layer type
    tensors: tuple[str, ...]  # the file's tensors this reads

    def frequencies(self, layer_type: str) -> tuple[torch.Tensor, float]:
        """transformers' `inv_freq` and `attention_scaling` for layers of `layer_type`."""
        rotation = self.rotations[layer_type]
        extrapolated = _powers(rotation.base, self.dims)
        if rotation.factors is not None:
            extrapolated = (extrapolated / rotation.factors).astype(np.float32)
        interpolated = np.float32(rotation.freq_scale) * extrapolated
        scaling = self.attn_factor
        if self.ext_factor == 0:
            return torch.from_numpy(interpolated.astype(np.float32)), scaling
        low, high = _corr_dims(self.dims, self.n_ctx_orig, rotation.base)
        ramp = 1 - np.clip((np.arange(self.dims // 2) - low) / max(0.001, high - low), 0, 1)
        mix = (ramp * self.ext_factor).astype(np.float32)
        mixed = interpolated * (1 - mix) + extrapolated * mix
        scaling *= 1 + 0.1 * math.log(1 / rotation.freq_scale)
        return torch.from_numpy(mixed.astype(np.float32)), scaling


def _powers(base: float, dims: int) -> np.ndarray:
    """base^(-2i/dims) for each pair, in float32 as transformers computes its default
    frequencies (ggml multiplies the same powers out pair by pair: the same values up to
    float32 rounding), so an unscaled file rotates bit for bit as its conversion does."""
    return (1.0 / (base ** (torch.arange(0, dims, 2, dtype=torch.float) / dims))).numpy()


def _corr_dims(dims: int, n_ctx_orig: int, base: float) -> tuple[float, float]:
    """ggml_rope_yarn_corr_dims: the pairs where yarn's ramp runs from extrapolation to interpolation."""

    def corr_dim(rotations: float) -> float:
        return dims * math.log(n_ctx_orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    return max(0.0, math.floor(corr_dim(YARN_BETA_FAST))), min(dims - 1.0, math.ceil(corr_dim(YARN_BETA_SLOW)))


def read_rope(file: GGUFFile, layer_types: list[str], head_dim: int) -> Rope:
    """The file's rotation for each of `layer_types`, read as llama.cpp's loader for its
    architecture reads it; one line naming what it cannot follow."""
    arch, name = file.architecture, file.path.name
    fields = file.fields

    def key(short: str, default: Any = None) -> Any:
        return fields.get(f"{arch}.{short}", default)

    kind = str(key("rope.scaling.type", "linear"))
    if kind not in SCALING_TYPES:
        raise ModelLoadError(f"{name}: rope scaling type {kind!r} is not one llama.cpp runs ({', '.join(SCALING_TYPES)})")
    dims = int(key("rope.dimension_count", head_dim))
    if dims % 2 or dims > head_dim:
        raise ModelLoadError(f"{name}: {arch}.rope.dimension_count {dims} does not fit heads of {head_dim}")
    factor = float(key("rope.scaling.factor", key("rope.scale_linear", 0.0)) or 0.0)
    freq_scale = 1.0 if kind == "none" or factor == 0.0 else 1.0 / factor
    ext_factor = 1.0 if kind == "yarn" else 0.0
    attn_factor = 1.0
    if ext_factor:
        scale = 1.0 / freq_scale
        attn_factor = (1.0 if scale <= 1.0 else 0.1 * math.log(scale) + 1.0) / (1.0 + 0.1 * math.log(scale))
    attn_factor *= float(key("rope.scaling.attn_factor", 1.0))
    base = float(key("rope.freq_base", DEFAULT_BASE))
    factors, tensors = _factors(file, kind, dims)
    rotations = {FULL: Rotation(base, freq_scale, factors)} if FULL in layer_types else {}
    if SLIDING in layer_types:
        rotations[SLIDING] = _sliding(file, base, freq_scale)
    n_ctx_orig = int(key("rope.scaling.original_context_length", key("context_length", 0)))
    return Rope(dims, ext_factor, attn_factor, n_ctx_orig, rotations, tensors)


def _factors(file: GGUFFile, kind: str, dims: int) -> tuple[np.ndarray | None, tuple[str, ...]]:
    """The per-pair divisors llama.cpp's loader takes for the family, and the tensors read.

    A Llama reads `rope_freqs` (or, with longrope scaling, the long and short factors); a
    Phi-3 the long and short factors. Of those two llama.cpp takes the long ones when the
    context it runs is longer than the original (`rope.scaling.original_context_length`),
    for every position. A model here runs the file's whole context (`context_length`, which
    is also llama.cpp's default context), so it takes what llama.cpp takes at that context.
    """
    arch = file.architecture
    longrope = arch == "phi3" or (arch == "llama" and kind == "longrope")
    if arch == "llama" and not longrope and ROPE_FREQS in file.tensors:
        return _vector(file, ROPE_FREQS, dims), (ROPE_FREQS,)
    if longrope and (SHORT_FACTORS in file.tensors or LONG_FACTORS in file.tensors):
        context = int(file.fields.get(f"{arch}.context_length", 0))
        original = int(file.fields.get(f"{arch}.rope.scaling.original_context_length", context))
        short, long = _vector(file, SHORT_FACTORS, dims), _vector(file, LONG_FACTORS, dims)  # both well-formed
        return (long if context > original else short), (SHORT_FACTORS, LONG_FACTORS)
    return None, ()


def _vector(file: GGUFFile, tensor: str, dims: int) -> np.ndarray:
    if tensor not in file.tensors:
        raise ModelLoadError(f"{file.path.name}: {tensor} is missing beside its pair")
    values = np.array(file.floats(tensor), dtype=np.float32).reshape(-1)
    if values.size != dims // 2:
        raise ModelLoadError(f"{file.path.name}: {tensor} holds {values.size} factors for {dims // 2} rotary pairs")
    return values


def _sliding(file: GGUFFile, base: float, freq_scale: float) -> Rotation:
    """The sliding layers' rotation: Gemma 2's is the global one unless the header names a
    base; Gemma 3's has base 10000 and no scaling unless the header names a base."""
    arch = file.architecture
    swa_base = file.fields.get(f"{arch}.rope.freq_base_swa")
    if arch == "gemma2":
        return Rotation(float(swa_base) if swa_base is not None else base, freq_scale, None)
    return Rotation(float(swa_base) if swa_base is not None else DEFAULT_BASE, 1.0, None)


def set_rotation(model: nn.Module, rope: Rope) -> None:
    """The model's rotary module made to rotate as `rope` says, for each of its layer types.

    transformers keeps one module per model: `inv_freq` and `attention_scaling`, or one
    pair per layer type (`full_attention_inv_freq`, ...) where layer types rotate apart."""
    rotary = model.get_submodule("model.rotary_emb")
    kinds = list(rope.rotations)
    if not all(hasattr(rotary, f"{kind}_inv_freq") for kind in kinds):
        first = rope.rotations[kinds[0]]
        if any(rope.rotations[kind] is not first and not _same(rope.rotations[kind], first) for kind in kinds):
            raise ModelLoadError(f"its {' and '.join(kinds)} layers rotate apart, which this model has no place for")
        kinds = kinds[:1]
    for kind in kinds:
        prefix = f"{kind}_" if hasattr(rotary, f"{kind}_inv_freq") else ""
        inv_freq, scaling = rope.frequencies(kind)
        current = getattr(rotary, f"{prefix}inv_freq")
        if current.shape != inv_freq.shape:
            raise ModelLoadError(f"the rotary embedding has {current.numel()} frequencies, the file {inv_freq.numel()}")
        setattr(rotary, f"{prefix}inv_freq", inv_freq)
        setattr(rotary, f"{prefix}original_inv_freq", inv_freq.clone())
        setattr(rotary, f"{prefix}attention_scaling", scaling)


def _same(a: Rotation, b: Rotation) -> bool:
    return (a.base, a.freq_scale) == (b.base, b.freq_scale) and a.factors is None and b.factors is None
