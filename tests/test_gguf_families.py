"""Every GGUF family the app offers, run as stored, computes what its source model computes.

Each tiny model of tests/archs.py is written here into a GGUF the way llama.cpp's
convert_hf_to_gguf.py writes it (its tensor names, a Llama's q/k rows permuted into
llama.cpp's rotary order, a Gemma's norm weights with the 1 added, the header keys and rope
tensors its loader reads), and the model built from the file as stored must give the
source's logits. Where transformers and llama.cpp read a file differently the source model
here is configured as llama.cpp reads the file (Gemma 3's window pattern, Phi-3's window).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from test_gguf_convert import add_tiny_tokenizer

from specdec_core.errors import ModelLoadError
from specdec_core.models import gguf_native
from specdec_core.models.gguf_file import read_gguf
from specdec_core.models.gguf_to_hf import config_from_header

WINDOW = 16
_SHAPE: dict[str, Any] = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=512, initializer_range=0.2, pad_token_id=0, bos_token_id=None, eos_token_id=None,
    rms_norm_eps=1e-6,
)  # fmt: skip
_GEMMA: dict[str, Any] = dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=WINDOW)
LLAMA3_ROPE = {
    "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
    "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
}  # fmt: skip
SHORT, LONG = [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.1, 4.0], [1.0, 1.5, 2.5, 4.0, 6.0, 9.0, 13.0, 18.0]


YARN_ROPE = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32}
# The global layers' rotation scaled (as Gemma 3 4B's), the local ones at base 10000.
GEMMA3_ROPE = {
    "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
}
LONGROPE = {
    "rope_type": "longrope", "rope_theta": 10000.0, "short_factor": SHORT, "long_factor": LONG,
    "original_max_position_embeddings": 64,
}  # fmt: skip
FAMILY_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("Llama", {}),
    "llama3": ("Llama", {"rope_parameters": LLAMA3_ROPE}),
    "qwen2": ("Qwen2", {}),
    "qwen2-yarn": ("Qwen2", {"rope_parameters": YARN_ROPE}),
    "qwen3": ("Qwen3", {"head_dim": 16}),
    "gemma2": ("Gemma2", dict(_GEMMA, attn_logit_softcapping=20.0, final_logit_softcapping=30.0, tie_word_embeddings=True)),
    "gemma3": ("Gemma3Text", dict(_GEMMA, layer_types=["sliding_attention", "full_attention"], rope_parameters=GEMMA3_ROPE)),
    "phi3": ("Phi3", {"sliding_window": None}),
    "phi3-partial": ("Phi3", {"sliding_window": None, "partial_rotary_factor": 0.5}),  # as Phi-4-mini's 0.75
    "phi3-longrope": ("Phi3", {"sliding_window": None, "original_max_position_embeddings": 64, "rope_parameters": LONGROPE}),
}


def source_model(family: str, vocab: int) -> Any:
    """A tiny model of `family` as llama.cpp would read its GGUF, random weights, seed 0."""
    import transformers

    prefix, family_extra = FAMILY_CONFIGS[family]
    config_cls = getattr(transformers, f"{prefix}Config")
    model_cls = getattr(transformers, f"{prefix.removesuffix('Text')}ForCausalLM")
    config = config_cls(vocab_size=vocab, **{"tie_word_embeddings": False, **_SHAPE, **family_extra})
    torch.manual_seed(0)
    return model_cls(config).float().eval()


# llama.cpp's converter's names: the model's, then each layer's (after "model.layers.N.").
GLOBAL_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
LAYER_NAMES = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.qkv_proj": "attn_qkv",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up", "mlp.gate_up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}  # fmt: skip
GEMMA_LAYER_NAMES = {
    "post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}  # fmt: skip


def gguf_name(arch: str, name: str) -> str:
    stem, _, kind = name.rpartition(".")
    if stem in GLOBAL_NAMES:
        return f"{GLOBAL_NAMES[stem]}.{kind}"
    _, _, index, *rest = stem.split(".")
    part = ".".join(rest)
    names = {**LAYER_NAMES, **(GEMMA_LAYER_NAMES if arch.startswith("gemma") else {"post_attention_layernorm": "ffn_norm"})}
    return f"blk.{index}.{names[part]}.{kind}"


def permute(weights: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: each head's rotary halves interleaved."""
    return weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)


def llama3_rope_freqs(head_dim: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.generate_extra_tensors: llama3 scaling as divisors."""
    p = LLAMA3_ROPE
    freqs = 1.0 / (p["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    low, high = p["original_max_position_embeddings"] / p["low_freq_factor"], p["original_max_position_embeddings"] / p["high_freq_factor"]
    factors = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < high:
            factors.append(1.0)
        elif wavelen > low:
            factors.append(p["factor"])
        else:
            smooth = (p["original_max_position_embeddings"] / wavelen - p["low_freq_factor"]) / (p["high_freq_factor"] - p["low_freq_factor"])
            factors.append(1 / ((1 - smooth) / p["factor"] + smooth))
    return np.array(factors, np.float32)


def write_gguf(path: Path, family: str, model: Any, qtype: str = "F32", *, keys: dict[str, Any] | None = None,
               extra_tensors: dict[str, np.ndarray] | None = None) -> Path:  # fmt: skip
    """`model` as llama.cpp's converter writes it (`qtype`: F32 or Q8_0 for the matrices).
    For Q8_0 the model's own weights are first rounded to the blocks' values, so the file and
    the model hold the same function."""
    arch = {"llama3": "llama"}.get(family, family.split("-")[0])
    config = model.config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    rope = config.rope_parameters.get("full_attention", config.rope_parameters)
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
    tensors = dict(extra_tensors or {})
    if arch == "llama" and rope.get("rope_type") == "llama3":
        tensors["rope_freqs.weight"] = llama3_rope_freqs(head_dim)
    if rope.get("rope_type") in ("linear", "yarn"):
        writer.add_rope_scaling_type(gguf.RopeScalingType(rope["rope_type"]))
        writer.add_rope_scaling_factor(rope["factor"])
    if rope.get("rope_type") == "yarn":
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    if rope.get("rope_type") == "longrope":  # as the converter's Phi3MiniModel writes it
        original = rope["original_max_position_embeddings"]
        writer.add_rope_scaling_orig_ctx_len(original)
        scale = config.max_position_embeddings / original
        writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)
        tensors["rope_factors_long.weight"] = np.array(rope["long_factor"], np.float32)
        tensors["rope_factors_short.weight"] = np.array(rope["short_factor"], np.float32)
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
        writer.add_sliding_window(config.sliding_window)
    if arch == "gemma3":
        writer.add_sliding_window(config.sliding_window)
        writer.add_uint32("gemma3.attention.sliding_window_pattern", 2)  # llama.cpp's default is 6
    for key, value in (keys or {}).items():
        writer.add_string(key, value) if isinstance(value, str) else writer.add_float32(key, value)
    add_tiny_tokenizer(writer)
    state = model.state_dict()
    for name, tensor in state.items():
        if name == "lm_head.weight" and (config.tie_word_embeddings or arch == "gemma2"):
            continue
        values = tensor.detach().float().numpy().copy()
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            values = values + 1  # the converter's Gemma classes: llama.cpp's norm multiplies by w
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config.num_attention_heads if "q_proj" in name else config.num_key_value_heads
            values = permute(values, heads)
        tensors[gguf_name(arch, name)] = values
    for name, values in tensors.items():
        if qtype == "Q8_0" and values.ndim == 2 and values.shape[1] % 32 == 0:
            data = gguf.quants.quantize(values, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(name, np.ascontiguousarray(values, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def round_to_q8_0(model: Any) -> None:
    """Every matrix of whole 32-weight rows replaced by its Q8_0 blocks' values (a row
    reordering, as a Llama's q/k get in the file, gives the same blocks: Q8_0 is per row)."""
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.ndim == 2 and parameter.shape[1] % 32 == 0:
                kind = gguf.GGMLQuantizationType.Q8_0
                blocks = gguf.quants.quantize(parameter.numpy(), kind)
                parameter.copy_(torch.from_numpy(gguf.quants.dequantize(blocks, kind).reshape(parameter.shape)))


def vocab_size() -> int:
    return len(add_tiny_tokenizer(gguf.GGUFWriter("/dev/null", "llama")))


def as_stored(path: Path) -> Any:
    file = read_gguf(path)
    return gguf_native.build_model(file, config_from_header(file))


def logits(model: Any, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0].float()


# Past the 16-token window and the rope scalings' original contexts (32, 64): past where
# transformers' longrope turns to its long factors, which llama.cpp takes at a context as
# long as the file's, the context a model runs here.
IDS = [(7 * i + 3) % 250 + 5 for i in range(80)]
FAMILIES = ["llama", "llama3", "qwen2", "qwen2-yarn", "qwen3", "gemma2", "gemma3", "phi3", "phi3-partial", "phi3-longrope"]


@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
@pytest.mark.parametrize("family", FAMILIES)
def test_as_stored_computes_what_the_source_model_computes(tmp_path, family, qtype):
    source = source_model(family, vocab_size())
    if qtype == "Q8_0":
        round_to_q8_0(source)
    stored = as_stored(write_gguf(tmp_path / f"{family}.gguf", family, source, qtype))
    a, b = logits(stored, IDS), logits(source, IDS)
    assert torch.allclose(a, b, atol=1e-4, rtol=1e-4), (a - b).abs().max()
    assert torch.equal(a.argmax(-1), b.argmax(-1))
    if family == "phi3-longrope":  # the file's attention factor applies
        assert stored.model.rotary_emb.attention_scaling == pytest.approx(math.sqrt(1 + math.log(8) / math.log(64)))


def test_a_llama_3_file_generates_the_source_models_tokens(tmp_path):
    source = source_model("llama3", vocab_size())
    stored = as_stored(write_gguf(tmp_path / "llama3.gguf", "llama3", source))
    prompt = torch.tensor([IDS[:8]])
    expected = source.generate(prompt, max_new_tokens=80, do_sample=False, eos_token_id=None, pad_token_id=0)
    actual = stored.generate(prompt, max_new_tokens=80, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert actual.tolist() == expected.tolist()


def test_the_config_is_the_headers_as_llama_cpp_reads_it(tmp_path):
    gemma3 = config_from_header(read_gguf(write_gguf(tmp_path / "g3.gguf", "gemma3", source_model("gemma3", vocab_size()))))
    assert gemma3.layer_types == ["sliding_attention", "full_attention"] and gemma3.sliding_window == WINDOW
    assert gemma3.attn_logit_softcapping is None and gemma3.final_logit_softcapping is None
    assert gemma3.rope_parameters["sliding_attention"]["rope_theta"] == 10000.0  # llama.cpp's local base
    phi3 = config_from_header(read_gguf(write_gguf(tmp_path / "p.gguf", "phi3", source_model("phi3", vocab_size()))))
    assert phi3.sliding_window is None  # llama.cpp runs Phi-3 without its window
    # llama.cpp stores a Mistral as a Llama and runs it as one: no window.
    mistral = config_from_header(read_gguf(write_gguf(
        tmp_path / "m.gguf", "llama", source_model("llama", vocab_size()), keys={"general.name": "mistral"},
    )))  # fmt: skip
    assert mistral.model_type == "llama" and getattr(mistral, "sliding_window", None) is None


def test_a_header_without_a_key_the_family_needs_is_one_line(tmp_path):
    path = write_gguf(tmp_path / "q.gguf", "qwen3", source_model("qwen3", vocab_size()))
    file = read_gguf(path)
    del file.fields["qwen3.attention.layer_norm_rms_epsilon"]
    with pytest.raises(ModelLoadError, match=r"lacks qwen3\.attention\.layer_norm_rms_epsilon"):
        config_from_header(file)


def test_a_tensor_the_model_has_no_place_for_is_one_line(tmp_path):
    extra = {"blk.0.attn_sinks.weight": np.ones(4, np.float32)}
    path = write_gguf(tmp_path / "q.gguf", "qwen2", source_model("qwen2", vocab_size()), extra_tensors=extra)
    with pytest.raises(ModelLoadError, match=r"has no place for: blk\.0\.attn_sinks\.weight$"):
        as_stored(path)


def test_rope_tables_another_family_does_not_read_are_refused_not_dropped(tmp_path):
    extra = {"rope_freqs.weight": np.ones(8, np.float32)}  # llama.cpp's Qwen2 never reads it
    path = write_gguf(tmp_path / "q.gguf", "qwen2", source_model("qwen2", vocab_size()), extra_tensors=extra)
    with pytest.raises(ModelLoadError, match=r"no place for: rope_freqs\.weight"):
        as_stored(path)


def test_an_unknown_rope_scaling_type_is_one_line(tmp_path):
    keys = {"llama.rope.scaling.type": "xpos"}
    path = write_gguf(tmp_path / "l.gguf", "llama", source_model("llama", vocab_size()), keys=keys)
    with pytest.raises(ModelLoadError, match=r"rope scaling type 'xpos' is not one llama\.cpp runs"):
        as_stored(path)


def test_a_llama_3_files_rotation_is_llama_cpps_not_a_plain_ropes(tmp_path):
    source = source_model("llama3", vocab_size())
    stored = as_stored(write_gguf(tmp_path / "llama3.gguf", "llama3", source))
    divisors = llama3_rope_freqs(16)
    assert not np.allclose(divisors, 1.0)  # the test's rope does scale
    plain = 10000.0 ** (-np.arange(0, 16, 2) / 16)
    assert np.allclose(stored.model.rotary_emb.inv_freq.numpy(), plain / divisors, rtol=1e-6)


@pytest.mark.parametrize("family", ["llama3", "qwen3", "gemma2", "gemma3", "phi3-longrope"])
def test_each_family_loads_as_stored_and_answers_as_the_target_alone_with_every_drafter(tmp_path, family, monkeypatch):
    from test_conformance import accepted_by_every_drafter

    from specdec_core.engine.drafters import NoDrafter
    from specdec_core.engine.speculative import GenerationParams, SpeculativeEngine
    from specdec_core.models.loading import load_model

    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path / "cache"))
    source = source_model(family, vocab_size())
    round_to_q8_0(source)
    path = write_gguf(tmp_path / f"tiny-{family}.Q8_0.gguf", family, source, "Q8_0")
    target = load_model(str(path), device="cpu", precision="gguf")
    assert target.precision == "gguf" and target.fidelity.startswith("as stored")
    a, b = logits(target.model, IDS), logits(source, IDS)
    assert torch.allclose(a, b, atol=1e-4, rtol=1e-4), (a - b).abs().max()  # the load's model is the source's
    engine = SpeculativeEngine(target.model, target.tokenizer, NoDrafter())
    params = GenerationParams(max_new_tokens=24, draft_length=3)
    prompt = IDS * 2  # past the window
    alone = list(list(engine.generate(prompt, params))[-1].token_ids)
    assert accepted_by_every_drafter(engine, source, prompt, params, alone, f"{family}: ") > 0
