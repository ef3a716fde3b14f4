"""The gpu-check's reusable parts: acceptance counting, the projection, the chi-square,
bytes read per step and the time-budgeted part runner."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from scipy.stats import chisquare
from tiny import perturbed, tiny_model

from specdec_core.engine.drafters import ModelDrafter
from specdec_core.engine.speculative import GenerationParams, SpeculativeEngine
from specdec_core.engine.stats import expected_tokens
from specdec_core.tools.gpu_check.acceptance import AcceptanceCounts, measure
from specdec_core.tools.gpu_check.identity import last
from specdec_core.tools.gpu_check.projection import project
from specdec_core.tools.gpu_check.report import Check, Skip
from specdec_core.tools.gpu_check.sampling_check import pearson_p_value
from specdec_core.tools.gpu_check.summary import update
from specdec_core.tools.gpu_check.timing import bytes_read_per_step


def test_acceptance_counts_a_position_only_when_every_one_before_it_was_accepted():
    counts = AcceptanceCounts(k=4)
    counts.record(proposed=4, accepted=2)  # positions 0, 1 accepted; 2 reached and rejected; 3 never reached
    counts.record(proposed=4, accepted=4)
    counts.record(proposed=2, accepted=0)  # a shorter draft: only position 0 reached
    assert counts.reached == [3, 2, 2, 1]
    assert counts.accepted == [2, 2, 1, 1]
    assert counts.per_position == [2 / 3, 1.0, 0.5, 1.0]


def test_acceptance_stops_at_the_first_position_never_reached():
    counts = AcceptanceCounts(k=3)
    counts.record(proposed=3, accepted=0)
    assert counts.per_position == [0.0]


def test_measured_acceptance_of_one_answer_is_the_engines_own(tokenizer, target):
    engine = SpeculativeEngine(target, tokenizer, ModelDrafter(perturbed(target, 0.05), "p"))
    prompt = tokenizer("def add(a, b):")["input_ids"]
    counts = measure(engine, [prompt], new_tokens=40, k=6)
    params = GenerationParams(max_new_tokens=40, draft_length=6, max_draft_length=6)
    stats = last(engine.generate(prompt, params)).stats
    assert counts.per_position == pytest.approx(list(stats.per_position_acceptance))
    assert counts.verifies == stats.steps and counts.new_tokens == stats.new_tokens


def test_the_projection_takes_the_best_draft_length_from_the_measured_costs():
    accepted = [0.9, 0.8, 0.5, 0.1]
    verify = {m: 10.0 + 0.1 * m for m in range(1, 6)}
    found = project(accepted, draft_ms=1.0, verify_ms=verify, baseline_ms=verify[1])
    rates = {k: expected_tokens(accepted, k) / (k * 1.0 + verify[k + 1]) * verify[1] for k in range(1, 5)}
    best = max(rates, key=rates.__getitem__)
    assert (found.k, found.speedup) == (best, pytest.approx(rates[best]))
    assert found.tokens_per_verify == pytest.approx(expected_tokens(accepted, best))


def test_our_projection_never_drafts_longer_than_the_engine_does():
    verify = {m: 10.0 for m in range(1, 17)}  # flat costs: the longest draft would win
    assert project([0.99] * 15, draft_ms=0.1, verify_ms=verify, baseline_ms=10.0).k == 15
    assert project([0.99] * 15, draft_ms=0.1, verify_ms=verify, baseline_ms=10.0, max_k=12).k == 12


def test_the_projection_keeps_plain_decoding_when_drafts_do_not_pay():
    found = project([0.01] * 4, draft_ms=50.0, verify_ms={m: 10.0 for m in range(1, 6)}, baseline_ms=20.0)
    assert found.k == 0 and found.speedup == pytest.approx(2.0)


def test_the_pearson_p_value_is_scipys_with_rare_cells_merged():
    probs = np.array([0.5, 0.3, 0.15, 0.04, 0.01])
    counts = np.array([480, 320, 150, 30, 20])
    expected = probs * counts.sum()
    scipy_p = chisquare(counts, expected).pvalue
    assert pearson_p_value(torch.tensor(counts), torch.tensor(probs)) == pytest.approx(scipy_p, rel=1e-6)
    rare = torch.tensor([0.6, 0.395, 0.003, 0.002])
    merged = chisquare([55, 43, 2], [60, 39.5, 0.5]).pvalue  # the last two cells expect < 5
    assert pearson_p_value(torch.tensor([55, 43, 1, 1]), rare) == pytest.approx(merged, rel=1e-6)


def _bytes(model: torch.nn.Module) -> int:
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}.values()
    return sum(t.numel() * t.element_size() for t in tensors)


def test_bytes_read_leave_out_an_untied_input_embedding_but_keep_a_tied_one():
    untied = tiny_model(64, seed=0)
    embedding = untied.get_input_embeddings().weight
    assert bytes_read_per_step(untied) == _bytes(untied) - embedding.numel() * embedding.element_size()
    tied = tiny_model(64, seed=0)
    tied.lm_head.weight = tied.get_input_embeddings().weight  # one matrix: the head reads it whole
    assert bytes_read_per_step(tied) == _bytes(tied)


def test_bytes_read_count_a_modules_own_kernel_layout_in_place_of_its_quant_state():
    linear = torch.nn.Linear(64, 32, bias=False)
    linear.weight.quant_state = SimpleNamespace(  # as bitsandbytes keeps 4-bit scales
        absmax=torch.zeros(32), code=torch.zeros(16), state2=SimpleNamespace(absmax=torch.zeros(2), code=None)
    )
    model = torch.nn.Sequential(linear)
    model.get_input_embeddings = lambda: linear  # tied: nothing left out
    model.get_output_embeddings = lambda: linear
    weight = 64 * 32 * 4
    assert bytes_read_per_step(model) == weight + (32 + 16 + 2) * 4
    linear.kernel_packed = linear.weight.data.view(32, 64)  # a view of the same bytes: counted once
    linear.kernel_scales = torch.zeros(8, dtype=torch.float64)
    assert bytes_read_per_step(model) == weight + 8 * 8


def test_a_part_is_recorded_done_skipped_failed_or_cut_and_saved_each_time(tmp_path):
    check = Check(tmp_path / "out.json", budget_s=60, header={"device": "test"})

    def measures(entry):
        entry["figure"] = 1.0

    def lacks(entry):
        raise Skip("no such library here")

    def breaks(entry):
        raise RuntimeError("kernel said no\nand more")

    def overruns(entry):
        entry["first"] = 2.0
        time.sleep(5)

    check.part("a", 1, measures)
    check.part("b", 1, lacks)
    check.part("c", 1, breaks)
    check.part("d", 1, overruns, cap_s=0.2)
    check.part("e", 3600, measures)
    saved = json.loads((tmp_path / "out.json").read_text())["parts"]
    assert saved["a"]["status"] == "done" and saved["a"]["figure"] == 1.0
    assert (saved["b"]["status"], saved["b"]["why"]) == ("skipped", "no such library here")
    assert (saved["c"]["status"], saved["c"]["why"]) == ("failed", "RuntimeError: kernel said no")
    assert saved["d"]["status"] == "cut" and saved["d"]["first"] == 2.0  # kept what it measured
    assert saved["e"]["status"] == "skipped" and "time budget" in saved["e"]["why"]


def test_the_summary_sets_each_baseline_against_the_projected_cost_per_token():
    static = [10.0 + 0.2 * m for m in range(16)]
    parts = {
        "draft": {"static_ms": 2.0},
        "costs-p": {
            "static_ms": static,
            "cached_model_ms": [3 * v for v in static],
            "bound_ms": 5.0,
            "static_r1_plain_ms": 8.0,
        },
        "hf-eager-p": {"ms_per_token": 40.0, "verify_ms": [4 * v for v in static], "draft_ms": 8.0},
    }
    results = {"parts": parts}
    accepted = [0.8] * 15
    update(results, {"bf16": accepted}, {"p": "bf16"})
    row = results["summary"]["p"]
    ours = project(accepted, 2.0, dict(enumerate(static, 1)), static[0])
    assert row["projected"]["speedup"] == pytest.approx(ours.speedup)
    assert row["plain_over_bound"] == pytest.approx(2.0) and row["r16_over_r1"] == pytest.approx(1.25)
    assert row["verify9_over_plain"] == pytest.approx(static[8] / static[0])
    assert row["vs_hf_eager"] == pytest.approx(40.0 / ours.ms_per_token)
    assert row["vs_hf_assisted_ceiling"] == pytest.approx(4.0)  # every cost of theirs is 4x ours
    assert "vs_hf_compiled" not in row  # never measured: never made up
    assert row["speedup_if_all_accepted"] > ours.speedup


def test_the_int4_side_by_side_takes_one_layers_seven_linears_and_their_nf4_weights(tiny_folder):
    pytest.importorskip("bitsandbytes")
    from specdec_core.models.loading import load_model
    from specdec_core.tools.gpu_check.int4_kernels import dequantized, layer_linears

    model = load_model(str(tiny_folder), device="cpu", precision="nf4").model
    linears = layer_linears(model)
    assert len(linears) == 7
    x = torch.randn(3, linears[0].in_features, dtype=torch.bfloat16)
    with torch.no_grad():
        plain = dequantized(linears[0])
        torch.testing.assert_close(plain(x).float(), linears[0](x).float(), rtol=2e-2, atol=2e-2)
