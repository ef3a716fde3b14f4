"""What a bench run found: per-prompt results, summaries, and the JSON document.

Identity is judged against a method's reference: `target` for transformers' and our
methods (same weights, so exactness means the same tokens), and llama.cpp's own plain
decoding for its speculative decoding (its GGUF weights are not ours: the question
there is whether *its* speculation keeps *its* text).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from ...engine.stats import GenerationStats
from .methods import BASELINE, HF_ASSISTED, LLAMA_SERVER, LLAMA_SERVER_DRAFT, Run
from .prompts import BenchPrompt

# Whose tokens a method must reproduce; every other method answers to `target`.
REFERENCES = {LLAMA_SERVER: LLAMA_SERVER, LLAMA_SERVER_DRAFT: LLAMA_SERVER}


def reference_of(method: str) -> str:
    return REFERENCES.get(method, BASELINE)


@dataclass(frozen=True)
class EngineFigures:
    """What our engine measured on one prompt (from the median-time repeat)."""

    acceptance_rate: float
    mean_accepted_length: float  # tokens committed per verify, bonus/corrected included
    mean_k: float
    k_histogram: dict[str, int]
    per_position_acceptance: list[float]
    cost_ratio: float  # c = t_draft / t_target, measured
    theoretical_speedup: float  # Leviathan eq. 1 at the measured α, mean k and c
    efficiency: float  # speedup_vs_target / theoretical_speedup
    engine_measured_speedup: float  # the engine's own estimate (vs its timed 1-token step)
    stop_reason: str
    exactness: str = "unchecked"  # the pair's self-check label (selfcheck.py)
    # The costs the draft lengths were chosen by, at the end of the run: a one-token draft
    # forward and a verify of m = 1, 2, ... tokens, in milliseconds.
    draft_token_ms: float = 0.0
    verify_ms: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class Result:
    """One prompt × method: the JSON schema's `results` entries."""

    prompt_id: str
    category: str
    method: str
    prompt_tokens: int
    new_tokens: int
    seconds: float  # median over repeats
    tokens_per_s: float
    speedup_vs_target: float
    speedup_vs_hf_assisted: float | None
    identical_to_target: bool  # to `reference` (named so for the schema's sake)
    first_divergence: int | None  # index of the first token that differs from the reference's
    seconds_all: list[float]
    engine: EngineFigures | None = None
    reference: str = BASELINE
    speedup_vs_llama_server: float | None = None
    sampled: bool = False  # seeded sampling: texts differ by design and are not compared

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Result:
        fields = {k: v for k, v in d.items() if k in cls.__dataclass_fields__}
        if fields.get("engine") is not None:
            fields["engine"] = EngineFigures(**fields["engine"])
        return cls(**fields)


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first differing token, len of the shorter if one is a prefix, None if equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _engine_figures(stats: GenerationStats, speedup_vs_target: float, exactness: str) -> EngineFigures:
    bound = stats.theoretical_speedup
    return EngineFigures(
        acceptance_rate=stats.acceptance_rate,
        mean_accepted_length=stats.mean_accepted_length,
        mean_k=stats.mean_k,
        k_histogram={str(k): v for k, v in sorted(stats.k_histogram.items())},
        per_position_acceptance=list(stats.per_position_acceptance),
        cost_ratio=stats.cost_ratio,
        theoretical_speedup=bound,
        efficiency=speedup_vs_target / bound if bound > 0 else 0.0,
        engine_measured_speedup=stats.measured_speedup,
        stop_reason=stats.stop_reason,
        exactness=exactness,
        draft_token_ms=1000 * stats.draft_token_seconds,
        verify_ms=[1000 * t for t in stats.verify_curve],
    )


def _median_run(runs: Sequence[Run]) -> Run:
    """The repeat with the median time (the lower middle one for an even count)."""
    ordered = sorted(runs, key=lambda r: r.seconds)
    return ordered[(len(ordered) - 1) // 2]


def _rate(runs: Sequence[Run]) -> float:
    median = _median_run(runs)
    return len(median.token_ids) / median.seconds if median.seconds > 0 else 0.0


def prompt_results(
    prompt: BenchPrompt, prompt_len: int, runs: dict[str, list[Run]], exactness: str = "unchecked",
    sampled: bool = False,
) -> list[Result]:  # fmt: skip
    """One `Result` per method from its repeats on one prompt; sampled runs' texts are not
    compared (each method draws its own tokens)."""
    base_rate = _rate(runs[BASELINE])
    hf_rate = _rate(runs[HF_ASSISTED]) if HF_ASSISTED in runs else None
    peer_rate = _rate(runs[LLAMA_SERVER]) if LLAMA_SERVER in runs else None
    results = []
    for method, method_runs in runs.items():
        reference = reference_of(method)
        expected = runs[reference][0].token_ids if reference in runs else ()
        median = _median_run(method_runs)
        tps = _rate(method_runs)
        speedup = tps / base_rate if base_rate > 0 else 0.0
        # Identical only if every repeat reproduced the reference.
        diverged = [d for r in method_runs if (d := first_divergence(r.token_ids, expected)) is not None]
        diverged = [] if sampled else diverged
        results.append(
            Result(
                prompt_id=prompt.id,
                category=prompt.category,
                method=method,
                prompt_tokens=prompt_len,
                new_tokens=len(median.token_ids),
                seconds=statistics.median(r.seconds for r in method_runs),
                tokens_per_s=tps,
                speedup_vs_target=speedup,
                speedup_vs_hf_assisted=tps / hf_rate if hf_rate else None,
                identical_to_target=not diverged,
                first_divergence=min(diverged) if diverged else None,
                seconds_all=[r.seconds for r in method_runs],
                engine=_engine_figures(median.stats, speedup, exactness) if median.stats else None,
                reference=reference,
                speedup_vs_llama_server=tps / peer_rate if peer_rate else None,
                sampled=sampled,
            )
        )
    return results


# -- summary -----------------------------------------------------------------------


def geomean(values: Sequence[float]) -> float | None:
    positive = [v for v in values if v > 0]
    if not positive:
        return None
    return math.exp(sum(math.log(v) for v in positive) / len(positive))


@dataclass(frozen=True)
class GroupSummary:
    """One method over a group of prompts (a category, or all of them)."""

    prompts: int
    geomean_speedup_vs_target: float | None
    geomean_speedup_vs_hf_assisted: float | None
    worst_prompt: str
    worst_speedup_vs_target: float
    identity_rate: float | None  # None for sampled runs (texts not compared)
    median_tokens_per_s: float
    mean_acceptance_rate: float | None = None
    geomean_efficiency: float | None = None
    geomean_speedup_vs_llama_server: float | None = None
    geomean_tokens_per_s: float | None = None


def summarize_group(results: Sequence[Result]) -> GroupSummary:
    worst = min(results, key=lambda r: r.speedup_vs_target)
    engines = [r.engine for r in results if r.engine is not None and r.engine.theoretical_speedup > 0]
    drafted = [e for e in engines if e.mean_k > 0]
    return GroupSummary(
        prompts=len(results),
        geomean_speedup_vs_target=geomean([r.speedup_vs_target for r in results]),
        geomean_speedup_vs_hf_assisted=geomean(
            [r.speedup_vs_hf_assisted for r in results if r.speedup_vs_hf_assisted is not None]
        ),
        worst_prompt=worst.prompt_id,
        worst_speedup_vs_target=worst.speedup_vs_target,
        identity_rate=None if any(r.sampled for r in results)
        else sum(r.identical_to_target for r in results) / len(results),
        median_tokens_per_s=statistics.median(r.tokens_per_s for r in results),
        mean_acceptance_rate=statistics.fmean(e.acceptance_rate for e in drafted) if drafted else None,
        geomean_efficiency=geomean([e.efficiency for e in drafted]) if drafted else None,
        geomean_speedup_vs_llama_server=geomean(
            [r.speedup_vs_llama_server for r in results if r.speedup_vs_llama_server is not None]
        ),
        geomean_tokens_per_s=geomean([r.tokens_per_s for r in results]),
    )


def summarize(results: Sequence[Result]) -> dict[str, dict[str, GroupSummary]]:
    """method -> {"all": ..., category: ...}, categories in first-seen order."""
    out: dict[str, dict[str, GroupSummary]] = {}
    methods = list(dict.fromkeys(r.method for r in results))
    categories = list(dict.fromkeys(r.category for r in results))
    for method in methods:
        mine = [r for r in results if r.method == method]
        groups = {"all": summarize_group(mine)}
        for category in categories:
            in_cat = [r for r in mine if r.category == category]
            if in_cat:
                groups[category] = summarize_group(in_cat)
        out[method] = groups
    return out
