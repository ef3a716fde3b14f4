"""Run by tests/test_triton_kernels.py in a process of its own with TRITON_INTERPRET=1 (set
before Triton is imported): the CUDA kernels (attention, nf4 rows) and the fixed-shape step over
them, on the CPU. Prints one JSON object of findings; the tests assert on them."""

from __future__ import annotations

import json
import os
import sys

import torch

assert os.environ.get("TRITON_INTERPRET") == "1"
sys.path.insert(0, os.path.dirname(__file__))

from archs import arch_model  # noqa: E402
from kernel_references import masked_reference, reference  # noqa: E402

from specdec_core.kernels.batch_invariant import dequantize_bnb, make_batch_invariant  # noqa: E402
from specdec_core.kernels.cpu.runner import CachedModel  # noqa: E402
from specdec_core.kernels.cuda import attention_triton  # noqa: E402
from specdec_core.kernels.cuda.attention_static import BLOCK  # noqa: E402
from specdec_core.kernels.cuda.nf4_rows import row_kernel_refusal, use_row_kernels  # noqa: E402
from specdec_core.kernels.cuda.static_step import StaticRunner  # noqa: E402

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


def nf4_linear(linear: torch.nn.Linear, dtype: torch.dtype, nested: bool = True, blocksize: int = 64):
    """A bitsandbytes nf4 copy of `linear`, quantized on the CPU."""
    import bitsandbytes as bnb

    quantized = bnb.nn.Linear4bit(
        linear.in_features,
        linear.out_features,
        bias=linear.bias is not None,
        compute_dtype=dtype,
        quant_type="nf4",
        compress_statistics=nested,
    )
    kind = dict(quant_type="nf4", compress_statistics=nested, blocksize=blocksize)
    quantized.weight = bnb.nn.Params4bit(linear.weight.data.to(dtype), requires_grad=False, **kind)
    if linear.bias is not None:
        quantized.bias = torch.nn.Parameter(linear.bias.data.to(dtype), requires_grad=False)
    return quantized.to("cpu")


def nf4_findings() -> dict[str, dict[str, object]]:
    """Per activation dtype and absmax form: the kernel's weights against bitsandbytes'
    dequantization (one-hot rows, bitwise), its output against the reference, and a row
    alone against the same row among 16."""
    torch.manual_seed(0)
    found = {}
    for dtype in (torch.bfloat16, torch.float16):
        for nested in (True, False):
            module = nf4_linear(torch.nn.Linear(256, 96), dtype, nested)
            x = torch.randn(16, 256, dtype=dtype)
            expected = reference(module, x) + module.bias
            assert use_row_kernels(torch.nn.Sequential(module)) == 1
            out = module(x)
            alone = module(x[5:6])
            module.bias = None
            weights = module(torch.eye(256, dtype=dtype)[:16])  # rows of W^T, exactly
            found[f"{dtype} nested={nested}"] = {
                "weights_equal": torch.equal(weights, dequantize_bnb(module).to(dtype)[:, :16].T),
                "diff": (out.float() - expected.float()).abs().max().item(),
                "scale": expected.float().abs().max().item(),
                "row_alone_diff": (alone[0].float() - out[5].float()).abs().max().item(),
            }
    refused = {
        "blocks of 128": row_kernel_refusal(
            nf4_linear(torch.nn.Linear(256, 32), torch.bfloat16, blocksize=128)
        ),
        "96 inputs": row_kernel_refusal(nf4_linear(torch.nn.Linear(96, 32), torch.bfloat16)),
    }
    return {"linears": found, "refused": refused}


def nf4_model_findings() -> dict[str, object]:
    """A tiny bf16 Qwen2 with nf4 decoder linears: the fixed-shape step over both kernels and the
    model's own dequantizing forward, each against the same weights in fp32; and a verify
    against plain steps, bitwise."""
    ids = torch.randint(1, 128, (30,), generator=torch.Generator().manual_seed(0)).tolist()
    dequantizing, model = nf4_model(), nf4_model()
    truth = fp32_copy(dequantizing)
    make_batch_invariant(dequantizing)
    make_batch_invariant(model)  # as the loader leaves every model
    runner = StaticRunner(model, rows=(4,), capacity=8)  # swaps the nf4 linears to the row kernel
    swapped = runner.nf4_row_kernels
    swapped_again = StaticRunner(model, rows=(1, 4)).nf4_row_kernels  # a second runner: self-drafting
    verify = runner.forward(ids, 10)
    runner.crop(24)
    steps = torch.cat([runner.forward([t], 1) for t in ids[24:]])
    exact = CachedModel(truth).forward(ids, 10)
    return {
        "swapped": swapped,
        "swapped_again": swapped_again,
        "error": (verify - exact).abs().max().item(),
        "dequantizing_error": (CachedModel(dequantizing).forward(ids, 10) - exact).abs().max().item(),
        "steps_equal_verify": torch.equal(steps, verify[-6:]),
    }


def nf4_model() -> torch.nn.Module:
    model = arch_model("qwen2", 128, dtype=torch.bfloat16)
    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, child in list(parent.named_children()):
                if isinstance(child, torch.nn.Linear):
                    setattr(parent, name, nf4_linear(child, torch.bfloat16))
    return model


def fp32_copy(model: torch.nn.Module) -> torch.nn.Module:
    """The same model in fp32, its nf4 linears as plain linears over bitsandbytes' weights."""
    truth = arch_model("qwen2", 128)
    shapes = {k: v.shape for k, v in truth.state_dict().items()}
    same = {k: v.float() for k, v in model.state_dict().items() if shapes.get(k) == v.shape}
    truth.load_state_dict(same, strict=False)  # embeddings, norms, biases, the head
    for module, plain in zip(model.modules(), truth.modules(), strict=True):
        if type(module).__name__ == "Linear4bit":
            plain.weight.data = dequantize_bnb(module).float()
            if module.bias is not None:
                plain.bias.data = module.bias.float()
    return truth


print(
    json.dumps(
        {
            "kernel": kernel_findings(),
            "runner": runner_findings(),
            "nf4": nf4_findings(),
            "nf4_model": nf4_model_findings(),
        }
    )
)
