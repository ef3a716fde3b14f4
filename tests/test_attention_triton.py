"""The CUDA attention kernel (kernels/attention_triton.py), run on the CPU by Triton's interpreter.

The kernel must compute attention (the torch reference within fp32 rounding) by the rule
that makes the fixed-shape step batch-invariant: a row's numbers depend on its position and
the keys up to it only, not on the capacity, its row among others or the slots past it."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
SCRIPT = Path(__file__).with_name("triton_interpreted.py")


@pytest.fixture(scope="module")
def findings() -> dict:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_kernel_computes_attention_with_windows_softcaps_and_grouped_heads(findings):
    assert set(findings["kernel"]) == {"plain", "window, head dim 96", "softcap"}
    for case in findings["kernel"].values():
        assert case["diff"] < 1e-5


def test_a_row_of_the_kernel_depends_on_its_prefix_only(findings):
    assert all(case["row_alone_equal"] for case in findings["kernel"].values())


def test_the_fixed_shape_step_over_the_kernel_computes_the_models_logits(findings):
    assert set(findings["runner"]) == {"qwen2-swa", "gemma2", "phi3"}
    for family in findings["runner"].values():
        assert family["diff"] < 1e-4


def test_the_fixed_shape_step_over_the_kernel_is_bitwise_across_steps_and_verifies(findings):
    assert all(family["steps_equal_verify"] for family in findings["runner"].values())
