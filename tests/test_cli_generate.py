"""`specdec generate --json` reproduces transformers' greedy decoding, and fails in one line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from tiny import hf_greedy, tiny_model, tiny_tokenizer

from specdec_core.tools.cli import main


def generate_json(capsys, *args: str) -> dict:
    assert main(["generate", *args, "--json", "--precision", "fp32", "--device", "cpu"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("draft", ["same", "sibling", "ngram", "none"])
def test_generate_json_reproduces_transformers_greedy(capsys, tiny_folder, sibling_folder, target, draft):
    draft_ref = {"same": str(tiny_folder), "sibling": str(sibling_folder)}.get(draft, draft)
    doc = generate_json(
        capsys,
        "--target",
        str(tiny_folder),
        "--draft",
        draft_ref,
        "--prompt",
        "Write a loop.",
        "--max-new-tokens",
        "24",
    )
    ids = [t["id"] for t in doc["tokens"]]
    expected = hf_greedy(target, doc["prompt_token_ids"], 24, eos=[2, 0])
    assert ids == expected
    assert doc["text"] == "".join(t["text"] for t in doc["tokens"]) or "\ufffd" in doc["text"]
    assert {t["source"] for t in doc["tokens"]} <= {"accepted", "corrected", "bonus", "target"}
    assert doc["stats"]["new_tokens"] == len(ids)


def test_generate_streams_text_without_json(capsys, tiny_folder):
    code = main(
        [
            "generate",
            "--target",
            str(tiny_folder),
            "--draft",
            "none",
            "--prompt",
            "hi",
            "--max-new-tokens",
            "5",
        ]
    )
    assert code == 0
    captured = capsys.readouterr()
    assert captured.out.endswith("\n")
    assert "tok/s" in captured.err
    assert "specdec: exactness: bitwise" in captured.err or "near-ties may differ" in captured.err


def one_line_error(capsys, *args: str) -> str:
    assert main(["generate", "--prompt", "hi", "--device", "cpu", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]  # earlier lines: load progress
    assert err.startswith("specdec: error: ")
    assert "\n" not in err and "Traceback" not in err
    return err


def test_missing_path_is_one_line(capsys, tmp_path):
    assert "not found" in one_line_error(capsys, "--target", str(tmp_path / "nope"))


def test_incompatible_draft_is_refused_with_its_reason(capsys, tmp_path, tiny_folder):
    other_tok = tiny_tokenizer(vocab_size=300, extra="a different corpus makes different merges entirely")
    folder = tmp_path / "other"
    tiny_model(len(other_tok)).save_pretrained(folder)
    other_tok.save_pretrained(folder)
    err = one_line_error(capsys, "--target", str(tiny_folder), "--draft", str(folder))
    assert "does not fit" in err


def test_cuda_asked_but_absent_is_one_line(capsys, tiny_folder):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert "CUDA" in one_line_error(capsys, "--target", str(tiny_folder), "--device", "cuda")


def test_not_a_causal_lm_is_one_line(capsys, tmp_path, tokenizer):
    from transformers import T5Config, T5Model

    folder = tmp_path / "t5"
    T5Model(T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=2)).save_pretrained(
        folder
    )
    tokenizer.save_pretrained(folder)
    assert "not a causal language model" in one_line_error(capsys, "--target", str(folder))


def test_tokenizer_larger_than_the_embeddings_is_one_line(capsys, tmp_path, tokenizer):
    folder = tmp_path / "small-embeddings"
    tiny_model(64).save_pretrained(folder)  # 64 rows, but the tokenizer has 320 tokens
    tokenizer.save_pretrained(folder)
    assert "embeds only 64" in one_line_error(capsys, "--target", str(folder))


def test_console_script_runs_in_a_fresh_process(tiny_folder):
    script = Path(sys.executable).parent / "specdec"
    cmd = [
        str(script),
        "generate",
        "--target",
        str(tiny_folder),
        "--draft",
        "ngram",
        "--prompt",
        "x",
        "--json",
    ]
    out = subprocess.run(
        [*cmd, "--max-new-tokens", "4", "--precision", "fp32"], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    assert len(json.loads(out.stdout)["tokens"]) == 4


@pytest.fixture(scope="module")
def stops_at_once_folder(tmp_path_factory, tokenizer, target) -> Path:
    """The target with its final norm zeroed: all logits tie at 0, so greedy picks id 0,
    <|endoftext|>, a stop token — the answer is just the stop token."""
    import copy

    import torch

    model = copy.deepcopy(target)
    with torch.no_grad():
        model.model.norm.weight.zero_()
    folder = tmp_path_factory.mktemp("stops-at-once")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_stop_tokens_are_never_printed(capsys, stops_at_once_folder):
    args = ["generate", "--target", str(stops_at_once_folder), "--prompt", "hi", "--draft", "none"]
    assert main([*args, "--precision", "fp32", "--device", "cpu"]) == 0
    assert capsys.readouterr().out == "\n"
    doc = generate_json(capsys, *args[1:])
    assert [t["id"] for t in doc["tokens"]] == [0]
    assert doc["text"] == "" and doc["stats"]["stop_reason"] == "eos"


def test_json_stats_carry_the_exactness_label(capsys, tiny_folder):
    doc = generate_json(capsys, "--target", str(tiny_folder), "--prompt", "hi", "--max-new-tokens", "3")
    assert doc["stats"]["exactness"] in ("bitwise", "near-ties may differ", "unchecked")
