"""`specdec bench` end to end on tiny models: every method runs, the JSON has the
promised schema, our methods reproduce the target's tokens, the files are written."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from specdec_core.bench import METHODS, BenchPrompt, first_divergence, geomean, load_prompts
from specdec_core.cli import main
from specdec_core.errors import SpecdecError
from tests.tiny import perturbed, tiny_model, tiny_tokenizer

PROMPTS = [
    {"id": "code", "category": "code-write", "prompt": "def add(a, b):\n    return a + b\n"},
    {
        "id": "follow-up",
        "category": "multi-turn",
        "system": "Be brief.",
        "history": [
            {"role": "user", "content": "for i in range(10):"},
            {"role": "assistant", "content": "print(i * i)"},
        ],
        "prompt": "The quick brown fox",
    },
]


@pytest.fixture(scope="module")
def pair_dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A tiny target and an exact copy as its draft, saved as HF folders.

    The copy makes every proposed token acceptable; k is pinned (a same-size draft is
    not worth drafting with, so adaptive k would rightly propose nothing).
    """
    root = tmp_path_factory.mktemp("bench-models")
    tok = tiny_tokenizer()
    target = tiny_model(len(tok), seed=0)
    target.generation_config.repetition_penalty = 1.3  # a shipped default bench must not apply
    draft = perturbed(target, scale=0.0)
    for name, model in (("target", target), ("draft", draft)):
        model.save_pretrained(root / name)
        tok.save_pretrained(root / name)
    return root / "target", root / "draft"


@pytest.fixture(scope="module")
def report(pair_dirs: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    target, draft = pair_dirs
    # One thread: tiny matmuls gain nothing from two, and on a busy machine an OpenMP
    # barrier waiting for a descheduled thread costs ~10 ms a call (measured).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("bench-out")
    prompts = out / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps(p) for p in PROMPTS) + "\n")
    code = main(
        [
            "bench",
            "--target",
            str(target),
            "--draft",
            str(draft),
            "--device",
            "cpu",
            "--precision",
            "fp32",
            "--prompts",
            str(prompts),
            "--max-new-tokens",
            "16",
            "--repeats",
            "2",
            "--draft-length",
            "3",
            "--warmup-tokens",
            "4",
            "--json",
            str(out / "bench.json"),
            "--markdown",
            str(out / "bench.md"),
            "--plot",
            str(out / "bench.png"),
        ]
    )
    torch.set_num_threads(threads)
    assert code == 0
    doc = json.loads((out / "bench.json").read_text())
    doc["_out"] = str(out)
    yield doc


def test_every_method_runs_on_every_prompt(report: dict) -> None:
    pairs = {(r["prompt_id"], r["method"]) for r in report["results"]}
    assert pairs == {(p["id"], m) for p in PROMPTS for m in METHODS}
    assert report["config"]["methods"] == list(METHODS)


def test_json_has_the_promised_schema(report: dict) -> None:
    assert set(report) >= {"config", "machine", "results", "summary"}
    for r in report["results"]:
        for key in (
            "prompt_id",
            "category",
            "method",
            "new_tokens",
            "seconds",
            "tokens_per_s",
            "speedup_vs_target",
            "identical_to_target",
            "first_divergence",
        ):
            assert key in r
        assert r["new_tokens"] > 0 and r["seconds"] > 0 and len(r["seconds_all"]) == 2
        if r["method"] == "target":
            assert r["speedup_vs_target"] == pytest.approx(1.0)
        if r["method"].startswith("ours-") and r["method"] != "ours-off":
            e = r["engine"]
            assert 0.0 <= e["acceptance_rate"] <= 1.0
            assert e["theoretical_speedup"] > 0 and "k_histogram" in e
    summary = report["summary"]["methods"]
    assert set(summary) == set(METHODS)
    assert set(summary["ours-draft"]) == {"all", "code-write", "multi-turn"}
    assert {t["name"] for t in report["summary"]["targets"]} >= {"ours-draft vs hf-assisted"}


def test_our_methods_reproduce_the_target_exactly(report: dict) -> None:
    ours = [r for r in report["results"] if r["method"].startswith("ours-")]
    assert ours and all(r["identical_to_target"] for r in ours)
    assert report["summary"]["methods"]["ours-draft"]["all"]["identity_rate"] == 1.0


def test_an_exact_copy_draft_has_every_proposal_accepted(report: dict) -> None:
    draft = [r["engine"] for r in report["results"] if r["method"] == "ours-draft"]
    assert all(e["mean_k"] > 0 and e["acceptance_rate"] == 1.0 for e in draft)


def test_markdown_and_plot_are_written(report: dict) -> None:
    out = Path(report["_out"])
    text = (out / "bench.md").read_text()
    assert "| ours-draft |" in text and "Targets" in text and "follow-up" in text
    assert (out / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_default_suite_covers_the_issue_categories() -> None:
    prompts = load_prompts()
    assert len(prompts) >= 16
    assert {p.category for p in prompts} >= {
        "code-write",
        "code-edit",
        "summarise",
        "prose",
        "factual-qa",
        "arithmetic",
        "multi-turn",
    }
    assert any(p.history for p in prompts)


def test_bad_prompt_line_names_the_line(tmp_path: Path) -> None:
    bad = tmp_path / "p.jsonl"
    bad.write_text('{"id": "a", "category": "x", "prompt": "hi"}\n{"id": "b"}\n')
    with pytest.raises(SpecdecError, match="line 2"):
        load_prompts(bad)


def test_first_divergence_and_geomean() -> None:
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 9, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2
    assert geomean([2.0, 0.5]) == pytest.approx(1.0)
    assert BenchPrompt("a", "c", "hi").messages[-1].content == "hi"


def test_a_saved_run_renders_again_without_models(report: dict, tmp_path: Path) -> None:
    out = tmp_path / "again.md"
    code = main(["bench", "--from-json", str(Path(report["_out"]) / "bench.json"), "--markdown", str(out)])
    assert code == 0
    assert out.read_text() == (Path(report["_out"]) / "bench.md").read_text()


def test_cost_curve_times_every_size(pair_dirs: tuple[Path, Path], tmp_path: Path) -> None:
    target, draft = pair_dirs
    out = tmp_path / "curve.json"
    args = ["bench", "--target", str(target), "--draft", str(draft), "--precision", "fp32"]
    assert main([*args, "--cost-curve", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert set(doc["target_min"]) == {"1", "2", "3", "4", "5", "6", "8", "10", "12", "16"}
    assert doc["draft_min"] > 0
