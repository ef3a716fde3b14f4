"""A GGUF run from its blocks as stored (`--precision gguf`): the same function as the file's
weights de-quantized to fp32, up to summation order; the file is mapped, never converted."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from test_gguf_convert import write_tiny_llama_gguf

from specdec_core import ChatSession, GenerationParams, LoadSpec, Message
from specdec_core.errors import ModelLoadError
from specdec_core.kernels.cpu import gguf_blocks, native
from specdec_core.kernels.cpu.gguf_blocks import F32, I8, GGUFLinear
from specdec_core.kernels.cpu.int4_cpu import K4, K6, Int4Linear
from specdec_core.models import gguf_convert, gguf_native
from specdec_core.models.gguf_file import read_gguf
from specdec_core.models.loading import fidelity_label, load_model
from specdec_core.tools import cli

needs_kernel = pytest.mark.skipif(native.unavailable() is not None, reason=str(native.unavailable()))


@pytest.fixture(autouse=True)
def isolated_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny_gguf(request, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp(f"gguf-{request.param}")
    return write_tiny_llama_gguf(folder / f"tiny-{request.param}.Q8_0.gguf", arch=request.param)


def logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0].float()


def test_the_header_reader_agrees_with_the_gguf_package(tiny_gguf):
    import gguf

    file = read_gguf(tiny_gguf)
    reference = {t.name: t for t in gguf.GGUFReader(str(tiny_gguf)).tensors}
    assert file.tensors.keys() == reference.keys()
    for name, tensor in reference.items():
        assert np.array_equal(np.asarray(tensor.data).view(np.uint8).reshape(-1), file.raw(name).reshape(-1)), name


def test_as_stored_computes_what_the_files_weights_in_fp32_compute(tiny_gguf):
    stored = load_model(str(tiny_gguf), device="cpu", precision="gguf")
    converted = load_model(str(tiny_gguf), device="cpu", precision="fp32")
    fallback = native.unavailable()  # without the kernels, torch multiplies: said in the label
    notes = "" if fallback is None else f", 15 linears {gguf_blocks.FALLBACK_NOTE} ({fallback})"
    assert stored.precision == "gguf" and stored.fidelity == "as stored (GGUF)" + notes  # the file names no mix
    linears = [m for m in stored.model.modules() if isinstance(m, GGUFLinear)]
    assert len(linears) == 2 * 7 + 1  # every projection and the head read the file's blocks
    ids = stored.tokenizer("def is_prime(n): return n > 1 and hello world")["input_ids"]
    a, b = logits(stored.model, ids), logits(converted.model, ids)
    assert torch.allclose(a, b, atol=1e-4, rtol=1e-4), (a - b).abs().max()
    assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_the_cost_curves_step_bytes_count_the_files_blocks(tiny_gguf):
    """`bench --cost-curve` on a GGUF: the linears' blocks (or their repacked copy) are what a
    step reads, and the embedding, which reads rows from the file's blocks, has no `weight`."""
    from specdec_core.tools.bench import step_bytes

    stored = load_model(str(tiny_gguf), device="cpu", precision="gguf")
    linears = [m for m in stored.model.modules() if isinstance(m, GGUFLinear)]
    read = sum((m.packed if m.packed is not None else m.blocks).nbytes for m in linears)
    assert step_bytes(stored.model).weights >= read > 0


def test_as_stored_answers_exactly_as_the_target_alone_with_every_drafter(tiny_gguf):
    session = ChatSession()
    info = session.load(LoadSpec(target=str(tiny_gguf), draft="ngram", device="cpu", precision="gguf"))
    assert info.precision == "gguf" and info.fidelity.startswith("as stored")
    assert info.exactness is not None and info.exactness.bitwise
    question = [Message("user", "hello world, hello world, speculative decoding")]
    params = GenerationParams(max_new_tokens=24)
    answers = {}
    for enabled in (False, True):
        session.speculation_enabled = enabled
        answers[enabled] = [e for e in session.answer(question, params=params)][-1].token_ids
    assert answers[True] == answers[False]


@pytest.mark.parametrize("precision", ["gguf", "int8", "fp32"])
def test_the_file_is_read_without_a_converted_copy(tiny_gguf, precision):
    load_model(str(tiny_gguf), device="cpu", precision=precision)
    folders = list(gguf_convert.converted_dir().iterdir())
    assert [f.name.endswith("-meta") for f in folders] == [True]
    assert not list(folders[0].glob("*.safetensors"))


@pytest.mark.parametrize("precision", ["int8", "fp32"])
def test_de_quantizing_in_memory_gives_the_conversions_numbers_bitwise(tiny_gguf, precision, monkeypatch):
    in_memory = load_model(str(tiny_gguf), device="cpu", precision=precision)
    monkeypatch.setattr(gguf_native, "ARCHITECTURES", ())  # every family refused: the converted folder
    converted = load_model(str(tiny_gguf), device="cpu", precision=precision)
    assert not in_memory.path.samefile(converted.path)
    ids = in_memory.tokenizer("def is_prime(n): return n > 1 and hello world")["input_ids"]
    assert torch.equal(logits(in_memory.model, ids), logits(converted.model, ids))
    assert in_memory.fidelity == converted.fidelity


def test_gguf_precision_on_a_folder_is_one_line(tiny_folder):
    with pytest.raises(ModelLoadError, match="is not a GGUF file: --precision gguf runs a GGUF's blocks"):
        load_model(str(tiny_folder), device="cpu", precision="gguf")


def test_an_architecture_without_a_mapping_is_refused_in_one_line(tiny_gguf, monkeypatch):
    monkeypatch.setattr(gguf_native, "ARCHITECTURES", ("mistral3",))
    with pytest.raises(ModelLoadError, match="models do not run as stored yet"):
        load_model(str(tiny_gguf), device="cpu", precision="gguf")
    assert load_model(str(tiny_gguf), device="cpu", precision="auto").precision != "gguf"


@needs_kernel  # without them: the next test
def test_auto_runs_a_gguf_target_as_stored_whatever_its_types(tiny_gguf, monkeypatch):
    monkeypatch.setattr(native, "vector_build", lambda: True)  # the scalar build: the next test but one
    assert 8 not in gguf_native.FAST_TYPES  # Q8_0, slower than our int4 path: still the file's
    target = load_model(str(tiny_gguf), device="cpu", precision="auto")
    assert target.precision == "gguf" and target.fidelity.startswith("as stored")
    draft = load_model(str(tiny_gguf), device="cpu", precision="auto", as_stored=False)
    assert draft.precision != "gguf"  # a draft's numbers never reach the answer: the fastest path


def test_auto_leaves_a_gguf_to_the_converted_path_where_the_kernels_do_not_run(tiny_gguf, monkeypatch):
    monkeypatch.setattr(native, "unavailable", lambda: "no C compiler (cc, gcc)")
    file = read_gguf(tiny_gguf)
    assert not gguf_native.auto_runs_as_stored(file)  # the fallback de-quantizes on every call
    monkeypatch.setattr(native, "unavailable", lambda: None)
    monkeypatch.setattr(native, "isa", lambda: "avx2")
    assert gguf_native.auto_runs_as_stored(file)


@needs_kernel
def test_auto_leaves_a_fast_type_to_int8_on_the_scalar_build(tiny_gguf, monkeypatch):
    """README: the scalar build runs `auto` at int8; the repacked 4-bit kernel is not fast there."""
    monkeypatch.setenv("SPECDEC_ISA", "scalar")
    assert not gguf_native.auto_runs_as_stored(read_gguf(tiny_gguf))
    loaded = load_model(str(tiny_gguf), device="cpu", precision="auto")
    assert loaded.precision == "int8" and loaded.fidelity.startswith("re-quantized: int8 from")


@needs_kernel
def test_the_loader_runs_q4_k_and_q6_k_repacked_and_other_types_with_fp32_rows(monkeypatch):
    assert {gguf_native._activations(qtype) for qtype in (12, 14)} == {I8}
    assert {gguf_native._activations(qtype) for qtype in (8, 13, 0)} == {F32}
    monkeypatch.setattr(native, "unavailable", lambda: "no C compiler (cc, gcc)")
    assert gguf_native._activations(12) == F32  # the fallback's rows are fp32


def test_a_truncated_gguf_is_one_line(tmp_path, tiny_gguf):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(tiny_gguf.read_bytes()[:200])
    with pytest.raises(ModelLoadError, match="damaged or truncated GGUF file"):
        read_gguf(cut)


def test_the_fidelity_label_says_what_each_precision_does_to_the_source(tiny_folder):
    config = json.loads((tiny_folder / "config.json").read_text())
    stored = config.get("dtype") or config.get("torch_dtype")
    name = {"float32": "fp32", "bfloat16": "bf16"}[stored]

    class Config:
        dtype = stored

    assert fidelity_label(tiny_folder, Config(), name) == f"as stored ({name})"
    assert fidelity_label(tiny_folder, Config(), "int4") == f"re-quantized: int4 from {name}"


def test_generate_json_reports_the_fidelity(capsys, tiny_gguf):
    argv = ["generate", "--target", str(tiny_gguf), "--draft", "none", "--device", "cpu", "--precision", "gguf"]
    assert cli.main([*argv, "--prompt", "hello", "--max-new-tokens", "4", "--json", "--no-calibrate"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["target"]["precision"] == "gguf" and doc["target"]["fidelity"].startswith("as stored")


def stored_types(model: torch.nn.Module) -> set[str]:
    """The block types the model's linears compute with: the GGUF linears' own, and where they run
    repacked as int4_cpu's modules, the types of that layout (K4, K6; 4 and 6 for the 32-weight types)."""
    repacked = {K4: {"Q4_K"}, K6: {"Q6_K"}, 4: {"Q4_0", "Q4_1"}, 6: {"Q5_0", "Q5_1"}}
    names = {m.qtype.name for m in model.modules() if isinstance(m, GGUFLinear)}
    return names.union(*(repacked[m.bits] for m in model.modules() if isinstance(m, Int4Linear)))


@needs_kernel
def test_repacked_linears_run_fused_in_the_int4_paths_one_call_layers_computing_the_same_function(tmp_path):
    from specdec_core.kernels.cpu.fused_int8 import FusedGateUpMLP
    from specdec_core.kernels.cpu.layers_cpu import writes_cache_in_place

    path = write_tiny_llama_gguf(tmp_path / "tiny-Q4_K.gguf", arch="qwen2", qtype="Q4_K", hidden=256, ffn=512)
    stored = load_model(str(path), device="cpu", precision="gguf")
    plain = gguf_native.build_model(read_gguf(path), stored.model.config)  # GGUF linears, no fusion
    assert not [m for m in stored.model.model.layers.modules() if isinstance(m, GGUFLinear)]
    assert all(isinstance(layer.mlp, FusedGateUpMLP) for layer in stored.model.model.layers)
    assert writes_cache_in_place(stored.model)  # q/k/v fused too: each layer is one C call
    assert stored.fidelity.endswith("activations int8 per 32 inputs")
    ids = stored.tokenizer("def is_prime(n): return n > 1 and hello world")["input_ids"]
    a, b = logits(stored.model, ids), logits(plain, ids)
    assert torch.allclose(a, b, atol=1e-4, rtol=1e-4), (a - b).abs().max()  # the norm sums in its own order


BLOCK_TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "F16", "BF16"]
PAST_THE_WINDOW = 300  # prompt tokens: more than a model draft's window (drafters.WINDOW)


@pytest.mark.slow
@pytest.mark.parametrize("qtype", BLOCK_TYPES)
def test_every_block_type_as_stored_answers_as_the_target_alone_with_every_drafter(tmp_path, qtype):
    from test_conformance import accepted_by_every_drafter

    from specdec_core.engine.drafters import WINDOW, NoDrafter
    from specdec_core.engine.speculative import GenerationParams as Params
    from specdec_core.engine.speculative import SpeculativeEngine

    wide = qtype.endswith("_K")
    path = write_tiny_llama_gguf(
        tmp_path / f"tiny-{qtype}.gguf", arch="qwen2", qtype=qtype, context_length=512,
        hidden=256 if wide else 32, ffn=512 if wide else 64,
    )  # fmt: skip
    target = load_model(str(path), device="cpu", precision="gguf")
    assert stored_types(target.model) >= {qtype}
    draft = load_model(str(path), device="cpu", precision="fp32", as_stored=False).model  # near, not equal
    text = "def is_prime(n): return n > 1 and hello world, speculative decoding. "
    prompt = target.tokenizer(text * 20)["input_ids"][:PAST_THE_WINDOW]
    assert len(prompt) > WINDOW
    engine = SpeculativeEngine(target.model, target.tokenizer, NoDrafter())
    params = Params(max_new_tokens=24, draft_length=3)
    alone = list(list(engine.generate(prompt, params))[-1].token_ids)
    accepted = accepted_by_every_drafter(engine, draft, prompt, params, alone, f"{qtype}: ")
    assert accepted > 0  # speculation really ran


def test_the_session_rates_the_ggufs_beside_a_gguf_target_without_converting_them(tmp_path):
    target = write_tiny_llama_gguf(tmp_path / "models" / "target.Q8_0.gguf", hidden=128, ffn=256)
    beside = write_tiny_llama_gguf(tmp_path / "models" / "draft.Q8_0.gguf")
    session = ChatSession()
    session.load(LoadSpec(target=str(target), draft="none", device="cpu", precision="gguf"))
    verdicts = session.rate_drafts(["ngram"])
    assert set(verdicts) == {"ngram", str(beside)}
    assert verdicts[str(beside)].compatible and verdicts[str(beside)].basis == "tokenizers"
    converted = tmp_path / "cache" / "converted"
    assert all(folder.name.endswith("-meta") for folder in converted.iterdir())  # no weights converted
