"""Load one model reference onto a device at a precision, with one-line errors.

Precision choices (`auto` picks the fastest that fits and says what it chose):
- CPU: `int8` is our batch-invariant per-token int8 (see quant_cpu; ~4x fp32 here),
  `bf16`, `fp32`; `nf4` goes through bitsandbytes' CPU backend (slow: measured 2.1
  tok/s on a 0.5B vs 14 for our int8), allowed but never picked by `auto`.
- CUDA: `bf16`/`fp16` when the model fits, else `nf4` (bitsandbytes); `int8` is
  bitsandbytes' LLM.int8().
"""

from __future__ import annotations

import importlib.util
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .batch_invariant import make_batch_invariant
from .errors import ModelLoadError
from .progress import Progress, ProgressCallback, check_cancelled
from .quant_cpu import int8_available, quantize_linears_int8
from .refs import resolve_model_ref

DEVICES = ("auto", "cpu", "cuda")
PRECISIONS = ("auto", "fp32", "bf16", "fp16", "int8", "nf4")
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class LoadedModel:
    ref: str
    path: Path
    model: Any  # a transformers PreTrainedModel (causal LM), eval mode
    tokenizer: Any
    device: str
    precision: str

    @property
    def description(self) -> str:
        """What the user sees, e.g. "cpu · int8"."""
        return f"{self.device} · {self.precision}"

    @property
    def vocab_size(self) -> int:
        return int(self.model.config.get_text_config().vocab_size)

    @property
    def name(self) -> str:
        return Path(self.ref).name if Path(self.ref).exists() else self.ref


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


def resolve_precision(precision: str, device: str, weight_bytes: int) -> str:
    """`auto`: the fastest precision that fits in the device's free memory."""
    if precision not in PRECISIONS:
        raise ModelLoadError(f"unknown precision {precision!r}: use one of {', '.join(PRECISIONS)}")
    if precision != "auto":
        return precision
    if device == "cpu":
        return "int8" if int8_available() else "bf16"
    free, _ = torch.cuda.mem_get_info()
    # bf16 holds 2 bytes a weight; keep a quarter of the memory for the KV cache and activations.
    if _bf16_bytes(weight_bytes) < 0.75 * free:
        return "bf16"
    return "nf4"


def load_model(
    ref: str,
    *,
    device: str = "auto",
    precision: str = "auto",
    progress: ProgressCallback | None = None,
    cancel: threading.Event | None = None,
) -> LoadedModel:
    device = resolve_device(device)
    path = resolve_model_ref(ref, progress=progress, cancel=cancel)
    precision = resolve_precision(precision, device, _weights_bytes(path))
    check_cancelled(cancel)
    if progress:
        progress(Progress(f"Loading {Path(ref).name or ref} ({device} · {precision})", 0, 0))
    tokenizer = _load_tokenizer(path, ref)
    model = _load_weights(path, ref, device, precision)
    rows = model.get_input_embeddings().num_embeddings
    if len(tokenizer) > rows:
        raise ModelLoadError(
            f"{ref}: its tokenizer has {len(tokenizer)} tokens but the model embeds only {rows}"
        )
    check_cancelled(cancel)
    return LoadedModel(
        ref=ref, path=path, model=model, tokenizer=tokenizer, device=device, precision=precision
    )


def _load_tokenizer(path: Path, ref: str) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{ref}: cannot load its tokenizer ({_first_line(exc)})") from exc


def _load_weights(path: Path, ref: str, device: str, precision: str) -> Any:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    kwargs: dict[str, Any] = {}
    if precision in ("int8", "nf4") and (device == "cuda" or precision == "nf4"):
        kwargs["quantization_config"] = _bitsandbytes_config(precision)
        kwargs["device_map"] = {"": 0} if device == "cuda" else {"": "cpu"}
    elif precision == "int8":  # our CPU path: load in fp32, quantize the linears
        kwargs["dtype"] = torch.float32
    else:
        kwargs["dtype"] = _DTYPES[precision]
        if device == "cuda":
            kwargs["device_map"] = {"": 0}
    try:
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    except ValueError as exc:
        if "Unrecognized configuration class" in str(exc):
            arch = ", ".join(getattr(config, "architectures", None) or [config.model_type])
            raise ModelLoadError(f"{ref} is not a causal language model ({arch})") from exc
        raise ModelLoadError(f"{ref}: {_first_line(exc)}") from exc
    except (torch.OutOfMemoryError, MemoryError) as exc:
        raise ModelLoadError(
            f"out of memory loading {ref} at {precision} on {device} "
            f"(weights ~{_weights_bytes(path) / 2**30:.1f} GiB on disk); try a smaller precision"
        ) from exc
    except OSError as exc:
        raise ModelLoadError(f"{ref}: cannot read the weights ({_first_line(exc)})") from exc
    if precision == "int8" and device == "cpu":
        quantize_linears_int8(model)
        # With row-wise attention too, verify and plain decoding give bitwise-equal logits.
        make_batch_invariant(model)
    return model.eval()


def _bitsandbytes_config(precision: str) -> Any:
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
        )
    return BitsAndBytesConfig(load_in_8bit=True)


def _weights_bytes(path: Path) -> int:
    return sum(f.stat().st_size for pattern in ("*.safetensors", "*.bin") for f in path.glob(pattern))


def _bf16_bytes(weight_bytes: int) -> float:
    return weight_bytes / 2  # checkpoints here are fp32 (converted GGUF) or bf16; assume the larger


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
