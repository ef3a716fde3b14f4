"""A GGUF file de-quantized by transformers into a plain fp32 HF folder (config,
safetensors, tokenizer, a generation config of token ids only).

Run in a child process of its own (conversion_process.py) or, in a frozen bundle, in
this one; gguf_convert.py decides which and keeps the result in the disk cache.

For the families run as stored, the config is instead the header's, read as llama.cpp's
loader reads it (`config_from_header`), with no pass over the file's arrays.
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


# llama.cpp's metadata keys (after "<arch>.") that every family's loader needs, and the config
# fields transformers makes of them (the renames of transformers' own GGUF reader, which reads
# every array of the header, a vocabulary's hundreds of thousands of strings included).
_REQUIRED_KEYS = {
    "context_length": "max_position_embeddings",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "embedding_length": "hidden_size",
    "attention.head_count": "num_attention_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
}
_TOKEN_KEYS = {
    "bos_token_id": "bos_token_id",
    "eos_token_id": "eos_token_id",
    "padding_token_id": "pad_token_id",
}
# The GGUF architectures read here (gguf_native.ARCHITECTURES), and transformers' model type
# for each. llama.cpp stores a Mistral as `llama` and runs it as one, with no sliding window.
MODEL_TYPES = {
    "llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
    "gemma2": "gemma2", "gemma3": "gemma3_text", "phi3": "phi3",
}  # fmt: skip
# Where llama.cpp's loader takes the attention scale from the width (its Gemma 27Bs'
# 1/sqrt(n_embd/n_head)) rather than the head size: by the layer count it names them by.
_WIDTH_SCALED = {"gemma2": 46, "gemma3": 62}


def config_from_header(file: GGUFFile) -> Any | None:
    """The transformers config of a GGUF of one of `MODEL_TYPES`, from its header alone, as
    llama.cpp's loader for the family reads that header (src/models/<arch>.cpp); None for any
    other family, left to transformers. One line naming a key the family needs and lacks."""
    from transformers import AutoConfig

    arch = file.architecture
    if arch not in MODEL_TYPES:
        return None
    values = _common_values(file)
    values.update(_FAMILY_VALUES[arch](file, values))
    return AutoConfig.for_model(MODEL_TYPES[arch], **values)


def _key(file: GGUFFile, short: str, default: Any = ...) -> Any:
    """The header's `<arch>.<short>`: `default` where absent, one line where none is given."""
    name = f"{file.architecture}.{short}"
    if name in file.fields:
        return file.fields[name]
    if name in file.array_lengths:
        raise ModelLoadError(f"{file.path.name}: {name} varies by layer, which is not supported")
    if default is ...:
        raise ModelLoadError(f"{file.path.name}: the header lacks {name}, which {file.architecture} models need")
    return default


def _common_values(file: GGUFFile) -> dict[str, Any]:
    values = {field: _key(file, key) for key, field in _REQUIRED_KEYS.items()}
    heads, width = int(values["num_attention_heads"]), int(values["hidden_size"])
    values["num_key_value_heads"] = _key(file, "attention.head_count_kv", heads)
    values["head_dim"] = int(_key(file, "attention.key_length", width // heads))
    if int(_key(file, "attention.value_length", values["head_dim"])) != values["head_dim"]:
        raise ModelLoadError(f"{file.path.name}: keys and values of different sizes are not supported")
    values["rope_theta"] = float(_key(file, "rope.freq_base", 10000.0))
    values["vocab_size"] = _key(file, "vocab_size", file.array_lengths.get("tokenizer.ggml.tokens"))
    for key, field in _TOKEN_KEYS.items():  # none where the header names none, not a family's default
        values[field] = file.fields.get(f"tokenizer.ggml.{key}")
    name = file.fields.get("general.name")
    if name is not None:
        values["_model_name_or_path"] = name
    values["tie_word_embeddings"] = "output.weight" not in file.tensors
    return values


def _rotary_dims(file: GGUFFile, head_dim: int, *, partial: bool = False) -> int:
    dims = int(_key(file, "rope.dimension_count", head_dim))
    if dims != head_dim and not partial:
        raise ModelLoadError(f"{file.path.name}: rotary embedding over {dims} of {head_dim} head dimensions is not supported")
    return dims


def _biases(file: GGUFFile, short: str) -> bool:
    return f"blk.0.{short}.bias" in file.tensors


def _llama(file: GGUFFile, values: dict[str, Any]) -> dict[str, Any]:
    _rotary_dims(file, values["head_dim"])  # llama.cpp refuses a Llama whose rotation is partial
    return {"attention_bias": _biases(file, "attn_q"), "mlp_bias": _biases(file, "ffn_gate")}


def _qwen2(file: GGUFFile, values: dict[str, Any]) -> dict[str, Any]:
    _rotary_dims(file, values["head_dim"])  # no window: llama.cpp's Qwen2 has none
    if values["head_dim"] == values["hidden_size"] // values["num_attention_heads"]:
        del values["head_dim"]  # Qwen2's config derives it, and names no such field
    return {}


def _qwen3(file: GGUFFile, values: dict[str, Any]) -> dict[str, Any]:
    _rotary_dims(file, values["head_dim"])
    return {"attention_bias": _biases(file, "attn_q")}


def _phi3(file: GGUFFile, values: dict[str, Any]) -> dict[str, Any]:
    """A Phi-3 rotates the first `rope.dimension_count` of each head; llama.cpp runs it with
    no sliding window whatever the header says (its loader turns Phi's window off)."""
    dims = _rotary_dims(file, values["head_dim"], partial=True)
    return {"sliding_window": None, "partial_rotary_factor": dims / values["head_dim"]}


def _gemma(file: GGUFFile, values: dict[str, Any]) -> dict[str, Any]:
    """What Gemma 2 and 3 share: the attention scale by llama.cpp's rule."""
    _rotary_dims(file, values["head_dim"])
    layers, wide = int(values["num_hidden_layers"]), values["hidden_size"] // values["num_attention_heads"]
    return {"query_pre_attn_scalar": wide if layers == _WIDTH_SCALED[file.architecture] else values["head_dim"]}


def _gemma2(file: GGUFFile, values: dict[str, Any]) -> dict[str, Any]:
    """llama.cpp's Gemma 2: every other layer slides (4096 unless the header says), logits
    soft-capped at 50 in attention and 30 at the head unless it says, the embedding tied."""
    window = int(_key(file, "attention.sliding_window", 4096))
    return {
        **_gemma(file, values),
        "sliding_window": window,
        "layer_types": _layer_types(file, int(values["num_hidden_layers"]), 2),
        "attn_logit_softcapping": float(_key(file, "attn_logit_softcapping", 50.0)),
        "final_logit_softcapping": float(_key(file, "final_logit_softcapping", 30.0)),
        "tie_word_embeddings": True,  # llama.cpp's Gemma 2 reads its head from token_embd
    }


def _gemma3(file: GGUFFile, values: dict[str, Any]) -> dict[str, Any]:
    """llama.cpp's Gemma 3: with a window in the header, five of every six layers slide
    (unless it names a pattern) and rotate with base 10000 (unless it names one); without,
    every layer is global. No attention soft-cap; a head soft-cap only where the header has one."""
    layers = int(values["num_hidden_layers"])
    window = int(_key(file, "attention.sliding_window", 0))
    types = _layer_types(file, layers, 6) if window > 0 else ["full_attention"] * layers
    local_base = float(_key(file, "rope.freq_base_swa", 10000.0))
    base = values.pop("rope_theta")
    cap = float(_key(file, "final_logit_softcapping", 0.0))
    return {
        **_gemma(file, values),
        "sliding_window": window if window > 0 else None,
        "layer_types": types,
        "rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": base},
            "sliding_attention": {"rope_type": "default", "rope_theta": local_base},
        },
        "attn_logit_softcapping": None,
        "final_logit_softcapping": cap or None,
    }


def _layer_types(file: GGUFFile, layers: int, pattern: int) -> list[str]:
    """llama.cpp's `load_swa_pattern`: the header's per-layer array, or every layer but the last
    of each `pattern` (the header's `attention.sliding_window_pattern` where it has one) slides."""
    key = f"{file.architecture}.attention.sliding_window_pattern"
    if key in file.numbers:
        flags = file.numbers[key]
        if len(flags) != layers:
            raise ModelLoadError(f"{file.path.name}: {key} names {len(flags)} layers of {layers}")
        return ["sliding_attention" if flag else "full_attention" for flag in flags]
    if key in file.array_lengths:
        raise ModelLoadError(f"{file.path.name}: {key} is not an array of flags")
    pattern = int(file.fields.get(key, pattern))
    return [
        "sliding_attention" if pattern == 0 or i % pattern < pattern - 1 else "full_attention" for i in range(layers)
    ]


_FAMILY_VALUES = {
    "llama": _llama, "qwen2": _qwen2, "qwen3": _qwen3, "phi3": _phi3, "gemma2": _gemma2, "gemma3": _gemma3,
}  # fmt: skip


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
