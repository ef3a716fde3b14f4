"""Load one model reference onto a device at a precision, refusing what is wrong in one line.

Precision choices (`auto` picks the fastest that fits and says what it chose):
- CPU: `int4` is our batch-invariant 4-bit kernel (int4_cpu; fewer bytes a step than
  int8; it needs AVX2 (or AVX-512 VNNI) and a C compiler, and `auto` takes it where it runs);
  `int8` our batch-invariant per-token int8 (see quant_cpu; several times fp32's speed),
  `bf16`, `fp32`; `nf4` goes through bitsandbytes' CPU backend (far slower than our int8:
  docs/performance.md#measurements-behind-the-design), allowed but never picked by `auto`.
- CUDA: `bf16` (`fp16` where bf16 is unsupported) when the weights fit in 3/4 of the
  free memory, else `nf4` (bitsandbytes); `int8` is bitsandbytes' LLM.int8(). The size
  is counted in parameters from the safetensors headers, so a bf16 and an fp32
  checkpoint of one model size alike. `offload=True` lets accelerate place what does
  not fit on the CPU (`device_map="auto"`: slow, but it runs); on CPU it changes nothing.

A model must be what it claims: a causal LM by its declared architecture, with every
weight that architecture needs present in the checkpoint and none left over (tied
embeddings are fine). Custom modelling code (`auto_map`) never runs unless the caller
opts in with `trust_remote_code=True`; transformers is told so explicitly everywhere,
so it never stops to ask on a terminal.
"""

from __future__ import annotations

import importlib.util
import json
import math
import struct
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import ModelLoadError, OutOfMemory
from ..kernels.batch_invariant import make_batch_invariant
from ..kernels.cpu import native
from ..kernels.cpu.quant_cpu import int8_available
from ..progress import Progress, ProgressCallback, check_cancelled
from . import gguf_convert, gguf_native, hf_blocks, requant_probe
from .cpu_backend import prepare_as_stored, prepare_for_cpu
from .gguf_convert import metadata_folder
from .gguf_file import GGUFFile, read_gguf
from .gguf_to_hf import config_from_header
from .refs import gguf_file_of, resolve_model_ref
from .requirements import check_requirements

DEVICES = ("auto", "cpu", "cuda")
# AS_STORED: a GGUF's blocks as the file holds them (CPU; gguf_native.py).
AS_STORED = "gguf"
# q4_k_m, q8_0: an HF folder quantized once into llama.cpp's blocks, run as stored (CPU; hf_blocks.py).
PRECISIONS = ("auto", "fp32", "bf16", "fp16", "int8", "int4", "nf4", AS_STORED, *hf_blocks.MIXES)
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# Bytes a parameter takes in memory at each precision (nf4: 4 bits plus block scales).
_BYTES_PER_PARAM = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "int8": 1.0, "int4": 0.63, "nf4": 0.56}
# Share of free GPU memory the weights may take; the rest is KV cache and activations.
_WEIGHTS_SHARE = 0.75
TRUST_REMOTE_CODE_HINT = "pass --trust-remote-code to run it, only if you trust its author"


@dataclass
class LoadedModel:
    ref: str
    path: Path
    model: Any  # a transformers PreTrainedModel (causal LM), eval mode
    tokenizer: Any
    device: str
    precision: str
    offloaded: bool = False  # some layers live on the CPU (device_map="auto")
    fidelity: str = ""  # how the weights relate to the source's, e.g. "as stored (Q4_K_M)"

    @property
    def description(self) -> str:
        """What the user sees, e.g. "cpu · int8"."""
        return f"{self.device} · {self.precision}" + (" · offload" if self.offloaded else "")

    @property
    def vocab_size(self) -> int:
        return int(self.model.config.get_text_config().vocab_size)

    @property
    def context_length(self) -> int | None:
        return context_length(self.model.config)

    @property
    def name(self) -> str:
        return Path(self.ref).name if Path(self.ref).exists() else self.ref


def context_length(config: Any) -> int | None:
    """Positions the model can attend over, from its config (None when it does not say)."""
    text = config.get_text_config()
    for key in ("max_position_embeddings", "n_positions", "n_ctx", "max_sequence_length", "seq_length"):
        value = getattr(text, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def resolve_device(device: str) -> str:
    if device not in DEVICES:
        raise ModelLoadError(f"unknown device {device!r}: use one of {', '.join(DEVICES)}")
    cuda = torch.cuda.is_available()
    if device == "cuda" and not cuda:
        raise ModelLoadError(
            f"CUDA was requested but torch {torch.__version__} sees no GPU; use --device cpu "
            "(or install a CUDA build of torch, see README)"
        )
    if device == "auto":
        return "cuda" if cuda else "cpu"
    return device


def resolve_precision(precision: str, device: str, parameters: int, *, offload: bool = False) -> str:
    """`auto`: the fastest precision whose weights fit in the device's free memory."""
    if precision not in PRECISIONS:
        raise ModelLoadError(f"unknown precision {precision!r}: use one of {', '.join(PRECISIONS)}")
    if precision == "int4":
        _check_int4(device)
    if precision != "auto":
        return precision
    if device == "cpu":
        # 4 bits read fewer bytes a step than int8 at the same perplexity
        # (docs/engine.md#the-cpu-4-bit-path-int4_cpupy-int4_cpuc).
        # The scalar build does its dot products a value at a time: there int8 is the fast one.
        if native.vector_build():
            return "int4"
        return "int8" if int8_available() else "bf16"
    half = "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    if offload:
        return half  # what does not fit goes to the CPU
    free, _ = torch.cuda.mem_get_info()
    budget = _WEIGHTS_SHARE * free
    for choice in (half, "nf4"):
        if parameters * _BYTES_PER_PARAM[choice] <= budget:
            return choice
    raise OutOfMemory(
        f"the model has {parameters / 1e9:.1f}B parameters: even at nf4 its weights "
        f"(~{parameters * _BYTES_PER_PARAM['nf4'] / 2**30:.1f} GiB) exceed 3/4 of the GPU's "
        f"{free / 2**30:.1f} GiB free; use --offload (slow) or --device cpu"
    )


def _check_int4(device: str) -> None:
    if device != "cpu":
        raise ModelLoadError("int4 is a CPU precision; on a GPU use nf4")
    reason = native.unavailable()
    if reason:
        raise ModelLoadError(reason)


def load_model(
    ref: str,
    *,
    device: str = "auto",
    precision: str = "auto",
    offload: bool = False,
    trust_remote_code: bool = False,
    progress: ProgressCallback | None = None,
    cancel: threading.Event | None = None,
    as_stored: bool = True,
) -> LoadedModel:
    """`ref` loaded on `device` at `precision`. `as_stored=False` never takes a GGUF's blocks
    as stored (a draft, whose numbers never reach the answer, takes the fastest path)."""
    check_requirements()  # a library user may not have called startup.prepare_process
    device = resolve_device(device)
    file = gguf_for_cpu(ref, device, precision, progress=progress, cancel=cancel)
    if (precision == AS_STORED or precision in hf_blocks.MIXES) and not as_stored:
        precision = "auto"  # a draft: the fastest of the CPU's own precisions
    if file is not None:
        stored = precision == AS_STORED or (precision == "auto" and as_stored and gguf_native.auto_runs_as_stored(file))
        return _load_from_file(ref, file, AS_STORED if stored else precision, trust_remote_code,
                               progress=progress, cancel=cancel, probe=as_stored)  # fmt: skip
    path = resolve_path(ref, progress=progress, cancel=cancel)
    config = load_config(path, ref, trust_remote_code)
    mix = _blocks_mix(path, config, ref, device, precision, as_stored)
    if mix is not None:
        return _load_folder_as_blocks(ref, path, config, mix, trust_remote_code, progress=progress, cancel=cancel)
    parameters = checkpoint_parameters(path, config)
    precision = resolve_precision(precision, device, parameters, offload=offload)
    check_cancelled(cancel)
    if progress:
        progress(Progress(f"Loading {Path(ref).name or ref} ({device} · {precision})", 0, 0))
    tokenizer = load_tokenizer(path, ref, trust_remote_code)
    model = _load_weights(path, ref, device, precision, offload=offload and device == "cuda",
                          trust_remote_code=trust_remote_code)  # fmt: skip
    rows = model.get_input_embeddings().num_embeddings
    if len(tokenizer) > rows:
        raise ModelLoadError(
            f"{ref}: its tokenizer has {len(tokenizer)} tokens but the model embeds only {rows}"
        )
    check_cancelled(cancel)
    offloaded = any(str(d) in ("cpu", "disk") for d in (getattr(model, "hf_device_map", None) or {}).values())
    fidelity = fidelity_label(path, config, precision)
    if requant_probe.applies(device, precision, fidelity) and as_stored and not offloaded:
        fidelity = requant_probe.labelled(
            fidelity, hf_blocks.cache_key(path, precision, progress=progress, cancel=cancel), precision, model,
            tokenizer, reference=lambda: _reference(path, ref, trust_remote_code),
            parameters=parameters, progress=progress,
        )  # fmt: skip
    return LoadedModel(ref=ref, path=path, model=model, tokenizer=tokenizer, device=device,
                       precision=precision, offloaded=offloaded and device == "cuda",
                       fidelity=fidelity)  # fmt: skip


def _reference(path: Path, ref: str, trust_remote_code: bool) -> Any:
    """The folder's weights in fp32 with plain forwards: what a re-quantization is measured against."""
    return _load_weights(path, ref, "cpu", "fp32", offload=False, trust_remote_code=trust_remote_code)


def _blocks_mix(path: Path, config: Any, ref: str, device: str, precision: str, as_stored: bool) -> str | None:
    """The llama.cpp mix a folder load runs as blocks (hf_blocks.py), or None for today's path.

    Asked for (`q4_k_m`, `q8_0`), it is that mix or one line saying why not. `auto` takes
    Q4_K_M for a target where every type of its recipe runs at about int4's pace
    (hf_blocks.runs_fast); a folder converted from a GGUF is left to its own path.
    """
    if precision in hf_blocks.MIXES:
        if device != "cpu":
            raise ModelLoadError(f"{precision} is a CPU precision (llama.cpp's blocks); on a GPU use bf16 or nf4")
        reason = "it was converted from a GGUF, which runs as stored" if gguf_convert.is_converted(path) else None
        reason = reason or hf_blocks.refusal(path, config)
        if reason is not None:
            raise ModelLoadError(f"{ref}: {precision} quantizes an HF folder into llama.cpp's blocks, and {reason}")
        return precision
    if precision != "auto" or device != "cpu" or not as_stored or gguf_convert.is_converted(path):
        return None
    if hf_blocks.refusal(path, config) is not None:
        return None
    try:
        planned = hf_blocks.plan(config, hf_blocks.shapes_of(path), "q4_k_m")
    except ValueError:
        return None
    return "q4_k_m" if hf_blocks.runs_fast(planned) else None


def _load_folder_as_blocks(
    ref: str, path: Path, config: Any, mix: str, trust_remote_code: bool, *,
    progress: ProgressCallback | None, cancel: threading.Event | None,
) -> LoadedModel:  # fmt: skip
    """A folder's weights as llama.cpp blocks: the cached GGUF (written and measured once), run as stored."""
    label = Path(ref).name or ref
    try:
        made = hf_blocks.cached_blocks(path, config, mix, label=label, progress=progress, cancel=cancel)
    except ValueError as exc:  # a tensor the GGUF layout has no name for
        raise ModelLoadError(f"{ref}: {exc}") from None
    check_cancelled(cancel)
    if progress:
        progress(Progress(f"Loading {label} (cpu · {mix})", 0, 0))
    tokenizer = load_tokenizer(path, ref, trust_remote_code)
    file = read_gguf(made.gguf)
    try:
        model = gguf_native.build_model(file, config, rope_from_file=False)  # the folder's config rotates
        prepare_as_stored(model)  # repacked weights in 2 MB pages; attention row-wise
    except (torch.OutOfMemoryError, MemoryError) as exc:
        raise OutOfMemory(f"out of memory loading {ref} at {mix} on cpu; {_oom_hint('cpu', 'int4')}") from exc
    return LoadedModel(ref=ref, path=path, model=model, tokenizer=tokenizer, device="cpu", precision=mix,
                       fidelity=made.probe.label() + gguf_native.kernel_notes(model))  # fmt: skip


# The CPU precisions made from a GGUF's blocks in memory (gguf_native), with no converted copy.
FROM_BLOCKS = (AS_STORED, "auto", "fp32", "bf16", "fp16", "int8", "int4")


def gguf_for_cpu(
    ref: str, device: str, precision: str, *,
    progress: ProgressCallback | None = None, cancel: threading.Event | None = None,
) -> GGUFFile | None:  # fmt: skip
    """The GGUF whose blocks a CPU load reads directly, or None for the converted folder.

    Asked for as stored (`gguf`), it is that file or one line saying why not. Otherwise a
    GGUF of a family `gguf_native` maps is read from its blocks too, de-quantized in
    memory; a catalog GGUF whose file was cleared but whose conversion is kept loads
    from the conversion rather than downloading again.
    """
    asked = precision == AS_STORED
    if precision in hf_blocks.MIXES and gguf_file_of(ref, fetch=False) is not None:
        raise ModelLoadError(f"{ref} is a GGUF file: it runs its own blocks as stored (--precision gguf); "
                             f"{precision} quantizes an HF folder")  # fmt: skip
    if device != "cpu" or precision not in FROM_BLOCKS:
        if asked:
            raise ModelLoadError("gguf (the file's blocks as stored) runs on the CPU; on a GPU use bf16 or nf4")
        return None
    path = gguf_file_of(ref, fetch=True if asked else None, progress=progress, cancel=cancel)
    if path is None:
        if asked:
            raise ModelLoadError(f"{ref} is not a GGUF file: --precision gguf runs a GGUF's blocks as stored")
        return None
    file = read_gguf(path)
    reason = gguf_native.refusal(file)
    if reason is not None and asked:
        raise ModelLoadError(f"{path.name}: {reason}")
    return None if reason is not None else file


def _load_from_file(
    ref: str, file: GGUFFile, precision: str, trust_remote_code: bool, *,
    progress: ProgressCallback | None, cancel: threading.Event | None, probe: bool = True,
) -> LoadedModel:  # fmt: skip
    """A GGUF on the CPU from its mapped blocks: as stored, or de-quantized in memory for
    another precision (the values a conversion to fp32 would hold, with no copy on disk).
    `probe`: a re-quantization's label carries its measured KL (requant_probe.py)."""
    meta = metadata_folder(file.path, label=Path(ref).name or ref, progress=progress, cancel=cancel)
    # The header's own config, as llama.cpp reads it, even where the folder holds a full
    # conversion's (transformers' reading of the same file, which may differ).
    config = config_from_header(file) or load_config(meta, ref, trust_remote_code)
    stored = precision == AS_STORED
    if not stored:
        precision = resolve_precision(precision, "cpu", 0)
    check_cancelled(cancel)
    if progress:
        progress(Progress(f"Loading {Path(ref).name or ref} (cpu · {precision})", 0, 0))
    tokenizer = load_tokenizer(meta, ref, trust_remote_code)
    try:
        model = gguf_native.build_model(file, config, as_stored=stored)
        if stored:
            prepare_as_stored(model)
        else:
            model.to(_DTYPES.get(precision, torch.float32))
            prepare_for_cpu(model, precision)
    except (torch.OutOfMemoryError, MemoryError) as exc:
        raise OutOfMemory(f"out of memory loading {ref} at {precision} on cpu; {_oom_hint('cpu', precision)}") from exc
    check_cancelled(cancel)
    fidelity = gguf_native.fidelity(file, model) if stored else fidelity_label(meta, config, precision)
    sha256 = (gguf_convert.read_marker(meta) or {}).get("sha256") if probe else None
    if precision in requant_probe.MEASURED and isinstance(sha256, str):
        fidelity = requant_probe.labelled(
            fidelity, sha256, precision, model, tokenizer,
            reference=lambda: gguf_native.build_model(file, config, as_stored=False),
            parameters=sum(math.prod(info.dims) for info in file.tensors.values()), progress=progress,
        )  # fmt: skip
    return LoadedModel(ref=ref, path=meta, model=model, tokenizer=tokenizer, device="cpu",
                       precision=precision, fidelity=fidelity)  # fmt: skip


def fidelity_label(path: Path, config: Any, precision: str) -> str:
    """How the weights a load computes with relate to its source's (a GGUF's blocks, a folder's dtype)."""
    gguf = _gguf_source_type(path)
    source = gguf or hf_blocks.source_dtype(config)
    if gguf is None and precision == source:
        return f"as stored ({source})"
    if precision == "fp32":
        return f"as stored ({source}), in fp32"  # de-quantizing blocks or widening halves is exact
    return f"re-quantized: {precision} from {source}"


def _gguf_source_type(folder: Path) -> str | None:
    """The quantization of the GGUF a converted folder came from ("Q4_K_M"), else None."""
    marker = gguf_convert.read_marker(folder)
    if marker is None:
        return None
    source = Path(str(marker.get("source", "")))
    try:
        return read_gguf(source).file_type or "GGUF" if source.is_file() else "GGUF"
    except ModelLoadError:
        return "GGUF"


def tokenizer_folder(
    ref: str, *, progress: ProgressCallback | None = None, cancel: threading.Event | None = None
) -> Path:
    """A folder with `ref`'s config and tokenizer files, without converting a GGUF's weights."""
    path = gguf_file_of(ref, fetch=None, progress=progress, cancel=cancel)
    if path is not None:
        return metadata_folder(path, label=Path(ref).name or ref, progress=progress, cancel=cancel)
    return resolve_path(ref, progress=progress, cancel=cancel)


def resolve_path(
    ref: str, *, progress: ProgressCallback | None = None, cancel: threading.Event | None = None
) -> Path:
    """`refs.resolve_model_ref`, with a malformed reference as a one-line error."""
    from huggingface_hub.errors import HFValidationError

    try:
        return resolve_model_ref(ref, progress=progress, cancel=cancel)
    except HFValidationError as exc:
        raise ModelLoadError(
            f"{ref!r} is not a model folder, .gguf file, catalog name or hub id owner/name "
            f"({_first_line(exc)})"
        ) from exc


def load_config(path: Path, ref: str, trust_remote_code: bool) -> Any:
    """The model's config, refusing custom code it was not allowed to run and non-causal models."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    try:
        raw = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{ref}: cannot read config.json ({_first_line(exc)})") from exc
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{ref}: config.json is not a JSON object")
    model_type = raw.get("model_type")
    if model_type not in CONFIG_MAPPING and not trust_remote_code:
        if raw.get("auto_map"):
            raise ModelLoadError(
                f"{ref} needs its own Python code to run (model type {model_type!r}, auto_map); "
                f"specdec does not run a model's code by default: {TRUST_REMOTE_CODE_HINT}"
            )
        raise ModelLoadError(
            f"{ref}: unknown model type {model_type!r} (this transformers does not know it; "
            "a newer transformers may)"
        )
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ModelLoadError(f"{ref}: cannot read its config ({_first_line(exc)})") from exc
    check_causal_lm(config, ref)
    return config


def check_causal_lm(config: Any, ref: str) -> None:
    """Refuse a checkpoint whose declared architecture is not a causal LM (e.g. BertModel).

    transformers would load a BertModel folder as BertLMHeadModel with a freshly
    initialised head and generate noise; the config's `architectures` says what the
    weights were trained as.
    """
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    architectures = list(getattr(config, "architectures", None) or [])
    causal = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    if architectures and not any(
        a in causal or a.endswith(("ForCausalLM", "LMHeadModel")) for a in architectures
    ):
        raise ModelLoadError(
            f"{ref} is not a causal language model ({', '.join(architectures)}): it cannot generate text"
        )
    unknown = config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    if not architectures and unknown and not getattr(config, "auto_map", None):
        raise ModelLoadError(f"{ref} is not a causal language model ({config.model_type})")


def load_tokenizer(path: Path, ref: str, trust_remote_code: bool = False) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ModelLoadError(f"{ref}: cannot load its tokenizer ({_first_line(exc)})") from exc


def _load_weights(
    path: Path, ref: str, device: str, precision: str, *, offload: bool, trust_remote_code: bool
) -> Any:
    from transformers import AutoModelForCausalLM

    kwargs = placement(device, precision, offload)
    kwargs["trust_remote_code"] = trust_remote_code
    try:
        # With output_loading_info, from_pretrained returns (model, loading info).
        loaded: Any = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True, **kwargs)
        model, info = loaded
    except (torch.OutOfMemoryError, MemoryError) as exc:
        raise OutOfMemory(
            f"out of memory loading {ref} at {precision} on {device}; {_oom_hint(device, precision)}"
        ) from exc
    except Exception as exc:
        mapped = _weights_error(exc, ref)
        if mapped is None:  # not a failure we know: a bug to report, with its traceback
            raise
        raise mapped from exc
    _check_loading_info(info, ref)
    if device == "cpu":
        prepare_for_cpu(model, precision)
    else:
        # cuBLAS and SDPA pick kernels by row count: without this, a verify and plain
        # steps differ and speculation changes the text (docs/engine.md#where-near-ties-may-differ).
        make_batch_invariant(model)
    return model.eval()


def _oom_hint(device: str, precision: str) -> str:
    smaller = {"fp32": ["bf16", "int8"], "bf16": ["int8"], "fp16": ["int8"], "int8": ["int4"]}.get(
        precision, []
    )
    if device == "cuda":
        smaller = {"bf16": ["nf4"], "fp16": ["nf4"], "fp32": ["bf16", "nf4"], "int8": ["nf4"]}.get(
            precision, []
        )
    tries = [f"--precision {p}" for p in smaller] + (["--offload"] if device == "cuda" else [])
    tries.append("a smaller model")
    return "try " + ", ".join(tries[:-1]) + (" or " if len(tries) > 1 else "") + tries[-1]


def placement(device: str, precision: str, offload: bool) -> dict[str, Any]:
    """from_pretrained's dtype / quantization / device_map for a device and precision."""
    # transformers otherwise swaps layers (rotary, norms) for kernels fetched from the hub:
    # a load that needs the network, and numbers that are no longer the ones the
    # batch-invariant hooks and the self-check were built for.
    kwargs: dict[str, Any] = {"use_kernels": False}
    gpu_map: Any = "auto" if offload else {"": 0}
    if precision in ("int8", "nf4") and (device == "cuda" or precision == "nf4"):
        kwargs["quantization_config"] = _bitsandbytes_config(precision, offload)
        kwargs["device_map"] = gpu_map if device == "cuda" else {"": "cpu"}
    elif precision in ("int8", "int4"):  # our CPU paths: load in fp32, quantize the linears
        kwargs["dtype"] = torch.float32
    else:
        kwargs["dtype"] = _DTYPES[precision]
        if device == "cuda":
            kwargs["device_map"] = gpu_map
    return kwargs


def _weights_error(exc: Exception, ref: str) -> ModelLoadError | None:
    """The one line for a failure inside from_pretrained."""
    from safetensors import SafetensorError

    text = _first_line(exc)
    if isinstance(exc, ValueError) and "Unrecognized configuration class" in text:
        return ModelLoadError(f"{ref} is not a causal language model ({text})")
    if isinstance(exc, SafetensorError | struct.error | EOFError):
        return ModelLoadError(
            f"{ref}: the weights file is damaged or incomplete ({text}); fetch or copy it again"
        )
    if "mmap" in text:
        return ModelLoadError(
            f"{ref}: cannot map the weights into memory ({text}); free memory or raise the "
            "address-space limit (ulimit -v)"
        )
    if isinstance(exc, OSError):
        return ModelLoadError(f"{ref}: cannot read the weights ({text})")
    if isinstance(exc, ValueError | KeyError | RuntimeError):  # shapes, dtypes, config fields
        return ModelLoadError(f"{ref}: cannot load the weights ({type(exc).__name__}: {text})")
    return None


def _check_loading_info(info: dict[str, Any], ref: str) -> None:
    """Missing or left-over weights mean the checkpoint is not the model it claims to be."""
    problems = []
    for kind in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        keys = sorted(str(k[0] if isinstance(k, tuple) else k) for k in info.get(kind) or ())
        if keys:
            shown = ", ".join(keys[:4]) + (f" and {len(keys) - 4} more" if len(keys) > 4 else "")
            problems.append(f"{kind.replace('_keys', '')} weights: {shown}")
    if problems:
        raise ModelLoadError(f"{ref}: the checkpoint does not match its architecture ({'; '.join(problems)})")


def _bitsandbytes_config(precision: str, offload: bool = False) -> Any:
    if importlib.util.find_spec("bitsandbytes") is None:
        raise ModelLoadError(f"precision {precision} needs bitsandbytes: pip install bitsandbytes")
    from transformers import BitsAndBytesConfig

    if precision == "nf4":
        compute = (
            torch.bfloat16 if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else torch.float32
        )
        return BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_compute_dtype=compute,
            bnb_4bit_use_double_quant=True,
            llm_int8_enable_fp32_cpu_offload=offload,
        )
    return BitsAndBytesConfig(load_in_8bit=True, llm_int8_enable_fp32_cpu_offload=offload)


def checkpoint_parameters(path: Path, config: Any = None) -> int:
    """Parameters in the checkpoint: counted from safetensors headers (no tensor is read),
    else estimated from .bin sizes at the config's dtype (2 bytes when it does not say)."""
    total = 0
    for file in sorted(path.glob("*.safetensors")):
        total += _safetensors_parameters(file)
    if total:
        return total
    size = sum(f.stat().st_size for f in path.glob("*.bin"))
    dtype = str(getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or "")
    return int(size / (4 if "float32" in dtype else 2))


def _safetensors_parameters(file: Path) -> int:
    try:
        with file.open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > 100 * 2**20:
                raise ValueError(f"header length {length}")
            header = json.loads(f.read(length))
        return sum(_numel(t["shape"]) for name, t in header.items() if name != "__metadata__")
    except (OSError, struct.error, ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
        raise ModelLoadError(
            f"{file}: the weights file is damaged or incomplete (unreadable header: {_first_line(exc)}); "
            "fetch or copy it again"
        ) from exc


def _numel(shape: list[int]) -> int:
    n = 1
    for dim in shape:
        n *= int(dim)
    return n


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
