"""The check's figures against the issue's bars, and the projections, from the parts' results.

Derived from the parts' raw figures only (so it can be recomputed from a saved JSON):
per pair, the plain step over its bandwidth bound, what the fixed row count R = 16 costs
over a 1-row step, a width-9 verify over a plain step, the draft's step as a share of the
target's (what bounds a pair whose draft is not much smaller), and the projected speedup
against our plain decoding and against each of transformers' paths (the assisted one also
against its ceiling: its best fixed k at the same acceptance, from its own eager costs),
and the speedup the draft's cost alone would allow were every draft accepted.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ...engine.speculative import MAX_DRAFT_LENGTH
from .projection import Projection, project

NOTE = (
    "projection: step costs measured on this GPU with random weights of real shapes, per-position "
    "acceptance of the real default pair measured on a CPU; prompt reading and host work left out"
)


def _curve(ms: Sequence[float]) -> dict[int, float]:
    return {width: value for width, value in enumerate(ms, start=1)}


def _pair(parts: Mapping[str, Any], pair: str, accepted: Sequence[float] | None) -> dict[str, Any]:
    costs, draft = parts.get(f"costs-{pair}", {}), parts.get("draft", {})
    if "static_ms" not in costs:
        return {"missing": "costs not measured"}
    plain = costs["static_ms"][0]
    found: dict[str, Any] = {"plain_ms": plain}
    if "bound_ms" in costs:
        found.update(bound_ms=costs["bound_ms"], plain_over_bound=plain / costs["bound_ms"])
    if "static_r1_plain_ms" in costs:
        found["r16_over_r1"] = plain / costs["static_r1_plain_ms"]
    found["verify9_over_plain"] = costs["static_ms"][8] / plain
    found["cached_model_verify9_over_static"] = costs["cached_model_ms"][8] / costs["static_ms"][8]
    if "static_ms" not in draft or accepted is None:
        found["missing"] = "draft step or acceptance not measured"
        return found
    found["draft_over_target_step"] = draft["static_ms"] / plain
    ours = project(accepted, draft["static_ms"], _curve(costs["static_ms"]), plain, MAX_DRAFT_LENGTH)
    found["projected"] = ours.as_dict()
    # What the draft's cost alone allows: the speedup were every draft accepted.
    everything = [1.0] * (len(costs["static_ms"]) - 1)
    found["speedup_if_all_accepted"] = project(
        everything, draft["static_ms"], _curve(costs["static_ms"]), plain, MAX_DRAFT_LENGTH
    ).speedup
    for path in ("eager", "compiled", "assisted"):
        hf = parts.get(f"hf-{path}-{pair}", {})
        if "ms_per_token" in hf:
            found[f"vs_hf_{path}"] = hf["ms_per_token"] / ours.ms_per_token
    eager = parts.get(f"hf-eager-{pair}", {})
    if "verify_ms" in eager and "draft_ms" in eager:
        # transformers' assisted decoding at its best fixed k, from its own eager costs:
        # a ceiling for it (its own draft-length heuristics and host work only add).
        theirs: Projection = project(accepted, eager["draft_ms"], _curve(eager["verify_ms"]), 1.0)
        found["vs_hf_assisted_ceiling"] = theirs.ms_per_token / ours.ms_per_token
    return found


def update(
    results: dict[str, Any], acceptance: Mapping[str, Sequence[float]], pairs: Mapping[str, str]
) -> None:
    """Write `results["summary"]`: per pair (and the acceptance it projects from), the bars' figures."""
    parts = results.get("parts", {})
    summary: dict[str, Any] = {"note": NOTE}
    for pair, precision in pairs.items():
        summary[pair] = {"acceptance": precision, **_pair(parts, pair, acceptance.get(precision))}
    results["summary"] = summary


def _fmt(value: Any, digits: str = ".2f") -> str:
    return format(value, digits) if isinstance(value, int | float) else "-"


def table(results: Mapping[str, Any]) -> str:
    """A short text table: per pair the bars, then identity, sampling, and parts not done."""
    summary, parts = results.get("summary", {}), results.get("parts", {})
    lines = [
        f"{'pair':<10} {'plain ms':>9} {'bound ms':>9} {'/bound':>7} {'R16/R1':>7} {'v9/plain':>8} "
        f"{'draft/t':>7} {'k':>3} {'x ours':>7} {'all acc':>7} {'x eager':>8} {'x compiled':>10} "
        f"{'x assisted (ceiling)':>20}"
    ]
    for pair, row in summary.items():
        if not isinstance(row, dict):
            continue
        projected = row.get("projected", {})
        lines.append(
            f"{pair:<10} {_fmt(row.get('plain_ms'), '.3f'):>9} {_fmt(row.get('bound_ms'), '.3f'):>9} "
            f"{_fmt(row.get('plain_over_bound')):>7} {_fmt(row.get('r16_over_r1')):>7} "
            f"{_fmt(row.get('verify9_over_plain')):>8} {_fmt(row.get('draft_over_target_step')):>7} "
            f"{_fmt(projected.get('k'), 'd'):>3} {_fmt(projected.get('speedup')):>7} "
            f"{_fmt(row.get('speedup_if_all_accepted')):>7} {_fmt(row.get('vs_hf_eager')):>8} "
            f"{_fmt(row.get('vs_hf_compiled')):>10} {_fmt(row.get('vs_hf_assisted_ceiling')):>20}"
        )
    lines.append(summary.get("note", ""))
    for name, entry in parts.items():
        if name.startswith("identity-") and "model" in entry:
            lines.append(
                f"{name}: identity model drafter {entry['model']['identity']:.0%}, "
                f"n-gram {entry['ngram']['identity']:.0%}; self-check {entry.get('selfcheck', '-')}"
            )
    if "p_value" in parts.get("sampling", {}):
        lines.append(f"sampling: chi-square p = {parts['sampling']['p_value']:.3g}")
    lines += [
        f"{name}: {e['status']} ({e.get('why', '')})"
        for name, e in parts.items()
        if e.get("status") != "done"
    ]
    return "\n".join(lines)
