"""A draft with 4-bit steps: faster draft forwards, and the answer still the target's."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from tiny import hf_greedy, tiny_model
from transformers import DynamicCache

from specdec_core.engine.drafters import ModelDrafter
from specdec_core.engine.events import DoneEvent
from specdec_core.engine.speculative import GenerationParams, SpeculativeEngine
from specdec_core.kernels.batch_invariant import make_batch_invariant
from specdec_core.kernels.cpu import draft_int4
from specdec_core.kernels.cpu.fused_int8 import fuse_int8_projections
from specdec_core.kernels.cpu.quant_cpu import PerTokenInt8Linear, int8_available, quantize_linears_int8
from specdec_core.tools.bench import step_bytes

pytestmark = pytest.mark.skipif(
    not (int8_available() and draft_int4.int4_available()),
    reason="this torch build lacks the int8/int4 CPU kernels",
)


def int8_model(vocab: int, seed: int = 0) -> torch.nn.Module:
    model = copy.deepcopy(tiny_model(vocab, seed=seed, layers=2, hidden=128))
    quantize_linears_int8(model)
    make_batch_invariant(model)
    fuse_int8_projections(model)
    return model


@torch.inference_mode()
def _logits(model, ids: torch.Tensor, bounds: list[int]) -> torch.Tensor:
    cache = DynamicCache(config=model.config)
    return torch.cat([model(ids[:, s:e], cache=cache).logits[0] for s, e in itertools.pairwise(bounds)])


def test_int4_weights_reproduce_a_linear_closely() -> None:
    weight = torch.randn(96, 256, generator=torch.Generator().manual_seed(0))
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(1))
    exact = x @ weight.T
    approx = draft_int4.Int4Weights(weight, group=64).matmul(x)
    # 16 levels per group of 64: a few percent of the output's scale, never wild.
    assert (approx - exact).abs().max() < 0.1 * exact.abs().max()
    assert not torch.equal(approx, exact)


def test_few_token_forwards_take_the_4bit_path_and_prefills_keep_int8(tokenizer) -> None:
    plain = int8_model(len(tokenizer))
    fast = copy.deepcopy(plain)
    assert draft_int4.attach(fast) > 0
    ids = torch.randint(0, len(tokenizer), (1, 30), generator=torch.Generator().manual_seed(3))
    bounds = [0, 20, 21, 23, 30]  # a prefill, a 1-token step, a 2-token catch-up, a 7-token forward
    a, b = _logits(plain, ids, bounds), _logits(fast, ids, bounds)
    assert torch.equal(a[:20], b[:20])  # prefill: more than MAX_ROWS rows, the int8 kernel
    assert not torch.equal(a[20:23], b[20:23])  # few rows: the 4-bit kernel
    similarity = torch.nn.functional.cosine_similarity(a[20:23], b[20:23], dim=-1)
    assert similarity.mean() > 0.8  # coarser (~9% per linear on random weights), not different


def test_a_4bit_draft_leaves_greedy_output_equal_to_the_target_alone(tokenizer) -> None:
    target = tiny_model(len(tokenizer), seed=0, layers=2, hidden=128)
    draft = int8_model(len(tokenizer), seed=0)
    draft_int4.attach(draft)
    prompt = tokenizer("def add(a, b):\n    return")["input_ids"]
    engine = SpeculativeEngine(target, tokenizer, ModelDrafter(draft, "int4 draft"))
    done = next(
        e for e in engine.generate(prompt, GenerationParams(max_new_tokens=24)) if isinstance(e, DoneEvent)
    )
    assert list(done.token_ids) == hf_greedy(target, prompt, 24)
    assert done.stats.accepted > 0  # the 4-bit copy of the target still drafts well


def test_speed_up_keeps_the_4bit_path_only_when_it_is_faster(
    tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = int8_model(len(tokenizer))
    monkeypatch.setattr(draft_int4, "MIN_GAIN", 0.0)  # nothing can be that much faster
    assert draft_int4.speed_up_draft(model, repeats=1) is False
    assert all(m.few_rows is None for m in model.modules() if isinstance(m, PerTokenInt8Linear))
    monkeypatch.setattr(draft_int4, "MIN_GAIN", 1e9)  # anything is
    assert draft_int4.speed_up_draft(model, repeats=1) is True
    assert any(m.few_rows is not None for m in model.modules() if isinstance(m, PerTokenInt8Linear))


def test_the_switch_turns_it_off_and_float_models_are_left_alone(tokenizer, monkeypatch) -> None:
    monkeypatch.setattr(draft_int4, "MIN_GAIN", 1e9)
    monkeypatch.setenv(draft_int4.ENV_VAR, "0")
    assert draft_int4.speed_up_draft(int8_model(len(tokenizer)), repeats=1) is False
    monkeypatch.delenv(draft_int4.ENV_VAR)
    assert draft_int4.speed_up_draft(tiny_model(len(tokenizer), seed=0), repeats=1) is False


def test_step_bytes_count_the_4bit_weights(tokenizer) -> None:
    model = int8_model(len(tokenizer))
    before = step_bytes(model).weights
    draft_int4.attach(model)
    assert step_bytes(model).weights < 0.8 * before
