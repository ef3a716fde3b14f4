"""Which server answers, and the speculation figures each kind reports, parsed from its documented formats.

- llama.cpp's server: every answer's `timings` carry `draft_n` (draft tokens proposed) and
  `draft_n_accepted`; with `timings_per_token` every streamed chunk carries them so far.
- vLLM: Prometheus counters at `/metrics`, cumulative over the whole server:
  `vllm:spec_decode_num_drafts_total`, `vllm:spec_decode_num_draft_tokens_total`,
  `vllm:spec_decode_num_accepted_tokens_total` and, per draft position,
  `vllm:spec_decode_num_accepted_tokens_per_pos_total{position="i"}`, labelled `model_name`
  and `engine` (one set per data-parallel engine, summed here). An answer's counts are the
  difference across it (other clients' requests in between are counted too).
- SGLang: the gauges `sglang:spec_accept_length` (mean tokens per verify step, the bonus
  token included) and `sglang:spec_accept_rate`, one sample per scheduler rank (labels
  `tp_rank`, `pp_rank`, `dp_rank`, ...), each the figure of that rank's last logging
  interval: server-wide running figures, not per answer.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

LLAMA_CPP = "llama.cpp"
VLLM = "vLLM"
SGLANG = "SGLang"
OPENAI = "OpenAI-compatible"

BATCH_INVARIANT = "batch-invariant server"
NOT_VERIFIED = "not verified"

# /v1/models' `owned_by`, as each server fills it.
_OWNERS = {"llamacpp": LLAMA_CPP, "vllm": VLLM, "sglang": SGLANG}


def identify(models_reply: Any) -> str:
    """The server's kind from its /v1/models reply (OPENAI when it does not say)."""
    for entry in _model_entries(models_reply):
        kind = _OWNERS.get(str(entry.get("owned_by", "")).lower())
        if kind:
            return kind
    return OPENAI


def served_models(models_reply: Any) -> list[str]:
    """Every name the server answers to: ids and, for llama.cpp, their aliases."""
    names: list[str] = []
    for entry in _model_entries(models_reply):
        for name in [entry.get("id"), *(entry.get("aliases") or [])]:
            if isinstance(name, str) and name and name not in names:
                names.append(name)
    return names


def _model_entries(models_reply: Any) -> list[Mapping[str, Any]]:
    data = models_reply.get("data") if isinstance(models_reply, Mapping) else None
    return [entry for entry in data or [] if isinstance(entry, Mapping)]


@dataclass(frozen=True)
class DraftCounts:
    """Draft tokens the server proposed and the target accepted, over some span of its work."""

    drafted: int
    accepted: int
    drafts: int | None = None  # verify steps that carried a draft, where the server counts them
    per_position: tuple[int, ...] = ()  # accepted at each draft position, where counted

    def minus(self, before: DraftCounts) -> DraftCounts:
        """The counts between two readings of cumulative counters."""
        drafts = None if self.drafts is None or before.drafts is None else self.drafts - before.drafts
        positions = tuple(
            now - (before.per_position[i] if i < len(before.per_position) else 0)
            for i, now in enumerate(self.per_position)
        )
        return DraftCounts(self.drafted - before.drafted, self.accepted - before.accepted, drafts, positions)


def llama_cpp_counts(timings: Any) -> DraftCounts | None:
    """`timings.draft_n` / `draft_n_accepted` of a llama.cpp reply (None: no speculation reported)."""
    if not isinstance(timings, Mapping) or "draft_n" not in timings:
        return None
    drafted, accepted = timings.get("draft_n"), timings.get("draft_n_accepted", 0)
    if not isinstance(drafted, int) or not isinstance(accepted, int):
        return None
    return DraftCounts(drafted, accepted)


@dataclass(frozen=True)
class Sample:
    name: str
    labels: Mapping[str, str]
    value: float


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_prometheus(text: str) -> list[Sample]:
    """The samples of a Prometheus text exposition (comments and malformed lines skipped)."""
    samples = []
    for line in text.splitlines():
        match = _SAMPLE.match(line.strip())
        if match is None:
            continue
        name, labels, value = match.groups()
        try:
            number = float(value)
        except ValueError:
            continue
        samples.append(Sample(name, dict(_LABEL.findall(labels or "")), number))
    return samples


def _total(samples: list[Sample], name: str) -> float | None:
    """The sum of a metric over its label sets (engines, ranks); None when absent."""
    values = [s.value for s in samples if s.name == name and math.isfinite(s.value)]
    return sum(values) if values else None


def vllm_counts(metrics_text: str) -> DraftCounts | None:
    """vLLM's cumulative spec-decode counters (None when the server runs no speculation)."""
    samples = parse_prometheus(metrics_text)
    drafted = _total(samples, "vllm:spec_decode_num_draft_tokens_total")
    accepted = _total(samples, "vllm:spec_decode_num_accepted_tokens_total")
    if drafted is None or accepted is None:
        return None
    drafts = _total(samples, "vllm:spec_decode_num_drafts_total")
    by_position: dict[int, float] = {}
    for s in samples:
        if (
            s.name == "vllm:spec_decode_num_accepted_tokens_per_pos_total"
            and s.labels.get("position", "").isdigit()
        ):
            position = int(s.labels["position"])
            by_position[position] = by_position.get(position, 0.0) + s.value
    positions = tuple(int(by_position.get(i, 0.0)) for i in range(max(by_position, default=-1) + 1))
    return DraftCounts(int(drafted), int(accepted), None if drafts is None else int(drafts), positions)


@dataclass(frozen=True)
class SglangAcceptance:
    """SGLang's server-wide running figures: mean tokens per verify step, and the rate where given."""

    accept_length: float
    accept_rate: float | None = None


def sglang_acceptance(metrics_text: str) -> SglangAcceptance | None:
    """The mean over SGLang's schedulers (one sample per rank label set) of those that have
    measured, each rank's rate beside its length; None where none has.

    A measured accept length counts the bonus token, so it is at least 1. SGLang writes 0
    where it measured nothing: always when it runs no speculation, and on a rank that has not
    yet logged a decode batch (sglang/srt/managers/scheduler_components/metrics_reporter.py).
    """
    samples = parse_prometheus(metrics_text)
    rates = {_label_set(s): s.value for s in samples if s.name == "sglang:spec_accept_rate"}
    measured = [
        (s.value, rates.get(_label_set(s)))
        for s in samples
        if s.name == "sglang:spec_accept_length" and math.isfinite(s.value) and s.value >= 1.0
    ]
    if not measured:
        return None
    known_rates = [rate for _, rate in measured if rate is not None and math.isfinite(rate)]
    return SglangAcceptance(
        sum(length for length, _ in measured) / len(measured),
        sum(known_rates) / len(known_rates) if known_rates else None,
    )


def _label_set(sample: Sample) -> tuple[tuple[str, str], ...]:
    return tuple(sorted(sample.labels.items()))


def exactness_label(server_info: Any) -> str:
    """BATCH_INVARIANT only where the server itself reports batch invariance, else NOT_VERIFIED.

    vLLM turns it on with the environment variable VLLM_BATCH_INVARIANT=1. Its /server_info
    (a route only VLLM_SERVER_DEV_MODE=1 registers) lists, under `vllm_env`, every VLLM_*
    setting as the server resolved it, VLLM_BATCH_INVARIANT a JSON boolean
    (vllm/entrypoints/serve/dev/server_info/api_router.py, vLLM 0.34.0). That field, true,
    is the claim; nothing is inferred from the server's kind, version or any other field.
    """
    env = server_info.get("vllm_env") if isinstance(server_info, Mapping) else None
    reported = env.get("VLLM_BATCH_INVARIANT") if isinstance(env, Mapping) else None
    return BATCH_INVARIANT if reported is True else NOT_VERIFIED
