"""An HF folder on the CPU as llama.cpp blocks: quantized once into a GGUF in the cache, then
run as stored, with its distance from the source measured when it is made.

A folder of bf16/fp16/fp32 safetensors becomes a real GGUF file with llama.cpp's tensor
names and layout (`token_embd`, `blk.N.attn_q`, ...; a Llama's q/k rows in llama.cpp's
rotary order, as convert_hf_to_gguf.py writes them), quantized by llama.cpp's own reference
quantizers (kernels/cpu/gguf_quantize.c, byte for byte `llama-quantize` without an imatrix) in
one of two mixes (`MIXES`):

- `q4_k_m`, llama.cpp's Q4_K_M recipe: Q4_K for most matrices; Q6_K for the output head
  (or the tied embedding), and for attn_v and ffn_down in the layers llama.cpp's
  `use_more_bits` picks; llama.cpp's fallbacks (Q5_0 for Q4_K, Q8_0 for Q6_K) where a row is
  not whole 256-weight blocks;
- `q8_0`: every matrix Q8_0.

Norms and biases stay F32. The file is then loaded as any GGUF as stored
(gguf_native.build_model), with the folder's own config and tokenizer.

The cache keeps it in `converted/<key[:16]>-<mix>/` (`model.gguf`, `probe.json`, and the
conversion marker written last), the key a hash of the weights' sha256s (recorded, so a
second load only stats the files), the config and the mix: a changed source gets a new
file. The folder appears by an atomic rename of a complete temporary folder under the
conversion lock, so a killed process leaves nothing that is used.

Right after writing the file, the quantized model is measured against the source in fp32
on a fixed text (resources/fidelity_probe.txt) with engine/fidelity.measure; the figures
are kept in `probe.json`, and the load's fidelity label carries them:
`Q4_K_M from bf16 (KL 0.0123 on the probe)`.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, LlamaFileType
from torch import nn

from ..disk_cache import conversion_lock, converted_dir, file_sha256, sweep_stale_temporaries
from ..engine.fidelity import Fidelity, document_ids, measure, tokenizer_bos
from ..errors import ModelLoadError
from ..kernels.batch_invariant import plain_linears
from ..kernels.cpu import native
from ..kernels.cpu.gguf_quantize import quantize
from ..progress import Progress, ProgressCallback, check_cancelled
from . import gguf_convert, gguf_native
from .fetch import exclusive
from .gguf_file import read_gguf

T = GGMLQuantizationType
MIXES = {"q4_k_m": "Q4_K_M", "q8_0": "Q8_0"}
_FILE_TYPES = {"q4_k_m": LlamaFileType.MOSTLY_Q4_K_M, "q8_0": LlamaFileType.MOSTLY_Q8_0}
# llama.cpp's type for a 256-weight type where a row is not whole blocks (tensor_type_fallback).
_FALLBACK = {T.Q4_K: T.Q5_0, T.Q6_K: T.Q8_0}
CACHE_FORMAT = 1  # bumped whenever what is written changes, so older copies are made again
GGUF_NAME = "model.gguf"
PROBE_NAME = "probe.json"
PROBE_TEXT = "fidelity_probe.txt"
PROBE_CTX = 128
PROBE_CHUNKS = 8  # at most: a tokenizer that splits the probe finely still measures in seconds
# A probe loads the source's weights in fp32 beside the measured model: only where they take at
# most this share of the memory available, else the label says the KL was not measured.
REFERENCE_SHARE = 0.5
NOT_MEASURED = "KL not measured: the fp32 reference would not fit in memory"
_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER_NAMES = {path: short for short, path in gguf_native.LAYER_TENSORS.items()}
# The families whose folders are written here: their tensors are LAYER_TENSORS' and their
# norms plain (a Gemma's would need the converter's +1 and its own names).
WRITTEN = ("qwen2", "llama")
_IGNORED = (".rotary_emb.inv_freq",)  # a buffer some checkpoints store, computed from the config


@dataclass(frozen=True)
class Planned:
    """One tensor of the GGUF: where it comes from and what it becomes."""

    source: str  # its name in the safetensors
    name: str  # its name in the GGUF
    qtype: GGMLQuantizationType
    order: np.ndarray | None  # a Llama's q/k: the file's row for each of the source's rows


@dataclass(frozen=True)
class Probe:
    """The quantized model against the source in fp32 on the probe text (engine/fidelity.py);
    the figures None where the fp32 source would not fit in memory (`reference_fits`)."""

    mix: str  # "Q4_K_M"
    source_dtype: str  # "bf16"
    kl_mean: float | None
    kl_p99: float | None
    top1_agreement: float | None
    positions: int
    ctx: int

    def label(self) -> str:
        measured = NOT_MEASURED if self.kl_mean is None else f"KL {self.kl_mean:.4f} on the probe"
        return f"{self.mix} from {self.source_dtype} ({measured})"


@dataclass(frozen=True)
class CachedBlocks:
    gguf: Path
    probe: Probe


def use_more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's choice of the layers whose attn_v and ffn_down get more bits (Q4_K_M)."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def tensor_type(name: str, cols: int, mix: str, layers: int, *, tied: bool) -> GGMLQuantizationType:
    """The block type llama.cpp's recipe gives the GGUF tensor `name` (rows of `cols`) in `mix`."""
    if mix == "q8_0":
        return T.Q8_0 if cols % 32 == 0 else T.F16
    if name == "output.weight" or (tied and name == "token_embd.weight"):
        return T.Q6_K if cols % 256 == 0 else T.Q8_0
    wanted = T.Q4_K
    short = name.split(".")[2] if name.startswith("blk.") else ""
    if short in ("attn_v", "ffn_down") and use_more_bits(int(name.split(".")[1]), layers):
        wanted = T.Q6_K
    if cols % 256 == 0:
        return wanted
    return _FALLBACK[wanted] if cols % 32 == 0 else T.F16


def plan(config: Any, shapes: dict[str, tuple[int, ...]], mix: str) -> list[Planned]:
    """Every tensor of the GGUF for a folder whose safetensors hold `shapes`; ValueError (one
    line) for a tensor the layout has no name for."""
    tied = "lm_head.weight" not in shapes or bool(getattr(config, "tie_word_embeddings", False))
    layers = int(config.num_hidden_layers)
    orders = gguf_native.llama_rows(config) if config.model_type == "llama" else {}
    planned = []
    for source, shape in shapes.items():
        if source.endswith(_IGNORED) or (tied and source == "lm_head.weight"):
            continue  # a tied head is the embedding, as transformers ties it
        name = _gguf_name(source)
        if name is None:
            raise ValueError(f"no GGUF name for the tensor {source}")
        order = orders.get(name.split(".")[2]) if name.startswith("blk.") else None
        qtype = tensor_type(name, shape[-1], mix, layers, tied=tied) if len(shape) == 2 else T.F32
        planned.append(Planned(source, name, qtype, order))
    return planned


def runs_fast(planned: Iterable[Planned]) -> bool:
    """Every type one the kernels run at about int4's pace (gguf_native.FAST_TYPES), in a vector
    build of the kernels (the scalar one is slower than int8: README's precisions)."""
    return {int(p.qtype) for p in planned} <= gguf_native.FAST_TYPES and native.vector_build()


def refusal(folder: Path, config: Any) -> str | None:
    """Why `folder` cannot become llama.cpp blocks here (one line), or None when it can."""
    if config.model_type not in WRITTEN:
        return f"{config.model_type} models are not written as llama.cpp blocks yet (only {', '.join(WRITTEN)})"
    if not list(folder.glob("*.safetensors")):
        return "its weights are not safetensors"
    return native.unavailable()


def shapes_of(folder: Path) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape in the folder's safetensors, from their headers."""
    from safetensors import safe_open

    shapes = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as opened:
            for name in opened.keys():  # noqa: SIM118 (safe_open is not a mapping)
                shapes[name] = tuple(opened.get_slice(name).get_shape())
    return shapes


def cache_key(folder: Path, mix: str, *, progress: ProgressCallback | None = None,
              cancel: threading.Event | None = None) -> str:  # fmt: skip
    """The copy's identity: the weights' and the config's sha256s, the mix and the format."""
    files = [*sorted(folder.glob("*.safetensors")), folder / "config.json"]
    hashes = {f.name: file_sha256(f, label=f.name, progress=progress, cancel=cancel) for f in files}
    text = json.dumps({"format": CACHE_FORMAT, "mix": mix, "files": hashes}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def cache_path(key: str, mix: str) -> Path:
    return converted_dir() / f"{key[:16]}-{mix}"


def cached_blocks(
    folder: Path, config: Any, mix: str, *, label: str,
    progress: ProgressCallback | None = None, cancel: threading.Event | None = None,
) -> CachedBlocks:  # fmt: skip
    """The folder's GGUF in `mix` with its probe: from the cache, or written (once) and measured."""
    key = cache_key(folder, mix, progress=progress, cancel=cancel)
    final = cache_path(key, mix)
    ready = _usable(final, label)
    if ready is not None:
        return ready
    sweep_stale_temporaries()
    converted_dir().mkdir(parents=True, exist_ok=True)
    with exclusive(conversion_lock(key), f"another specdec is quantizing {label}", progress, cancel):
        if _usable(final, label) is None:
            _make(final, key, folder, config, mix, label, progress, cancel)
    made = _usable(final, label)
    if made is None:
        raise ModelLoadError(f"{label}: the quantized copy in {final} could not be read back")
    return made


def _usable(final: Path, label: str) -> CachedBlocks | None:
    if gguf_convert.usable_conversion(final, label=label) is None:
        return None
    try:
        probe = Probe(**json.loads((final / PROBE_NAME).read_text(encoding="utf-8")))
    except (OSError, ValueError, TypeError):
        return None
    return CachedBlocks(final / GGUF_NAME, probe)


def _make(
    final: Path, key: str, folder: Path, config: Any, mix: str, label: str,
    progress: ProgressCallback | None, cancel: threading.Event | None,
) -> None:  # fmt: skip
    """Write, measure and seal the copy in a temporary folder, then rename it into place."""
    tmp = converted_dir() / f".tmp-{key[:16]}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        planned = plan(config, shapes_of(folder), mix)
        if progress is not None:
            progress(Progress(f"Quantizing {label} to {MIXES[mix]} (once)", 0, 0))
        write_gguf(folder, config, planned, mix, tmp / GGUF_NAME, cancel=cancel)
        if progress is not None:
            progress(Progress(f"Measuring {label} at {MIXES[mix]} against its source", 0, 0))
        probe = measure_probe(folder, config, tmp / GGUF_NAME, mix)
        (tmp / PROBE_NAME).write_text(json.dumps(asdict(probe), indent=1), encoding="utf-8")
        check_cancelled(cancel)
        size = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
        gguf_convert.write_marker(tmp, source=str(folder.resolve()), sha256=key, size=size,
                                  source_verified=False, label=label)  # fmt: skip
        gguf_convert.rename_into_place(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def write_gguf(
    folder: Path,
    config: Any,
    planned: list[Planned],
    mix: str,
    out: Path,
    *,
    cancel: threading.Event | None = None,
) -> None:
    """The GGUF of `planned`, written a tensor at a time (one source tensor in memory at once)."""
    import gguf
    from safetensors import safe_open

    writer = gguf.GGUFWriter(str(out), config.model_type)
    writer.add_name(folder.name)
    writer.add_file_type(int(_FILE_TYPES[mix]))
    _add_hyperparameters(writer, config)
    shapes = shapes_of(folder)
    for p in planned:
        rows, cols = (
            (shapes[p.source][0], shapes[p.source][-1])
            if len(shapes[p.source]) == 2
            else (1, shapes[p.source][0])
        )
        if p.qtype == T.F32:
            writer.add_tensor_info(p.name, shapes[p.source], np.dtype(np.float32), 4 * rows * cols)
        else:
            block, size = GGML_QUANT_SIZES[p.qtype]
            row_bytes = cols // block * size
            writer.add_tensor_info(
                p.name, (rows, row_bytes), np.dtype(np.uint8), rows * row_bytes, raw_dtype=p.qtype
            )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    where = {name: file for file in sorted(folder.glob("*.safetensors")) for name in _names(file)}
    for p in planned:
        check_cancelled(cancel)
        with safe_open(str(where[p.source]), framework="pt") as opened:
            values = opened.get_tensor(p.source).to(torch.float32).numpy()
        if p.order is not None:  # the source's row i is the file's row order[i]
            values = values[np.argsort(p.order)]
        writer.write_tensor_data(_encoded(values, p.qtype))
    writer.close()


def _encoded(values: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    if qtype == T.F32:
        return np.ascontiguousarray(values, dtype=np.float32)
    if qtype == T.F16:
        return np.ascontiguousarray(values, dtype=np.float16).view(np.uint8)
    return quantize(values, qtype)


def _names(file: Path) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(file), framework="pt") as opened:
        return list(opened.keys())


def _add_hyperparameters(writer: Any, config: Any) -> None:
    """The model's shape in the GGUF's own keys, for any reader of the file."""
    writer.add_block_count(int(config.num_hidden_layers))
    writer.add_context_length(int(getattr(config, "max_position_embeddings", 0) or 0))
    writer.add_embedding_length(int(config.hidden_size))
    writer.add_feed_forward_length(int(config.intermediate_size))
    writer.add_head_count(int(config.num_attention_heads))
    writer.add_head_count_kv(int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads))
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    writer.add_vocab_size(int(config.vocab_size))


def _gguf_name(source: str) -> str | None:
    if source in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[source]
    parts = source.split(".")
    if len(parts) < 5 or parts[:2] != ["model", "layers"] or not parts[2].isdigit():
        return None
    short = _LAYER_NAMES.get(".".join(parts[3:-1]))
    return f"blk.{parts[2]}.{short}.{parts[-1]}" if short else None


def probe_ids(tokenizer: Any) -> list[int]:
    """The probe text's token ids (after the tokenizer's BOS, where it adds one), at most
    PROBE_CHUNKS chunks of PROBE_CTX."""
    text = resources.files("specdec_resources").joinpath(PROBE_TEXT).read_text(encoding="utf-8")
    return document_ids(tokenizer, text, tokenizer_bos(tokenizer))[: PROBE_CHUNKS * PROBE_CTX]


def measure_on_probe(model: nn.Module, reference: nn.Module, tokenizer: Any) -> Fidelity:
    """`model` against `reference` (the source's weights in fp32) on the probe text, in chunks of
    PROBE_CTX tokens or the model's context if shorter, each after the tokenizer's BOS where it
    adds one (engine/fidelity.py); the reference runs whole matmuls."""
    plain_linears(reference)
    ids = probe_ids(tokenizer)
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None) or PROBE_CTX
    with torch.no_grad():
        return measure(model, reference, ids, ctx=min(PROBE_CTX, limit, len(ids)), bos=tokenizer_bos(tokenizer))


def available_bytes() -> int:
    """The memory the system can give this process without swapping."""
    return int(psutil.virtual_memory().available)


def reference_fits(parameters: int) -> bool:
    """Whether a model of `parameters` weights in fp32 fits in REFERENCE_SHARE of the memory available."""
    return parameters * 4 <= REFERENCE_SHARE * available_bytes()


def measure_probe(folder: Path, config: Any, gguf_path: Path, mix: str) -> Probe:
    """The GGUF's model (as a load runs it) against the folder's weights in fp32, on the probe;
    not measured where those would not fit in memory (`reference_fits`)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = source_dtype(config)  # before building: from_config sets the config's dtype
    if not reference_fits(sum(int(np.prod(shape)) for shape in shapes_of(folder).values())):
        return Probe(mix=MIXES[mix], source_dtype=dtype, kl_mean=None, kl_p99=None, top1_agreement=None,
                     positions=0, ctx=0)  # fmt: skip
    quantized = gguf_native.build_model(read_gguf(gguf_path), config, rope_from_file=False)
    source = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, use_kernels=False).eval()
    result = measure_on_probe(quantized, source, AutoTokenizer.from_pretrained(folder))
    return Probe(
        mix=MIXES[mix], source_dtype=dtype, kl_mean=result.kl_mean, kl_p99=result.kl_p99,
        top1_agreement=result.top1_agreement, positions=result.scored, ctx=result.ctx,
    )  # fmt: skip


def source_dtype(config: Any) -> str:
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    name = str(dtype).removeprefix("torch.") if dtype is not None else ""
    return {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}.get(name, name or "the checkpoint")
