"""Run by tests/test_attention_triton.py in a process of its own with TRITON_INTERPRET=1 (set
before Triton is imported): the CUDA attention kernel and the fixed-shape step over it, on the
CPU. Prints one JSON object of findings; the test asserts on them."""

from __future__ import annotations

import json
import os
import sys

import torch

assert os.environ.get("TRITON_INTERPRET") == "1"
sys.path.insert(0, os.path.dirname(__file__))

from archs import arch_model  # noqa: E402

from specdec_core.engine.kvcache import CachedModel  # noqa: E402
from specdec_core.engine.static_step import StaticRunner  # noqa: E402
from specdec_core.kernels import attention_triton  # noqa: E402
from specdec_core.kernels.attention_static import BLOCK, masked_reference  # noqa: E402
from specdec_core.kernels.batch_invariant import make_batch_invariant  # noqa: E402

CASES = {"plain": (64, 0, 0.0), "window, head dim 96": (96, 20, 0.0), "softcap": (32, 0, 20.0)}


def kernel(q, k, v, positions, window, softcap):
    out = torch.empty((1, q.shape[2], q.shape[1], q.shape[3]), dtype=q.dtype)
    attention_triton.launch(q, k, v, positions, out, q.shape[3] ** -0.5, window, softcap, BLOCK)
    return out


def kernel_findings() -> dict[str, dict[str, object]]:
    """Per case: the largest difference from the torch reference, and whether a row computed
    again as the only row, over a larger cache holding other values past it, is bitwise equal."""
    gen = torch.Generator().manual_seed(0)
    found = {}
    for name, (dim, window, softcap) in CASES.items():
        q = torch.randn(1, 4, 5, dim, generator=gen)
        k, v = torch.randn(2, 1, 2, 100, dim, generator=gen)  # two KV heads: grouped queries
        positions = torch.arange(60, 65)
        rows = kernel(q, k, v, positions, window, softcap)
        ref = masked_reference(q, k, v, positions, dim**-0.5, window or None, softcap or None)
        k2, v2 = torch.randn(2, 1, 2, 200, dim, generator=gen)
        k2[:, :, :63], v2[:, :, :63] = k[:, :, :63], v[:, :, :63]
        alone = kernel(q[:, :, 2:3].contiguous(), k2, v2, torch.tensor([62]), window, softcap)
        found[name] = {
            "diff": (rows - ref).abs().max().item(),
            "row_alone_equal": torch.equal(alone[0, 0], rows[0, 2]),
        }
    return found


def runner_findings() -> dict[str, dict[str, object]]:
    """Per family: the step's logits against the model's own (CachedModel), and a verify's rows
    against plain steps, bitwise."""
    ids = torch.randint(1, 128, (30,), generator=torch.Generator().manual_seed(0)).tolist()
    found = {}
    for arch in ("qwen2-swa", "gemma2", "phi3"):
        reference = arch_model(arch, 128)
        make_batch_invariant(reference)
        runner = StaticRunner(arch_model(arch, 128), rows=(4,), capacity=8)
        verify = runner.forward(ids, 10)
        runner.crop(24)
        steps = torch.cat([runner.forward([t], 1) for t in ids[24:]])
        found[arch] = {
            "diff": (verify - CachedModel(reference).forward(ids, 10)).abs().max().item(),
            "steps_equal_verify": torch.equal(steps, verify[-6:]),
        }
    return found


print(json.dumps({"kernel": kernel_findings(), "runner": runner_findings()}))
