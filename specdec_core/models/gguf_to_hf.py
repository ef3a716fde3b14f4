"""A GGUF file de-quantized by transformers into a plain fp32 HF folder (config,
safetensors, tokenizer, a generation config of token ids only).

Run in a child process of its own (conversion_process.py) or, in a frozen bundle, in
this one; gguf_convert.py decides which and keeps the result in the disk cache.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import ModelLoadError
from .chat import stop_tokens
from .gguf_file import GGUFFile, read_gguf


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
        config = config_from_header(read_gguf(gguf_path))
        if config is None:
            config = AutoConfig.from_pretrained(folder, gguf_file=name, trust_remote_code=False)
        tokenizer = AutoTokenizer.from_pretrained(
            folder, gguf_file=name, trust_remote_code=False, **_tokenizer_type(config)
        )
    except (ValueError, KeyError, OSError) as error:
        raise ModelLoadError(f"cannot read {gguf_path.name}: {str(error).splitlines()[0]}") from None
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    _plain_generation_config(tokenizer).save_pretrained(out_dir)


# llama.cpp's metadata keys (after "<arch>.") and the config fields transformers makes of
# them, for the families run as stored (gguf_native.ARCHITECTURES). They are the renames of
# transformers' own GGUF reader, which reads every array of the header (the vocabulary:
# hundreds of thousands of strings) to build a config; tests compare the two configs.
_CONFIG_KEYS = {
    "context_length": "max_position_embeddings",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "embedding_length": "hidden_size",
    "rope.freq_base": "rope_theta",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "vocab_size": "vocab_size",
}
_TOKEN_KEYS = {
    "bos_token_id": "bos_token_id",
    "eos_token_id": "eos_token_id",
    "padding_token_id": "pad_token_id",
}


def config_from_header(file: GGUFFile) -> Any | None:
    """The transformers config of a Qwen2 or Llama GGUF, from its header alone; None for any
    other family (or a Llama that transformers reads as a Mistral), left to transformers."""
    from transformers import AutoConfig

    arch = file.architecture
    name = file.fields.get("general.name")
    if arch not in ("qwen2", "llama") or name == "mistral":
        return None
    keys = dict(_CONFIG_KEYS)
    if arch == "llama":  # a Qwen2's head size follows from its width and head count
        keys["rope.dimension_count"] = "head_dim"
    values = {
        field: file.fields[f"{arch}.{key}"] for key, field in keys.items() if f"{arch}.{key}" in file.fields
    }
    for key, field in _TOKEN_KEYS.items():
        if f"tokenizer.ggml.{key}" in file.fields:
            values[field] = file.fields[f"tokenizer.ggml.{key}"]
    if "vocab_size" not in values:
        values["vocab_size"] = file.array_lengths.get("tokenizer.ggml.tokens")
    if name is not None:
        values["_model_name_or_path"] = name
    tied = "output.weight" not in file.tensors
    return AutoConfig.for_model(arch, tie_word_embeddings=tied, **values)


# llama.cpp's llama_vocab::load: the vocabularies that add a BOS where the header does not say
# (tokenizer.ggml.add_bos_token): SPM and WPM ones, and BPE ones of these pre-tokenizers.
_BOS_MODELS = frozenset({"llama", "bert"})
_BOS_PRE = frozenset({
    "llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
    "jina-v5-nano", "tekken", "chameleon",
})  # fmt: skip
# ... and those that add one whatever the header says (llama.cpp overrides it).
_ALWAYS_BOS_PRE = frozenset({"gemma4", "granite-embed-multi-311m"})


def llama_adds_bos(file: GGUFFile) -> bool:
    """Whether llama.cpp puts a BOS before a text it tokenizes with this file's vocabulary
    (llama_vocab_get_add_bos): the header's add_bos_token, else the vocabulary's default."""
    model = file.fields.get("tokenizer.ggml.model")
    pre = "gemma4" if model == "gemma4" else file.fields.get("tokenizer.ggml.pre")
    if pre in _ALWAYS_BOS_PRE:
        return True
    stated = file.fields.get("tokenizer.ggml.add_bos_token")
    if isinstance(stated, bool):
        return stated
    return model in _BOS_MODELS or (model == "gpt2" and pre in _BOS_PRE)


def _tokenizer_type(config: Any) -> dict[str, str]:
    """Where transformers registers a tokenizer for the family, naming it keeps AutoTokenizer
    from reading the whole file once more for a config it has already."""
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES

    return {"tokenizer_type": config.model_type} if config.model_type in TOKENIZER_MAPPING_NAMES else {}


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
