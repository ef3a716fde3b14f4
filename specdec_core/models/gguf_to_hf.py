"""A GGUF file de-quantized by transformers into a plain fp32 HF folder (config,
safetensors, tokenizer, a generation config of token ids only).

Run in a child process of its own (conversion_process.py) or, in a frozen bundle, in
this one; gguf_convert.py decides which and keeps the result in the disk cache.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from ..errors import ModelLoadError
from .chat import stop_tokens


def convert_with_transformers(
    gguf_path: Path, out_dir: Path, on_saving: Callable[[], None] | None = None
) -> None:
    """De-quantize `gguf_path` with transformers and save it as an fp32 HF folder.

    fp32 because de-quantized values are `scale * q - min` products whose mantissas do
    not fit bf16/fp16 (see docs/models.md for the check); the engine's exactness is
    defined against these weights, so they are kept bit for bit.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    folder, name = str(gguf_path.parent), gguf_path.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, trust_remote_code=False)
        model = AutoModelForCausalLM.from_pretrained(
            folder,
            gguf_file=name,
            trust_remote_code=False,
            dtype=torch.float32,
            # Unpacked into plain tensors even where a GGUF kernel is installed.
            quantization_config=GgufConfig(dequantize=True),
            use_kernels=False,  # the converted weights are saved as plain tensors; no hub kernels
        )
    except (ValueError, KeyError, OSError) as error:
        raise ModelLoadError(f"cannot convert {gguf_path.name}: {str(error).splitlines()[0]}") from None
    _drop_gguf_quantizer(model)
    model.generation_config = _plain_generation_config(tokenizer)
    if on_saving is not None:
        on_saving()
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def write_metadata(gguf_path: Path, out_dir: Path) -> None:
    """Save `gguf_path`'s config, tokenizer and generation config, without its weights: what
    running the file's blocks as stored needs besides the file itself (gguf_native.py)."""
    from transformers import AutoConfig, AutoTokenizer

    folder, name = str(gguf_path.parent), gguf_path.name
    try:
        config = AutoConfig.from_pretrained(folder, gguf_file=name, trust_remote_code=False)
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, trust_remote_code=False)
    except (ValueError, KeyError, OSError) as error:
        raise ModelLoadError(f"cannot read {gguf_path.name}: {str(error).splitlines()[0]}") from None
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    _plain_generation_config(tokenizer).save_pretrained(out_dir)


def _drop_gguf_quantizer(model) -> None:
    """Remove the "quantized with GGUF" marking, which makes save_pretrained refuse.

    The weights are plain fp32 tensors by now (dequantize=True); only the marking is
    left, and saving it into config.json would make later loads look for a GGUF file.
    """
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config


def _plain_generation_config(tokenizer):
    """A generation config with token ids only.

    Sampling defaults (temperature, repetition_penalty, …) would make
    `generate(do_sample=False)` differ from plain greedy decoding, which is what the
    engine is checked against; the stop tokens are the EOS plus the chat template's
    end-of-turn tokens.
    """
    from transformers import GenerationConfig

    vocab = tokenizer.get_vocab()
    eos_ids = [vocab[token] for token in stop_tokens(tokenizer, vocab)]
    pad_id = (
        tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos_ids[0] if eos_ids else None)
    )
    return GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=eos_ids or None, pad_token_id=pad_id
    )
