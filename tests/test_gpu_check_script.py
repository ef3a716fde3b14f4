"""scripts/gpu-check runs where it is needed only on a lent GPU, so its tiny CPU form is
run here: a broken script would otherwise be found with the device time already spent.
Every part must leave its figures (or, for the CUDA-only ones, a recorded reason): a part
that silently disappears fails here. No wall-clock figure is asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "gpu-check"
PAIRS = ("7b-nf4", "1.5b-bf16")
CUDA_ONLY = {"hf-compiled-7b-nf4", "hf-compiled-1.5b-bf16", "torchao"}
WIDTHS = 16


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("gpu-check") / "check.json"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--cpu-smoke", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(out.read_text())


def test_every_part_of_the_check_is_recorded(results):
    expected = {"bandwidth", "draft", "sampling", *CUDA_ONLY}
    expected |= {f"{part}-{pair}" for part in ("costs", "hf-eager", "hf-assisted") for pair in PAIRS}
    expected |= {f"identity-{p}" for p in ("bf16", "fp16", "nf4")}
    assert set(results["parts"]) == expected
    for name, entry in results["parts"].items():
        wanted = "skipped" if name in CUDA_ONLY else "done"
        assert entry["status"] == wanted, (name, entry.get("why"))
    assert all(results["parts"][name]["why"] for name in CUDA_ONLY)


def test_costs_hold_the_bound_the_curves_and_what_r_costs(results):
    parts = results["parts"]
    assert parts["bandwidth"]["gb_s"] > 0
    for pair in PAIRS:
        costs = parts[f"costs-{pair}"]
        assert costs["bytes_read"] > 0 and costs["bound_ms"] > 0
        assert len(costs["static_ms"]) == len(costs["cached_model_ms"]) == WIDTHS
        assert costs["static_r1_plain_ms"] > 0
        eager = parts[f"hf-eager-{pair}"]
        assert eager["ms_per_token"] > 0 and eager["draft_ms"] > 0 and len(eager["verify_ms"]) == WIDTHS
        assert parts[f"hf-assisted-{pair}"]["ms_per_token"] > 0
    assert parts["draft"]["static_ms"] > 0 and parts["draft"]["cached_model_ms"] > 0


def test_speculation_keeps_the_targets_tokens_at_every_width_and_precision(results):
    for precision in ("bf16", "fp16", "nf4"):
        entry = results["parts"][f"identity-{precision}"]
        for drafter in ("model", "ngram"):
            assert entry[drafter]["runs"] == 30  # k = 1..15, two prompts
            assert entry[drafter]["identity"] == 1.0, (precision, drafter, entry[drafter])
        assert entry["model"]["acceptance"] == 1.0  # drafting for itself: every width is verified
        assert entry["selfcheck"] == "bitwise"
    assert 0.0 <= results["parts"]["sampling"]["p_value"] <= 1.0


def test_the_summary_projects_each_pair_against_every_baseline(results):
    for pair in PAIRS:
        row = results["summary"][pair]
        assert "missing" not in row, row
        for figure in ("plain_over_bound", "r16_over_r1", "verify9_over_plain", "draft_over_target_step",
                       "vs_hf_eager", "vs_hf_assisted", "vs_hf_assisted_ceiling", "speedup_if_all_accepted"):  # fmt: skip
            assert row[figure] > 0, figure
        assert row["projected"]["speedup"] > 0 and 0 <= row["projected"]["k"] <= WIDTHS - 1
