"""The fixed-shape step (static_step.py): the CUDA step's code, checked on the CPU where it runs eagerly.

Small row counts and capacities here, so chunks, padding and cache growth all happen
within a few tokens; every family runs past its 16-token sliding window.
"""

from __future__ import annotations

import pytest
import torch
from archs import ARCHS, arch_model
from kernel_references import masked_reference
from test_conformance import accepted_by_every_drafter, drafters
from test_sampling_exactness import SAMPLES, VOCAB, chi_square_pvalue, tiny_vocab_tokenizer
from tiny import perturbed, tiny_model
from transformers import AttentionInterface

from specdec_core.engine.drafters import ModelDrafter, NoDrafter
from specdec_core.engine.sampling import SamplingParams
from specdec_core.engine.selfcheck import check_exactness
from specdec_core.engine.speculative import GenerationParams, SpeculativeEngine
from specdec_core.errors import NumericalError
from specdec_core.kernels.batch_invariant import make_batch_invariant
from specdec_core.kernels.cpu.runner import CachedModel
from specdec_core.kernels.cuda import attention_static
from specdec_core.kernels.cuda.static_step import StaticRunner, static_refusal
from specdec_core.kernels.dispatch import runner_for, step_label

PROMPT = "def add(a, b):\n    return a + b\n\nfor i in range(10):\n    print(i * i)\n"


def random_ids(count: int, vocab: int, seed: int = 0) -> list[int]:
    return torch.randint(1, vocab, (count,), generator=torch.Generator().manual_seed(seed)).tolist()


def static_drafters(draft_model) -> dict[str, object]:
    """test_conformance's drafters, each model drafter over its own fixed-shape runner."""
    found = drafters(draft_model)
    for drafter in found.values():
        model = getattr(drafter, "model", drafter)
        if isinstance(model, ModelDrafter):
            model.runner = StaticRunner(model.runner.model, rows=(1, 4), capacity=8)
    return found


@pytest.mark.parametrize("arch", list(ARCHS))
def test_the_fixed_shape_step_computes_the_models_own_logits(arch):
    reference = CachedModel(make_invariant(arch_model(arch, 128)))
    runner = StaticRunner(make_invariant(arch_model(arch, 128)), rows=(4,), capacity=8)
    ids = random_ids(40, 128)
    close = dict(atol=1e-4, rtol=1e-4)  # fp32 sums in another order, not another function
    torch.testing.assert_close(runner.forward(ids[:30], 30), reference.forward(ids[:30], 30), **close)
    reference.crop(25)
    runner.crop(25)  # a rollback, then steps and a verify past the window and two growths
    expected = torch.cat([reference.forward([t], 1) for t in ids[25:]])
    torch.testing.assert_close(torch.cat([runner.forward([t], 1) for t in ids[25:]]), expected, **close)
    assert runner.capacity >= 40


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", list(ARCHS))
def test_a_verify_in_the_fixed_shape_step_is_bitwise_its_plain_steps(arch, dtype):
    runner = StaticRunner(arch_model(arch, 128, dtype=dtype), rows=(4,), capacity=8)
    ids = random_ids(40, 128, seed=1)
    runner.forward(ids[:20], 1)
    verify = runner.forward(ids[20:], 20)  # five chunks of four rows
    runner.crop(20)
    steps = torch.cat([runner.forward([t], 1) for t in ids[20:]])
    assert torch.equal(verify, steps)
    runner.reset()
    runner.forward(ids[:23], 1)  # the same positions reached through other chunk borders
    assert torch.equal(runner.forward(ids[23:], 17), steps[3:])


@pytest.mark.parametrize("arch", list(ARCHS))
def test_every_drafter_over_the_fixed_shape_step_gives_the_target_alones_tokens(tokenizer, arch):
    target = arch_model(arch, len(tokenizer))
    draft = perturbed(arch_model(arch, len(tokenizer)), 0.05)
    engine = SpeculativeEngine(
        target, tokenizer, NoDrafter(), runner=StaticRunner(target, rows=(4,), capacity=8)
    )
    prompt = tokenizer(PROMPT)["input_ids"]
    params = GenerationParams(max_new_tokens=40, draft_length=3)
    alone = list(list(engine.generate(prompt, params))[-1].token_ids)
    assert accepted_by_every_drafter(engine, draft, prompt, params, alone, make=static_drafters) > 0
    # Drafters over the CPU's own runner, on models the fixed-shape step has taken over.
    assert accepted_by_every_drafter(engine, draft, prompt, params, alone) > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_self_check_measures_the_fixed_shape_step_bitwise(tokenizer, dtype):
    target = arch_model("qwen2", len(tokenizer), dtype=dtype)
    engine = SpeculativeEngine(target, tokenizer, runner=StaticRunner(target, rows=(16,), capacity=16))
    report = check_exactness(engine, context_tokens=40)  # a 17-row verify: two chunks
    assert report.bitwise, report.summary()


def test_a_long_prompt_is_read_in_chunks_over_the_fixed_shape_step(tokenizer):
    target = arch_model("qwen2", len(tokenizer))
    engine = SpeculativeEngine(target, tokenizer, runner=StaticRunner(target, rows=(4,), capacity=8))
    engine.prefill_chunk = 8
    prompt = tokenizer(PROMPT * 2)["input_ids"]
    events = list(engine.generate(prompt, GenerationParams(max_new_tokens=4)))
    assert sum(type(e).__name__ == "ReadingEvent" for e in events) >= 3


def test_sampling_over_the_fixed_shape_step_keeps_the_target_distribution():
    """As test_sampling_exactness's engine test: (x1, x2) of three new tokens, first verify k = 2."""
    target = tiny_model(VOCAB, seed=3, layers=1, hidden=32)
    with torch.no_grad():
        p1 = torch.softmax(target(torch.tensor([[1, 2, 3]])).logits[0, -1], -1)
        p2 = torch.stack(
            [torch.softmax(target(torch.tensor([[1, 2, 3, t]])).logits[0, -1], -1) for t in range(VOCAB)]
        )
    draft = ModelDrafter(perturbed(target, 0.5, seed=4), "perturbed")
    draft.runner = StaticRunner(draft.runner.model, rows=(1, 4), capacity=8)
    engine = SpeculativeEngine(
        target, tiny_vocab_tokenizer(), draft, runner=StaticRunner(target, rows=(4,), capacity=8)
    )
    samples, accepted = [], 0
    for seed in range(SAMPLES):
        params = GenerationParams(max_new_tokens=3, temperature=1.0, draft_length=3, seed=seed)
        done = list(engine.generate([1, 2, 3], params))[-1]
        samples.append(done.token_ids[0] * VOCAB + done.token_ids[1])
        accepted += done.stats.accepted
    joint = (p1[:, None] * p2).flatten().numpy()
    assert accepted > SAMPLES // 5
    assert chi_square_pvalue(samples, joint / joint.sum()) > 1e-3
    assert SamplingParams(temperature=1.0).probs(p1.log()).sum() == pytest.approx(1.0)


def test_the_fixed_shape_step_traces_as_one_graph_with_no_host_sync(monkeypatch):
    """A CUDA graph cannot hold a host sync or a Python branch on device values; neither can a
    full-graph trace, which runs on the CPU. Attention there is the CUDA kernel's rule in torch
    (the kernel itself reads the positions on the device); the CPU's own path cuts the keys
    at a position read on the host, which only an eager step may do."""

    def on_device(
        module,
        query,
        key,
        value,
        attention_mask,
        dropout=0.0,
        scaling=None,
        sliding_window=None,
        softcap=None,
        **kw,
    ):
        positions = attention_mask.reshape(-1)
        return masked_reference(query, key, value, positions, scaling, sliding_window, softcap), None

    monkeypatch.setitem(AttentionInterface._global_mapping, attention_static.NAME, on_device)
    for arch in ("qwen2-swa", "gemma2", "mistral"):
        runner = StaticRunner(arch_model(arch, 128), rows=(4,), capacity=16)
        runner.forward([1, 2, 3, 4, 5], 1)
        shape = runner._shapes[4]
        traced = torch.compile(runner._run, fullgraph=True, backend="eager")
        with torch.inference_mode():
            assert traced(shape).shape == (1, 4, 128)


def test_the_cpu_keeps_its_own_runner_and_the_step_refuses_what_it_cannot_run():
    model = arch_model("qwen2", 128)
    assert type(runner_for(model)) is CachedModel  # the CPU's kernels are row-wise already
    assert static_refusal(model) is None
    model.config.layer_types = ["full_attention", "linear_attention"]
    assert static_refusal(model) == "its linear_attention layers"
    with pytest.raises(ValueError, match="cannot run this model: its linear_attention layers"):
        StaticRunner(model)


def test_a_failed_capture_leaves_the_step_eager_and_says_why(caplog):
    runner = StaticRunner(arch_model("qwen2", 128), rows=(4,), capacity=8)
    runner.graphs = True  # on the CPU the capture itself fails: there is no CUDA stream
    ids = random_ids(10, 128)
    expected = StaticRunner(arch_model("qwen2", 128), rows=(4,), capacity=8).forward(ids, 10)
    assert torch.equal(runner.forward(ids, 10), expected)
    assert not runner.graphs and runner.graphs_off.startswith("CUDA graph capture failed: ")
    assert "runs eagerly" in caplog.text
    assert step_label(runner).startswith("fixed-shape step (4 rows, eager: CUDA graph capture failed")


def test_a_warmed_up_step_starts_empty_and_computes_what_a_fresh_one_does():
    runner = StaticRunner(arch_model("qwen2", 128), rows=(1, 4), capacity=8)
    runner.warm_up()
    assert runner.ids == [] and set(runner._shapes) == {1, 4}  # every row count has run once
    ids = random_ids(10, 128)
    fresh = StaticRunner(arch_model("qwen2", 128), rows=(1, 4), capacity=8)
    assert torch.equal(runner.forward(ids, 10), fresh.forward(ids, 10))


def test_the_step_label_says_how_forwards_run():
    model = arch_model("qwen2", 128)
    assert step_label(CachedModel(model)) == ""  # the CPU's own runner needs no word
    runner = StaticRunner(model, rows=(1, 4), capacity=8)
    assert step_label(runner) == "fixed-shape step (4 rows, eager: not on CUDA)"


def test_bad_input_and_overflow_are_one_line_errors_that_lose_nothing():
    runner = StaticRunner(arch_model("qwen2", 128), rows=(4,), capacity=8)
    with pytest.raises(ValueError, match="at least one token"):
        runner.forward([], 1)
    runner.forward([1, 2, 3], 1)
    with torch.no_grad():
        runner.model.lm_head.weight[0] = float("nan")
    with pytest.raises(NumericalError, match="inf/NaN logits"):
        runner.forward([4], 1)
    assert runner.ids == []  # the next forward re-feeds the sequence


def make_invariant(model):
    make_batch_invariant(model)
    return model
