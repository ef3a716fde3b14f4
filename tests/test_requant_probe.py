"""A re-quantization at load (CPU int4/int8 of a folder or a GGUF) is measured once against the
source's weights in fp32, and every load's label carries the figure."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_gguf_convert import write_tiny_llama_gguf

from specdec_core.kernels.cpu import native
from specdec_core.models import hf_blocks, requant_probe
from specdec_core.models.loading import load_model

needs_kernel = pytest.mark.skipif(native.unavailable() is not None, reason=str(native.unavailable()))


@pytest.fixture(autouse=True)
def isolated_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path / "cache"))


@pytest.mark.parametrize("precision", ["int8", pytest.param("int4", marks=needs_kernel)])
def test_a_folder_re_quantized_says_its_measured_kl_and_measures_it_once(tiny_folder, precision, monkeypatch):
    first = load_model(str(tiny_folder), device="cpu", precision=precision)
    assert first.fidelity.startswith(f"re-quantized: {precision} from")
    assert " (KL " in first.fidelity and first.fidelity.endswith(" on the probe)")

    def measured_again(*args, **kwargs):
        raise AssertionError("the probe ran a second time")

    monkeypatch.setattr(requant_probe, "_measure", measured_again)
    again = load_model(str(tiny_folder), device="cpu", precision=precision)
    assert again.fidelity == first.fidelity


def test_every_re_quantization_on_cuda_is_measured_and_the_cpus_int4_and_int8():
    assert requant_probe.applies("cpu", "int4", "re-quantized: int4 from bf16")
    assert not requant_probe.applies("cpu", "bf16", "re-quantized: bf16 from fp32")  # a plain cast
    assert requant_probe.applies("cuda", "nf4", "re-quantized: nf4 from bf16")
    assert requant_probe.applies("cuda", "bf16", "re-quantized: bf16 from Q4_K_M")
    assert not requant_probe.applies("cuda", "bf16", "as stored (bf16)")


@needs_kernel
def test_a_gguf_re_quantized_says_its_measured_kl(tmp_path):
    path = write_tiny_llama_gguf(tmp_path / "tiny.Q8_0.gguf", arch="qwen2")
    loaded = load_model(str(path), device="cpu", precision="int4")
    assert loaded.fidelity.startswith("re-quantized: int4 from") and " (KL " in loaded.fidelity


def test_a_reference_too_big_for_memory_is_not_measured_and_the_label_says_so(tiny_folder, monkeypatch):
    monkeypatch.setattr(hf_blocks, "available_bytes", lambda: 1024)
    loaded = load_model(str(tiny_folder), device="cpu", precision="int8")
    assert loaded.fidelity.endswith("(KL not measured: the fp32 reference would not fit in memory)")


def test_a_draft_is_never_measured(tiny_folder, tmp_path):
    load_model(str(tiny_folder), device="cpu", precision="int8", as_stored=False)
    assert not (tmp_path / "cache" / "probes").exists()


def test_a_probe_file_that_cannot_be_read_is_measured_again(tiny_folder, tmp_path):
    first = load_model(str(tiny_folder), device="cpu", precision="int8")
    (written,) = (tmp_path / "cache" / "probes").iterdir()
    written.write_text("{not json")
    again = load_model(str(tiny_folder), device="cpu", precision="int8")
    assert again.fidelity == first.fidelity


def test_the_cache_lists_and_clears_the_measured_probes(tiny_folder):
    from specdec_core.tools.cache_admin import clear_cache, list_cache

    load_model(str(tiny_folder), device="cpu", precision="int8")
    probes = [item for item in list_cache() if item.kind == "probe"]
    assert len(probes) == 1 and probes[0].path.suffix == ".json"
    assert [item.path for item in clear_cache({"probe"})] == [probes[0].path]
    assert not probes[0].path.exists()


def test_figures_measured_by_other_code_are_measured_again(tiny_folder, tmp_path):
    first = load_model(str(tiny_folder), device="cpu", precision="int8")
    (written,) = (tmp_path / "cache" / "probes").iterdir()
    figures = json.loads(written.read_text())
    assert figures["code"] == requant_probe.code_key()
    written.write_text(json.dumps({**figures, "kl_mean": 9.0, "code": "an older kernel's"}))
    again = load_model(str(tiny_folder), device="cpu", precision="int8")
    assert again.fidelity == first.fidelity and "KL 9.0000" not in again.fidelity
    assert json.loads(written.read_text())["code"] == requant_probe.code_key()


def test_the_code_key_covers_every_kernel_and_the_measuring_code(monkeypatch):
    files = set(requant_probe._code_files())
    assert {*native.SOURCES, *native.HEADERS} <= files
    package = Path(requant_probe.__file__).parent.parent
    for name in ("kernels/cpu/gguf_blocks.py", "kernels/cpu/quant_cpu.py", "kernels/batch_invariant.py",
                 "engine/fidelity.py", "models/hf_blocks.py"):  # fmt: skip
        assert package / name in files, name
    before = requant_probe.code_key()
    changed = package / "kernels/cpu/gguf_cpu.c"
    original = requant_probe._content
    monkeypatch.setattr(requant_probe, "_content", lambda f: original(f) + (b" " if f == changed else b""))
    requant_probe.code_key.cache_clear()
    try:
        assert requant_probe.code_key() != before
    finally:
        monkeypatch.undo()
        requant_probe.code_key.cache_clear()
    assert requant_probe.code_key() == before
