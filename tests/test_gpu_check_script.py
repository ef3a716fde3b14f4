"""scripts/gpu-check runs where it is needed only on a lent GPU, so its tiny CPU form is
run here: a broken script would otherwise be found with the device time already spent."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "gpu-check"


def test_the_gpu_check_runs_end_to_end_on_tiny_cpu_models(tmp_path):
    out = tmp_path / "check.json"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--cpu-smoke", "--precisions", "bf16", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads(out.read_text())
    rows = results["conformance"]
    assert {(r["model"], r["mode"]) for r in rows} == {
        (model, mode) for model in ("qwen2.5-0.5b", "mistral-sw48") for mode in ("own", "loaded")
    }
    loaded = [r for r in rows if r["mode"] == "loaded"]
    assert all(r["identity_ngram"] == r["identity_self"] == 1.0 for r in loaded)
    assert all(r["selfcheck"] == r["selfcheck_160"] == "bitwise" for r in loaded)
    assert len(results["cost_curve"]["own_ms"]) == 16  # verifies of 1..16 tokens timed
