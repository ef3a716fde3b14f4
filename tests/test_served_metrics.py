"""vLLM's and SGLang's speculation figures, read from what vLLM 0.34.0 and SGLang 0.5.23 serve.

The texts in tests/data/served/ are those releases' /metrics and /server_info, written by
scripts/served-metrics-fixtures with prometheus_client from the metrics as the released
source declares them (each file's header names the source files). Where prometheus_client
is installed, its own parser is the reference ours is compared with."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from specdec_core.served import engines

DATA = Path(__file__).with_name("data") / "served"
PROM_FILES = sorted(DATA.glob("*.prom"))


def _text(name: str) -> str:
    return (DATA / name).read_text()


# -- vLLM 0.34.0 ----------------------------------------------------------------------------------
def test_vllm_counters_are_summed_over_its_engines():
    # Two data-parallel engines, each its own `engine` label; `_created` samples beside each counter.
    counts = engines.vllm_counts(_text("vllm-0.34.0-dp2.prom"))
    assert counts == engines.DraftCounts(
        drafted=1230 + 1164, accepted=861 + 790, drafts=410 + 388, per_position=(352 + 331, 288 + 262, 221 + 197)
    )


def test_vllm_counters_summed_across_api_server_processes_are_read_as_exposed():
    # --api-server-count 2: prometheus_client's multiprocess collector sums the processes;
    # past a million the counts come with an exponent (1.8475623e+07).
    counts = engines.vllm_counts(_text("vllm-0.34.0-api-servers2.prom"))
    assert counts == engines.DraftCounts(18475623, 12932937, 6158541, (5281539, 4323624, 3327774))


def test_a_vllm_server_without_speculation_reports_no_counts():
    assert engines.vllm_counts(_text("vllm-0.34.0-no-speculation.prom")) is None


def test_an_answers_counts_are_the_counters_difference_across_it():
    before = engines.DraftCounts(300, 180, 100, (80, 60, 40))
    after = engines.DraftCounts(330, 200, 110, (90, 66, 44))
    assert after.minus(before) == engines.DraftCounts(30, 20, 10, (10, 6, 4))


def test_vllm_server_info_with_batch_invariance_on_is_labelled_batch_invariant():
    # /server_info exists only under VLLM_SERVER_DEV_MODE=1; its vllm_env lists VLLM_BATCH_INVARIANT.
    info = json.loads(_text("vllm-0.34.0-server-info.json"))
    assert info["vllm_env"]["VLLM_BATCH_INVARIANT"] is True
    assert engines.exactness_label(info) == engines.BATCH_INVARIANT


def test_vllm_server_info_with_batch_invariance_off_is_not_verified():
    info = json.loads(_text("vllm-0.34.0-server-info.json"))
    info["vllm_env"]["VLLM_BATCH_INVARIANT"] = False
    assert engines.exactness_label(info) == engines.NOT_VERIFIED


def test_batch_invariance_is_claimed_only_where_vllm_env_reports_it():
    assert engines.exactness_label(None) == engines.NOT_VERIFIED  # no /server_info: dev mode off
    assert engines.exactness_label({"version": "0.34.0"}) == engines.NOT_VERIFIED
    # The setting read from anywhere but the server's own resolved vllm_env is no claim.
    assert engines.exactness_label({"env": {"VLLM_BATCH_INVARIANT": "1"}}) == engines.NOT_VERIFIED
    assert engines.exactness_label({"system_env": {"VLLM_BATCH_INVARIANT": True}}) == engines.NOT_VERIFIED
    assert engines.exactness_label({"batch_invariant": True}) == engines.NOT_VERIFIED


# -- SGLang 0.5.23 --------------------------------------------------------------------------------
def test_sglang_accept_length_is_the_mean_over_its_schedulers():
    figures = engines.sglang_acceptance(_text("sglang-0.5.23-eagle-dp2.prom"))
    assert figures == engines.SglangAcceptance((2.8125 + 3.1875) / 2, (0.453125 + 0.546875) / 2)


def test_a_scheduler_that_has_not_measured_yet_is_left_out_of_the_mean():
    # Its gauges hold the 0 they start at until it logs a decode batch.
    figures = engines.sglang_acceptance(_text("sglang-0.5.23-eagle-dp2-one-rank-warming.prom"))
    assert figures == engines.SglangAcceptance(2.875, 0.46875)


def test_an_sglang_server_without_speculation_reports_no_acceptance():
    # SGLang sets its spec gauges to 0 at every log when it runs no speculation.
    assert engines.sglang_acceptance(_text("sglang-0.5.23-no-speculation.prom")) is None


# -- the exposition format ------------------------------------------------------------------------
@pytest.mark.parametrize("path", PROM_FILES, ids=lambda p: p.name)
def test_our_prometheus_parser_reads_what_prometheus_clients_own_parser_reads(path: Path):
    parser = pytest.importorskip("prometheus_client.parser", reason="prometheus_client is the reference")
    text = path.read_text()
    theirs = sorted(
        (s.name, tuple(sorted(s.labels.items())), s.value)
        for family in parser.text_string_to_metric_families(text)
        for s in family.samples
        if math.isfinite(s.value)
    )
    ours = sorted(
        (s.name, tuple(sorted(s.labels.items())), s.value)
        for s in engines.parse_prometheus(text)
        if math.isfinite(s.value)
    )
    assert ours == theirs


def test_the_fixtures_are_all_there():
    assert {p.name for p in PROM_FILES} == {
        "vllm-0.34.0-dp2.prom",
        "vllm-0.34.0-api-servers2.prom",
        "vllm-0.34.0-no-speculation.prom",
        "sglang-0.5.23-eagle-dp2.prom",
        "sglang-0.5.23-eagle-dp2-one-rank-warming.prom",
        "sglang-0.5.23-no-speculation.prom",
    }
