"""An HF folder on the CPU as llama.cpp blocks: quantized once with llama.cpp's own reference
quantizers (byte for byte), cached as a GGUF, measured against the source at conversion."""

from __future__ import annotations

import ctypes
import glob
import os
import shutil
import subprocess
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from specdec_core.kernels.cpu import native
from specdec_core.kernels.cpu.gguf_quantize import QUANTIZED, quantize

needs_kernel = pytest.mark.skipif(native.unavailable() is not None, reason=str(native.unavailable()))
LLAMA_BUILDS = "~/.cache/specdec/llama.cpp/*/src/vendor/llama.cpp/build/bin"


def rows_to_quantize(seed: int = 0, shape: tuple[int, int] = (37, 1024)) -> np.ndarray:
    """Weights of a few scales, with the cases the quantizers branch on: a zero row, a row of
    denormal-small values, an all-positive row, outliers."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(shape) * 0.05).astype(np.float32)
    x[1] = 0.0
    x[2, :300] = 1e-30
    x[3] = np.abs(x[3])
    x[4, ::7] *= 60.0
    x[5] *= 300.0
    return x


def llama_cpp_file(name: str) -> Path | None:
    """A file of the llama.cpp that scripts/build-llama-cpp builds, if it was built here."""
    found = sorted(glob.glob(os.path.join(os.path.expanduser(LLAMA_BUILDS), name)))
    return Path(found[-1]) if found else None


def llama_quantize() -> Path | None:
    named = os.environ.get("SPECDEC_LLAMA_QUANTIZE")
    return Path(named) if named else (llama_cpp_file("llama-quantize") or _on_path("llama-quantize"))


def _on_path(name: str) -> Path | None:
    found = shutil.which(name)
    return Path(found) if found else None


@needs_kernel
@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q5_0])
def test_32_weight_blocks_are_the_gguf_packages_bytes(qtype):
    x = rows_to_quantize()
    assert np.array_equal(quantize(x, qtype), gguf.quants.quantize(x, qtype))


@needs_kernel
@pytest.mark.parametrize(("qtype", "bound"), [(T.Q4_K, 1.5 / 15), (T.Q6_K, 1.25 / 63)])
def test_k_quant_blocks_round_trip_within_the_types_step(qtype, bound):
    """Each weight comes back within about a quantization step of its 256-weight block
    (4 bits over the block's range; 6 bits over its largest magnitude), a zero row as
    zeros, and values too small for fp16 scales as zeros."""
    x = rows_to_quantize()
    back = gguf.quants.dequantize(quantize(x, qtype), qtype).reshape(x.shape)
    largest = np.repeat(np.abs(x).reshape(x.shape[0], -1, 256).max(axis=-1), 256, axis=-1)
    normal = np.arange(len(x)) != 2
    assert np.all(np.abs(back - x)[normal] <= bound * largest[normal])
    assert not back[1].any() and not back[2, :256].any()


def _ggml_base() -> ctypes.CDLL | None:
    path = llama_cpp_file("libggml-base.so")
    if path is None:
        return None
    lib = ctypes.CDLL(str(path))
    lib.ggml_quantize_chunk.argtypes = [
        ctypes.c_int,
        *[ctypes.c_void_p] * 2,
        *[ctypes.c_int64] * 3,
        ctypes.c_void_p,
    ]
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    return lib


@needs_kernel
@pytest.mark.skipif(
    _ggml_base() is None, reason="llama.cpp's libggml-base is not built here (scripts/build-llama-cpp)"
)
@pytest.mark.parametrize("qtype", QUANTIZED)
@pytest.mark.parametrize("isa", ["", "scalar"])
def test_every_type_is_llama_cpps_own_bytes(qtype, isa, monkeypatch):
    if isa:
        monkeypatch.setenv("SPECDEC_ISA", isa)
        native._load.cache_clear()
    lib = _ggml_base()
    assert lib is not None
    try:
        for seed, scale in [(0, 1.0), (1, 1e-5), (2, 40.0)]:
            x = rows_to_quantize(seed) * scale
            ours = quantize(x, qtype)
            theirs = np.empty_like(ours)
            lib.ggml_quantize_chunk(
                int(qtype), x.ctypes.data, theirs.ctypes.data, 0, x.shape[0], x.shape[1], None
            )
            assert np.array_equal(ours, theirs), f"{qtype.name}: {(ours != theirs).sum()} bytes differ"
    finally:
        native._load.cache_clear()


def test_a_row_that_is_not_whole_blocks_is_refused_in_one_line():
    with pytest.raises(ValueError, match="not whole Q4_K blocks of 256"):
        quantize(np.zeros((2, 96), np.float32), T.Q4_K)
    with pytest.raises(ValueError, match="no quantizer for Q3_K"):
        quantize(np.zeros((2, 256), np.float32), T.Q3_K)


def _run(argv: list[str]) -> None:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


# --- the cached copy -------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def isolated_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path / "cache"))


def write_folder(folder: Path, arch: str = "qwen2", seed: int = 0, hidden: int = 256) -> Path:
    """A bf16 HF folder of a tiny model whose rows are whole 256-weight blocks (Q4_K, Q6_K)."""
    import torch
    from tiny import tiny_model, tiny_tokenizer
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = tiny_tokenizer()
    model = tiny_model(len(tokenizer), seed=seed, hidden=hidden)
    if arch == "llama":
        settings = {k: getattr(model.config, k) for k in ("vocab_size", "hidden_size", "intermediate_size",
                    "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "max_position_embeddings")}  # fmt: skip
        torch.manual_seed(seed)
        model = LlamaForCausalLM(
            LlamaConfig(**settings, initializer_range=0.2, tie_word_embeddings=True)
        ).eval()
    model.to(torch.bfloat16).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def wide_folder(tmp_path_factory) -> Path:
    return write_folder(tmp_path_factory.mktemp("wide-qwen2"))


def copies() -> list[Path]:
    from specdec_core.models.gguf_convert import converted_dir

    found = converted_dir().iterdir() if converted_dir().is_dir() else ()
    return sorted(p for p in found if not p.name.startswith("."))


@needs_kernel
def test_auto_quantizes_a_folder_once_to_q4_k_m_and_reuses_the_copy(wide_folder, monkeypatch):
    from specdec_core.models import hf_blocks
    from specdec_core.models.loading import load_model

    first = load_model(str(wide_folder), device="cpu", precision="auto")
    assert first.precision == "q4_k_m" and [p.name.endswith("-q4_k_m") for p in copies()] == [True]

    def no_quantizing(*args, **kwargs):
        raise AssertionError("quantized again")

    monkeypatch.setattr(hf_blocks, "write_gguf", no_quantizing)
    monkeypatch.setattr(hf_blocks, "measure_probe", no_quantizing)
    second = load_model(str(wide_folder), device="cpu", precision="q4_k_m")
    assert second.fidelity == first.fidelity and len(copies()) == 1


@needs_kernel
def test_the_copy_is_a_smaller_gguf_with_llama_cpps_names_and_q4_k_m_mix(wide_folder):
    from specdec_core.models import hf_blocks
    from specdec_core.models.gguf_file import read_gguf
    from specdec_core.models.loading import load_model

    load_model(str(wide_folder), device="cpu", precision="q4_k_m")
    (copy,) = copies()
    file = read_gguf(copy / hf_blocks.GGUF_NAME)
    assert file.file_type == "Q4_K_M" and file.architecture == "qwen2"
    types = {name: T(info.qtype).name for name, info in file.tensors.items()}
    assert types["output.weight"] == "Q6_K" and types["token_embd.weight"] == "Q4_K"
    assert types["blk.1.attn_v.weight"] == types["blk.1.ffn_down.weight"] == "Q6_K"  # use_more_bits(1, 2)
    assert types["blk.0.attn_v.weight"] == types["blk.0.ffn_down.weight"] == "Q4_K"  # not (0, 2)
    assert types["blk.0.attn_q.weight"] == "Q4_K" and types["blk.0.attn_q.bias"] == "F32"
    assert types["blk.1.attn_norm.weight"] == "F32"
    source = sum(f.stat().st_size for f in wide_folder.glob("*.safetensors"))
    assert (copy / hf_blocks.GGUF_NAME).stat().st_size < source / 2


@needs_kernel
def test_the_label_carries_the_probes_kl_against_the_source(wide_folder):
    import json
    import re

    from specdec_core.models import hf_blocks
    from specdec_core.models.loading import load_model

    loaded = load_model(str(wide_folder), device="cpu", precision="q8_0")
    probe = json.loads((copies()[0] / hf_blocks.PROBE_NAME).read_text())
    assert re.fullmatch(r"Q8_0 from bf16 \(KL \d+\.\d{4} on the probe\)", loaded.fidelity), loaded.fidelity
    assert f"KL {probe['kl_mean']:.4f}" in loaded.fidelity and probe["positions"] > 100


@needs_kernel
@needs_kernel
def test_a_source_too_big_for_memory_is_not_measured_and_the_label_says_so(wide_folder, monkeypatch):
    """The probe loads the folder in fp32 (28 GB for a 7B): as requant_probe, only where it fits."""
    from transformers import AutoModelForCausalLM

    from specdec_core.models import hf_blocks
    from specdec_core.models.loading import load_model

    def no_reference(*args, **kwargs):
        raise AssertionError("the fp32 source was loaded")

    monkeypatch.setattr(hf_blocks, "available_bytes", lambda: 1024)
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", no_reference)
    loaded = load_model(str(wide_folder), device="cpu", precision="q4_k_m")
    assert loaded.fidelity.startswith("Q4_K_M from bf16 (KL not measured: the fp32 reference would not fit in memory)")


@needs_kernel
def test_a_changed_source_gets_its_own_copy(tmp_path):
    from specdec_core.models.loading import load_model

    folder = write_folder(tmp_path / "m", seed=0)
    load_model(str(folder), device="cpu", precision="q8_0")
    write_folder(folder, seed=1)  # new weights in the same place
    load_model(str(folder), device="cpu", precision="q8_0")
    assert len(copies()) == 2


@needs_kernel
def test_a_killed_write_leaves_nothing_that_is_used(tmp_path, monkeypatch):
    from specdec_core.models import hf_blocks
    from specdec_core.models.loading import load_model

    folder = write_folder(tmp_path / "m")

    def killed(*args, **kwargs):
        raise KeyboardInterrupt

    measure_probe = hf_blocks.measure_probe
    monkeypatch.setattr(hf_blocks, "measure_probe", killed)  # the GGUF written, the probe not
    with pytest.raises(KeyboardInterrupt):
        load_model(str(folder), device="cpu", precision="q8_0")
    assert copies() == []
    monkeypatch.setattr(hf_blocks, "measure_probe", measure_probe)
    key = hf_blocks.cache_key(folder, "q8_0")
    final = hf_blocks.cache_path(key, "q8_0")
    final.mkdir(parents=True)
    (final / hf_blocks.GGUF_NAME).write_bytes(b"GGUF" + bytes(40))  # a folder without its marker
    loaded = load_model(str(folder), device="cpu", precision="q8_0")
    assert loaded.precision == "q8_0" and (final / "specdec.json").is_file()


def convert_hf_to_gguf_permute(weights: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py `LlamaModel.permute`: a Llama's q/k rows in its rotary order."""
    return (
        weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


@needs_kernel
@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_q8_0_blocks_hold_the_rows_convert_hf_to_gguf_writes_and_compute_near_the_source(tmp_path, arch):
    import torch
    from safetensors.torch import load_file

    from specdec_core.models import hf_blocks
    from specdec_core.models.gguf_file import read_gguf
    from specdec_core.models.loading import load_model

    folder = write_folder(tmp_path / arch, arch=arch)
    blocks = load_model(str(folder), device="cpu", precision="q8_0")
    file = read_gguf(copies()[0] / hf_blocks.GGUF_NAME)
    weights = load_file(str(folder / "model.safetensors"))
    config = blocks.model.config
    for short, heads in [("q", config.num_attention_heads), ("k", config.num_key_value_heads)]:
        source = weights[f"model.layers.0.self_attn.{short}_proj.weight"].float().numpy()
        expected = convert_hf_to_gguf_permute(source, heads) if arch == "llama" else source
        stored = gguf.quants.dequantize(file.raw(f"blk.0.attn_{short}.weight"), T.Q8_0).reshape(source.shape)
        assert np.abs(stored - expected).max() <= np.abs(source).max() / 127, short
    reference = load_model(str(folder), device="cpu", precision="fp32")
    ids = torch.tensor([blocks.tokenizer("def add(a, b): return a + b and the quick brown fox")["input_ids"]])
    with torch.no_grad():
        a, b = blocks.model(input_ids=ids).logits[0], reference.model(input_ids=ids).logits[0]
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.8


@needs_kernel
def test_every_drafter_gives_the_target_alones_tokens_on_the_copy(wide_folder):
    from test_conformance import accepted_by_every_drafter

    from specdec_core.engine.drafters import NoDrafter
    from specdec_core.engine.speculative import GenerationParams, SpeculativeEngine
    from specdec_core.models.loading import load_model

    target = load_model(str(wide_folder), device="cpu", precision="q4_k_m")
    draft = load_model(
        str(wide_folder), device="cpu", precision="fp32", as_stored=False
    ).model  # near, not equal
    prompt = target.tokenizer("def add(a, b): return a + b. The quick brown fox " * 4)["input_ids"]
    engine = SpeculativeEngine(target.model, target.tokenizer, NoDrafter())
    params = GenerationParams(max_new_tokens=24, draft_length=3)
    alone = list(list(engine.generate(prompt, params))[-1].token_ids)
    accepted_by_every_drafter(engine, draft, prompt, params, alone)


# --- bad input -------------------------------------------------------------------------------


@needs_kernel
def test_auto_keeps_todays_path_where_the_recipe_is_not_fast(tiny_folder):
    """Hidden 64: Q4_K_M falls back to Q5_0 and Q8_0, which the kernels run slower than int4."""
    from specdec_core.models.loading import load_model

    loaded = load_model(str(tiny_folder), device="cpu", precision="auto")
    assert (
        loaded.precision == "int4"
        and loaded.fidelity.startswith("re-quantized: int4 from")
        and copies() == []
    )


@needs_kernel
def test_auto_keeps_a_folder_off_the_4_bit_blocks_on_the_scalar_build(wide_folder, monkeypatch):
    """README: the scalar build runs `auto` at int8, where Q4_K_M's kernels are not fast."""
    from specdec_core.models import hf_blocks
    from specdec_core.models.loading import load_model

    planned = hf_blocks.plan(load_config_of(wide_folder), hf_blocks.shapes_of(wide_folder), "q4_k_m")
    assert hf_blocks.runs_fast(planned) == (native.isa() != "scalar")  # a vector build: fast
    monkeypatch.setenv("SPECDEC_ISA", "scalar")
    assert not hf_blocks.runs_fast(planned)
    loaded = load_model(str(wide_folder), device="cpu", precision="auto")
    assert loaded.precision == "int8" and copies() == []


def load_config_of(folder: Path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(folder)


def test_an_unmapped_family_or_no_compiler_is_todays_path_at_auto_and_one_line_when_asked(
    wide_folder, monkeypatch
):
    from specdec_core.errors import ModelLoadError
    from specdec_core.models import hf_blocks
    from specdec_core.models.loading import load_model

    mapped = hf_blocks.WRITTEN
    monkeypatch.setattr(hf_blocks, "WRITTEN", ("llama",))
    assert load_model(str(wide_folder), device="cpu", precision="auto").precision != "q4_k_m"
    with pytest.raises(
        ModelLoadError, match=r"q4_k_m quantizes an HF folder into llama\.cpp's blocks, and qwen2 models"
    ):
        load_model(str(wide_folder), device="cpu", precision="q4_k_m")
    monkeypatch.setattr(hf_blocks, "WRITTEN", mapped)
    monkeypatch.setattr(native, "unavailable", lambda: "found no C compiler (cc, gcc)")
    loaded = load_model(str(wide_folder), device="cpu", precision="auto")
    assert loaded.precision not in ("q4_k_m", "int4") and loaded.fidelity.startswith("re-quantized")
    with pytest.raises(ModelLoadError, match="and found no C compiler"):
        load_model(str(wide_folder), device="cpu", precision="q8_0")
    assert copies() == []


def test_a_mix_asked_of_a_gguf_file_is_one_line(tmp_path):
    from test_gguf_convert import write_tiny_llama_gguf

    from specdec_core.errors import ModelLoadError
    from specdec_core.models.loading import load_model

    path = write_tiny_llama_gguf(tmp_path / "tiny.gguf")
    with pytest.raises(ModelLoadError, match="is a GGUF file: it runs its own blocks as stored"):
        load_model(str(path), device="cpu", precision="q4_k_m")


# --- against llama-quantize ----------------------------------------------------------------


@needs_kernel
@pytest.mark.slow
@pytest.mark.skipif(
    llama_quantize() is None, reason="no llama-quantize (scripts/build-llama-cpp, or SPECDEC_LLAMA_QUANTIZE)"
)
def test_llama_quantize_writes_the_same_types_and_bytes(tmp_path):
    """llama-quantize's Q4_K_M of an F32 GGUF: our recipe gives each tensor its type, and our
    quantizers its bytes."""
    from test_gguf_convert import write_tiny_llama_gguf

    from specdec_core.models import hf_blocks
    from specdec_core.models.gguf_file import read_gguf

    source = write_tiny_llama_gguf(tmp_path / "in.gguf", qtype="F32", hidden=256, ffn=512)
    out = tmp_path / "out.gguf"
    _run([str(llama_quantize()), "--allow-requantize", str(source), str(out), "Q4_K_M"])
    theirs, ours_in = read_gguf(out), read_gguf(source)
    layers = 1 + max(int(n.split(".")[1]) for n in theirs.tensors if n.startswith("blk."))
    compared = 0
    for name, info in theirs.tensors.items():
        if not name.startswith("blk.") or len(info.dims) != 2:
            continue
        qtype = hf_blocks.tensor_type(name, info.dims[0], "q4_k_m", layers, tied=True)
        assert T(info.qtype) == qtype, name
        values = ours_in.raw(name).view(np.float32).reshape(info.dims[1], info.dims[0])
        assert np.array_equal(quantize(values, qtype), theirs.raw(name)), name
        compared += 1
    assert compared == 7 * layers
