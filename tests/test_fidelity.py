"""Fidelity against the model's own weights: llama-perplexity's chunking, perplexity, KL and
top-1 agreement, and `specdec eval` over them."""

from __future__ import annotations

import copy
import json
import math
from types import SimpleNamespace

import pytest
import torch

from specdec_core.engine.fidelity import chunk_ids, document_ids, measure
from specdec_core.models.gguf_to_hf import llama_adds_bos
from specdec_core.tools import cli
from specdec_core.tools.cli_eval import llama_cpp_fidelity, parse_llama_kl, parse_llama_perplexity

CTX = 16


def ids_of(n: int, vocab: int, seed: int = 0) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(5, vocab, (n,), generator=generator).tolist()


def perturbed(model: torch.nn.Module, scale: float) -> torch.nn.Module:
    other = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for parameter in other.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * scale * parameter.std())
    return other


def test_chunks_are_whole_and_the_tail_is_left_out():
    assert chunk_ids(list(range(40)), 16) == [list(range(16)), list(range(16, 32))]
    assert chunk_ids(list(range(15)), 16) == []


def test_each_chunk_starts_with_the_bos_in_place_of_its_first_token_as_llama_perplexity_puts_it():
    ids = [7, *range(100, 139)]  # a document that starts with its BOS (7)
    assert chunk_ids(ids, 16, bos=7) == [[7, *range(100, 115)], [7, *range(116, 131)]]


def test_the_text_starts_with_a_bos_only_where_the_vocabulary_adds_one(tokenizer):
    text = "hello world"
    plain = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert document_ids(tokenizer, text, None) == plain
    assert document_ids(tokenizer, text, 3) == [3, *plain]


@pytest.mark.parametrize(
    ("fields", "adds"),
    [
        ({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen2"}, False),
        ({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "llama-bpe"}, True),
        ({"tokenizer.ggml.model": "llama"}, True),  # SPM: Llama 2, Gemma
        ({"tokenizer.ggml.model": "llama", "tokenizer.ggml.add_bos_token": False}, False),
        ({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen2", "tokenizer.ggml.add_bos_token": True}, True),
        ({"tokenizer.ggml.model": "gemma4", "tokenizer.ggml.add_bos_token": False}, True),  # llama.cpp overrides
    ],
)
def test_a_gguf_adds_a_bos_where_llama_cpp_adds_one(fields, adds):
    assert llama_adds_bos(SimpleNamespace(fields=fields)) is adds


def test_a_model_against_itself_has_no_divergence(target, tokenizer):
    ids = ids_of(3 * CTX + 5, len(tokenizer))
    fidelity = measure(target, target, ids, ctx=CTX)
    assert fidelity.chunks == 3 and fidelity.scored == 3 * (CTX // 2 - 1)
    assert fidelity.kl_mean == 0.0 and fidelity.top1_agreement == 1.0
    assert fidelity.perplexity == fidelity.reference_perplexity


@pytest.mark.parametrize("bos", [None, 1])
def test_perplexity_scores_the_second_half_of_each_chunk_from_an_empty_cache(target, tokenizer, bos):
    other = perturbed(target, 0.3)
    ids = ids_of(2 * CTX, len(tokenizer), seed=2)
    fidelity = measure(other, target, ids, ctx=CTX, bos=bos)
    nll, count = 0.0, 0
    for start in (0, CTX):
        read = ids[start : start + CTX]
        chunk = torch.tensor([read if bos is None else [bos, *read[1:]]])
        with torch.no_grad():
            logp = torch.log_softmax(other(input_ids=chunk).logits[0].float(), dim=-1)
        for j in range(CTX // 2, CTX - 1):
            nll -= float(logp[j, ids[start + j + 1]])
            count += 1
    assert fidelity.scored == count
    assert fidelity.perplexity == pytest.approx(math.exp(nll / count), rel=1e-4)
    assert fidelity.kl_mean > 0 and fidelity.kl_p99 >= fidelity.kl_mean
    assert fidelity.perplexity != fidelity.reference_perplexity


def test_a_larger_perturbation_diverges_more(target, tokenizer):
    ids = ids_of(2 * CTX, len(tokenizer), seed=3)
    small = measure(perturbed(target, 0.05), target, ids, ctx=CTX)
    large = measure(perturbed(target, 0.5), target, ids, ctx=CTX)
    assert 0 < small.kl_mean < large.kl_mean
    assert small.top1_agreement >= large.top1_agreement


def test_a_text_shorter_than_one_chunk_is_refused(target, tokenizer):
    with pytest.raises(ValueError, match="at least one chunk of 16"):
        measure(target, target, ids_of(CTX - 1, len(tokenizer)), ctx=CTX)


def test_eval_reports_each_precision_against_the_fp32_weights(capsys, tmp_path, tiny_folder):
    text = tmp_path / "text.txt"
    text.write_text(" ".join(f"word{i} is number {i}." for i in range(200)), encoding="utf-8")
    docs = {}
    for precision in ("fp32", "int8"):
        argv = ["eval", "--target", str(tiny_folder), "--precision", precision, "--text", str(text)]
        assert cli.main([*argv, "--ctx", str(CTX), "--chunks", "4", "--json"]) == 0
        docs[precision] = json.loads(capsys.readouterr().out)
    exact, int8 = docs["fp32"]["fidelity"], docs["int8"]["fidelity"]
    # fp32 against fp32: the same weights, the reference's matmuls whole (summation order only)
    assert exact["chunks"] == 4 and abs(exact["kl_mean"]) < 1e-6 and abs(exact["perplexity_change"]) < 1e-5
    assert docs["int8"]["precision"] == "int8" and int8["kl_mean"] > 1e-4
    assert int8["reference_perplexity"] == exact["reference_perplexity"]


@pytest.mark.parametrize("add_bos", [False, True])
def test_eval_of_a_gguf_reads_each_chunk_after_a_bos_where_llama_cpp_would(tmp_path, monkeypatch, add_bos):
    from test_gguf_convert import write_tiny_llama_gguf

    from specdec_core.engine import fidelity

    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path / "cache"))
    gguf = write_tiny_llama_gguf(tmp_path / "tiny.gguf", add_bos=add_bos)
    text = tmp_path / "text.txt"
    text.write_text("hello world, speculative decoding " * 20, encoding="utf-8")
    seen = {}

    def measured(model, reference, ids, ctx, bos=None):
        seen.update(ids=ids, bos=bos)
        return measure(model, reference, ids, ctx=ctx, bos=bos)

    monkeypatch.setattr(fidelity, "measure", measured)
    argv = ["eval", "--target", str(gguf), "--precision", "gguf", "--text", str(text), "--ctx", str(CTX)]
    assert cli.main([*argv, "--json"]) == 0
    assert seen["bos"] == (0 if add_bos else None)
    assert (seen["ids"][0] == 0) is add_bos  # id 0 is the BOS, never a token of this text


def test_eval_of_an_unreadable_text_is_one_line(capsys, tmp_path, tiny_folder):
    missing = tmp_path / "missing.txt"
    assert cli.main(["eval", "--target", str(tiny_folder), "--text", str(missing)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("specdec: error: cannot read")


def test_llama_perplexity_final_estimate_is_read_from_its_output():
    output = "[1]4.1234,[2]3.9876,\nFinal estimate: PPL = 3.2420 +/- 0.05123\n"
    assert parse_llama_perplexity(output) == 3.2420
    assert parse_llama_perplexity("main: error: failed to load model\n") is None


LLAMA_KL_OUTPUT = """\
====== Perplexity statistics ======
Mean PPL(Q)                   :   2.800100 ±   0.051230
Mean PPL(base)                :   2.794000 ±   0.050990
Cor(ln(PPL(Q)), ln(PPL(base))):  99.95%
Mean PPL(Q)/PPL(base)         :   1.002183 ±   0.000750

====== KL divergence statistics ======
Mean    KLD:   0.000712 ±   0.000031
Maximum KLD:   0.051200
99.9%   KLD:   0.020100
99.0%   KLD:   0.008800
95.0%   KLD:   0.002900

====== Token probability statistics ======
Same top p: 99.216 ± 0.225 %
"""


def test_llama_kl_statistics_are_read_by_the_names_fidelity_uses():
    values = parse_llama_kl(LLAMA_KL_OUTPUT)
    assert values is not None
    assert values["perplexity"] == 2.8001 and values["reference_perplexity"] == 2.794
    assert values["kl_mean"] == 0.000712 and values["kl_p99"] == 0.0088  # not the 99.9% line
    assert values["top1_agreement"] == pytest.approx(0.99216)
    assert values["perplexity_change"] == pytest.approx(2.8001 / 2.794 - 1)
    assert parse_llama_kl(LLAMA_KL_OUTPUT.replace("Mean    KLD", "Mean KLD?")) is None


def test_llama_cpp_without_llama_quantize_reports_perplexity_and_why_kl_is_missing(tmp_path):
    import argparse
    import stat

    fake = tmp_path / "llama-perplexity"  # a stand-in printing the real tool's final line
    fake.write_text("#!/bin/sh\necho 'Final estimate: PPL = 3.2420 +/- 0.05123'\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    args = argparse.Namespace(ctx=512, chunks=0)
    result = llama_cpp_fidelity(str(fake), tmp_path / "m.gguf", tmp_path / "t.txt", args)
    assert result["perplexity"] == 3.242 and "llama-quantize" in result["kl"]
