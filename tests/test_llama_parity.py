"""A GGUF run as stored computes what llama.cpp computes from the same file.

llama.cpp is the oracle of what a GGUF means: tiny HF models of each family the app offers
(tests/parity_models.py) are converted by llama.cpp's own converter (F32, Q8_0) and
quantizer (Q4_K_M); llama-perplexity writes its log-probabilities of a text; we run the
tokens it ran, chunk by chunk, through `load_model(file, precision="gguf")` and compare at
the positions it scored. Skipped, with the reason, where no llama.cpp build is found
(`make test-parity` builds one).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from llama_cpp_tools import LlamaCpp, find
from llama_logits import BaseLogits, compare, evaluated, read_base, scored
from parity_models import FAMILIES, text, write_folder

from specdec_core.errors import ModelLoadError
from specdec_core.models import gguf_native
from specdec_core.models.gguf_file import read_gguf
from specdec_core.models.loading import load_model

LLAMA_CPP = find()
pytestmark = [
    pytest.mark.skipif(isinstance(LLAMA_CPP, str), reason=str(LLAMA_CPP)),
    pytest.mark.skipif(
        find_spec("sentencepiece") is None, reason="sentencepiece is not installed (pip install -e '.[test]')"
    ),
]

N_CTX, CHUNKS = 128, 4
# What our as-stored path does not yet compute as llama.cpp does, by family: each runs as a
# strict xfail, so the day it lands the suite fails until its line here is removed.
MISSING: dict[str, str] = {}
QUANTIZED = ("Q8_0", "Q4_K_M")
# F32: nothing is rounded but the summation order, so our log-probabilities are llama.cpp's:
# top-1 at 99.5% of positions (up to the base file's rounding of log-probabilities) and a
# mean KL(llama.cpp || ours) of at most 1e-3.
F32_TOP1, F32_KL = 0.995, 1e-3
# A quantized file: llama.cpp also rounds each linear's activations (Q8_0 to Q8_0 blocks of
# 32, the K-quants to Q8_K blocks of 256), where we keep fp32 rows (Q8_0) or round to int8
# per 32 inputs (Q4_K, Q6_K). So the bars are relative to what the file's own rounding moves
# llama.cpp (this file against its F32 file, both run by llama.cpp): our mean KL from
# llama.cpp at most half of that KL, and our top token llama.cpp's at least as often as
# llama.cpp's top token survives the rounding (top-1 flips at near-ties under any rounding).
KL_SHARE_OF_ROUNDING = 0.5
# Against the F32 file, where a quantized file's weights dominate both runs' departure.
ROUNDING_NOISE = 1.05


@dataclass(frozen=True)
class Files:
    folder: Path
    text: Path


@pytest.fixture(scope="session")
def parity_files(tmp_path_factory) -> Files:
    """Every family's GGUF of every type, made once: one converter process for the F32 and
    Q8_0 files, llama-quantize for Q4_K_M from the F32."""
    assert isinstance(LLAMA_CPP, LlamaCpp)
    folder = tmp_path_factory.mktemp("parity")
    jobs = []
    for family in FAMILIES:
        hf = write_folder(family, folder / family)
        jobs += [(hf, "f32", folder / f"{family}.F32.gguf"), (hf, "q8_0", folder / f"{family}.Q8_0.gguf")]
    LLAMA_CPP.convert(jobs)
    for family in FAMILIES:
        LLAMA_CPP.quantize(folder / f"{family}.F32.gguf", folder / f"{family}.Q4_K_M.gguf", "Q4_K_M")
    words = folder / "text.txt"
    words.write_text(text(2000, seed=7))
    return Files(folder, words)


@pytest.fixture(scope="session")
def llama_logits(parity_files) -> Callable[[str, str], BaseLogits]:
    """llama.cpp's log-probabilities of the text under a family's file of a type, run once."""
    assert isinstance(LLAMA_CPP, LlamaCpp)
    done: dict[tuple[str, str], BaseLogits] = {}

    def of(family: str, ftype: str) -> BaseLogits:
        if (family, ftype) not in done:
            out = parity_files.folder / f"{family}.{ftype}.logits"
            LLAMA_CPP.save_logits(gguf_path(parity_files, family, ftype), parity_files.text, out, N_CTX, CHUNKS)
            done[family, ftype] = read_base(out)
        return done[family, ftype]

    return of


def gguf_path(files: Files, family: str, ftype: str) -> Path:
    return files.folder / f"{family}.{ftype}.gguf"


def ours(gguf: Path, base: BaseLogits, cache: Path, monkeypatch, change: Callable[[Any], None] | None = None) -> np.ndarray:
    """Our log-probabilities of the tokens llama.cpp ran, from the same file, at the positions
    it scored. `change`: done to the loaded model first (the tests that show a dropped detail fails)."""
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(cache))
    model = load_model(str(gguf), device="cpu", precision="gguf").model
    if change is not None:
        change(model)
    bos = read_gguf(gguf).fields.get("tokenizer.ggml.bos_token_id")
    with torch.no_grad():
        logits = [model(input_ids=torch.from_numpy(ids.astype(np.int64))[None]).logits[0].float()
                  for ids in evaluated(base, bos)]  # fmt: skip
    return scored(base, logits)


def _missing(family: str) -> pytest.MarkDecorator:
    """Our loader refuses the file or computes something else; llama.cpp failing is an error."""
    return pytest.mark.xfail(strict=True, raises=(ModelLoadError, AssertionError), reason=MISSING[family])


def _cases() -> list:
    return [
        pytest.param(family, ftype, id=f"{family}-{ftype}",
                     marks=[_missing(family)] if family in MISSING else [])
        for family in FAMILIES for ftype in ("F32", *QUANTIZED)
    ]  # fmt: skip


@pytest.mark.parametrize(("family", "ftype"), _cases())
def test_as_stored_computes_what_llama_cpp_computes_from_the_file(
    parity_files, llama_logits, family, ftype, monkeypatch
):
    base = llama_logits(family, ftype)
    assert base.tokens.shape == (CHUNKS, N_CTX)
    mine = ours(gguf_path(parity_files, family, ftype), base, parity_files.folder / "cache", monkeypatch)
    found = compare(base, mine)
    if ftype == "F32":
        print(f"\n{family} {ftype}: ours {found}")
        assert found.top1 >= F32_TOP1 and found.kl_mean <= F32_KL, found
        return
    reference = llama_logits(family, "F32")
    assert np.array_equal(reference.tokens, base.tokens)
    own = compare(reference, base.log_probs)  # llama.cpp's own departure: the file's rounding
    ours_from_f32 = compare(reference, mine)  # ours, from the quantized file, against the F32 file
    print(f"\n{family} {ftype}: ours {found}\n{family} {ftype}: llama.cpp's own against F32 {own}"
          f"\n{family} {ftype}: ours against llama.cpp's F32 {ours_from_f32}")  # fmt: skip
    assert found.kl_mean <= KL_SHARE_OF_ROUNDING * own.kl_mean, (found, own)
    assert found.top1 >= own.top1, (found, own)
    # The file's weights are what the quantized run should compute: ours loses no more to the
    # file's rounding than llama.cpp does (its activations are rounded once more, ours finer or
    # not at all), up to the summation order's noise where the weights' rounding dominates.
    assert ours_from_f32.kl_mean <= ROUNDING_NOISE * own.kl_mean, (ours_from_f32, own)


def _rope_freqs_ignored(monkeypatch) -> Callable[[Any], None]:
    """The rotary frequencies without the file's rope_freqs factors."""

    def plain(model: Any) -> None:
        rotary = model.model.rotary_emb
        dim = 2 * rotary.inv_freq.numel()
        theta = model.config.rope_parameters["rope_theta"]
        rotary.inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)

    return plain


def _rows_in_the_files_order(monkeypatch) -> None:
    """A Llama's q and k rows left in llama.cpp's interleaved rotary order."""
    monkeypatch.setattr(gguf_native, "llama_rows", lambda config: {})


@pytest.mark.parametrize(
    ("family", "drop"),
    [
        pytest.param("llama3-rope", _rope_freqs_ignored, id="rope_freqs-ignored"),
        pytest.param("llama", _rows_in_the_files_order, id="qk-rows-in-the-files-order"),
    ],
)
def test_a_dropped_detail_fails_the_parity(parity_files, llama_logits, family, drop, monkeypatch, tmp_path):
    """The comparison can fail: a detail of what the file means, dropped on purpose, puts our
    F32 run far outside the bars."""
    change = drop(monkeypatch)
    base = llama_logits(family, "F32")
    found = compare(base, ours(gguf_path(parity_files, family, "F32"), base, tmp_path, monkeypatch, change))
    print(f"\n{family} F32, {drop.__name__}: {found}")
    assert found.kl_mean > 100 * F32_KL and found.top1 < F32_TOP1, found
