"""The CUDA kernels, run on the CPU by Triton's interpreter.

Attention (kernels/cuda/attention_triton.py) must compute attention (the torch reference within
fp32 rounding) by the rule that makes the fixed-shape step batch-invariant: a row's numbers
depend on its position and the keys up to it only, not on the capacity, its row among others
or the slots past it. The nf4 row kernel (kernels/cuda/nf4_triton.py) must multiply by exactly
bitsandbytes' weights, without dequantizing them whole."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None or importlib.util.find_spec("bitsandbytes") is None,
    reason="Triton or bitsandbytes is not installed",
)
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


def test_the_nf4_kernel_multiplies_by_exactly_bitsandbytes_weights(findings):
    assert set(findings["nf4"]["linears"]) == {
        f"torch.{dtype} nested={nested}" for dtype in ("bfloat16", "float16") for nested in (True, False)
    }
    for case in findings["nf4"]["linears"].values():
        assert case["weights_equal"]
        assert case["diff"] <= 0.01 * case["scale"]  # the output's own rounding
        assert case["row_alone_diff"] <= 0.01 * case["scale"]


def test_nf4_layouts_the_kernel_does_not_read_keep_the_dequantizing_path(findings):
    assert findings["nf4"]["refused"] == {
        "blocks of 128": "nf4 in blocks of 128",
        "96 inputs": "96 inputs, not whole blocks",
    }


def test_the_fixed_shape_step_over_nf4_rows_is_the_models_function_and_bitwise(findings):
    model = findings["nf4_model"]
    assert model["swapped"] == 2 * 7  # q, k, v, o, gate, up, down in each of two layers
    assert model["swapped_again"] == 0
    # Against the same weights in fp32: no further off than bitsandbytes' own dequantizing forward.
    assert model["error"] <= 1.5 * model["dequantizing_error"]
    assert model["steps_equal_verify"]
