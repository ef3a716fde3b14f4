"""Rendering a `BenchReport`: the machine line, a markdown table, a bar chart.

Kept apart from `bench` so the measuring code stays short; nothing here times anything.
"""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path
from typing import Any

import psutil
import torch

from ...kernels.cpu import features, native
from . import BenchReport, CostCurve, FusionGain, GroupSummary, LoadRun, Result, StepBytes, TargetCheck
from .results import reference_of


def machine_info() -> dict[str, Any]:
    """What a reader needs to judge the numbers: CPU, cores, memory, threads, versions, load."""
    import transformers

    return {
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "cpu_kernels": native.isa(),  # the build of the C kernels this CPU takes (None: none)
        "os": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "load_average_start": [round(x, 2) for x in os.getloadavg()],
        "git_commit": _git_commit(),
    }


def machine_line(machine: dict[str, Any]) -> str:
    gpu = f", {machine['cuda']}" if machine.get("cuda") else ""
    load = machine.get("load_average_start")
    load_text = f", load {load[0]:.2f} at start" if load else ""
    kernels = f", C kernels for {machine['cpu_kernels']}" if machine.get("cpu_kernels") else ""
    return (
        f"{machine['cpu']}{kernels}, {machine['cores']} cores ({machine['torch_threads']} torch threads), "
        f"{machine['memory_gib']} GiB{gpu}; {machine['os']}; Python {machine['python']}, "
        f"torch {machine['torch']}, transformers {machine['transformers']}{load_text}"
    )


def _cpu_model() -> str:
    name = features.model_name(features.cpuinfo())
    return name.strip() if name else platform.processor() or platform.machine()


def _git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            cwd=Path(__file__).parent,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


# -- markdown ----------------------------------------------------------------------


def _x(v: float | None) -> str:
    return "–" if v is None else f"{v:.2f}×"


def _pct(v: float | None) -> str:
    return "–" if v is None else f"{v:.0%}"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines


def to_markdown(report: BenchReport) -> str:
    """A readable report: config, machine, the bars, summary per method and category, every prompt."""
    c = report.config
    lines = [
        "# specdec bench",
        "",
        f"- command: `{c.get('command', '')}`",
        f"- target `{c['target']}`, draft `{c['draft']}`, {c['device']} · {c['precision']}"
        + (f" (draft {c['draft_precision']})" if c.get("draft_precision") not in (None, c["precision"]) else "")
        + (f", int8 kernel {c['int8_kernel']}" if c.get("int8_kernel") else "")
        + ", greedy, "
        f"{c['max_new_tokens']} new tokens, {c['repeats']} repeat(s) (median), {c['prompts']} prompts",
        f"- machine: {machine_line(report.machine)}",
        "",
    ]
    skipped = c.get("skipped_methods") or {}
    lines += [f"- skipped `{name}`: {reason}" for name, reason in skipped.items()]
    exactness = c.get("exactness")
    if exactness:
        # Runs saved before the report carried its summary have only the figures.
        summary = exactness.get("summary") or (
            f"{exactness.get('label')} (max logit difference "
            f"{exactness.get('max_logit_diff')}, {exactness.get('positions')} positions)"
        )
        lines.append(f"- exactness self-check: {summary}")
    lines += ["", "## Targets", ""]
    lines += _table(["bar", "goal", "measured", "met"], [_target_row(t) for t in report.targets])
    if any(m in report.summary for m in ("llama-server", "llama-server-draft")):
        lines += ["", "## Against llama.cpp's server (same GGUF files, same threads)", ""]
        lines += peer_table(report)
    lines += ["", "## Summary (geometric mean of per-prompt speedups)", ""]
    lines += _summary_table(report.summary)
    categories = [g for g in next(iter(report.summary.values()), {}) if g != "all"]
    lines += ["", "## Speedup vs `target` by category", ""]
    lines += _table(
        ["method", *categories],
        [
            [m, *[_x(groups[g].geomean_speedup_vs_target) if g in groups else "–" for g in categories]]
            for m, groups in report.summary.items()
        ],
    )
    lines += ["", "## Every prompt", ""]
    lines += _results_table(report.results)
    return "\n".join(lines) + "\n"


def _target_row(t: TargetCheck) -> list[str]:
    value = _pct(t.value) if t.kind == "rate" else _x(t.value)
    return [t.name, t.goal, value, _met(t.met)]


def peer_table(report: BenchReport) -> list[str]:
    """The issue's table: geomean tok/s end to end, ratio to llama-server plain, identity."""
    rows = []
    for method, groups in report.summary.items():
        s = groups["all"]
        same = [r for r in report.results if r.method == method and r.reference != method]
        identity = (
            f"{sum(r.identical_to_target for r in same)}/{len(same)} (vs {same[0].reference})"
            if same and not same[0].sampled
            else "–"
        )
        tps = "–" if s.geomean_tokens_per_s is None else f"{s.geomean_tokens_per_s:.2f}"
        rows.append([method, tps, _x(s.geomean_speedup_vs_llama_server), identity])
    return _table(["method", "tok/s (geomean)", "vs llama-server plain", "same text"], rows)


def _met(met: bool | None) -> str:
    return "n/a" if met is None else ("yes" if met else "**no**")


def _summary_table(summary: dict[str, dict[str, GroupSummary]]) -> list[str]:
    rows = []
    for method, groups in summary.items():
        s = groups["all"]
        rows.append(
            [
                method,
                f"{s.median_tokens_per_s:.2f}",
                _x(s.geomean_speedup_vs_target),
                _x(s.geomean_speedup_vs_hf_assisted),
                _x(s.geomean_speedup_vs_llama_server),
                f"{s.worst_prompt} ({_x(s.worst_speedup_vs_target)})",
                "–" if reference_of(method) == method else _pct(s.identity_rate),  # its own reference
                _pct(s.mean_acceptance_rate),
                "–" if s.geomean_efficiency is None else f"{s.geomean_efficiency:.2f}",
            ]
        )
    return _table(
        [
            "method",
            "median tok/s",
            "vs target",
            "vs hf-assisted",
            "vs llama-server",
            "worst prompt",
            "identical",
            "acceptance",
            "efficiency",
        ],
        rows,
    )


def _results_table(results: list[Result]) -> list[str]:
    rows = []
    for r in results:
        e = r.engine
        rows.append(
            [
                r.prompt_id,
                r.method,
                str(r.new_tokens),
                f"{r.tokens_per_s:.2f}",
                _x(r.speedup_vs_target),
                _identity(r),
                "–" if e is None or e.mean_k == 0 else f"{e.acceptance_rate:.0%}",
                "–" if e is None or e.mean_k == 0 else f"{e.mean_accepted_length:.2f}",
                "–" if e is None or e.mean_k == 0 else f"{e.mean_k:.1f}",
                "–" if e is None or e.mean_k == 0 else _x(e.theoretical_speedup),
                "–" if e is None or e.mean_k == 0 else f"{e.efficiency:.2f}",
            ]
        )
    return _table(
        [
            "prompt",
            "method",
            "tokens",
            "tok/s",
            "vs target",
            "identical",
            "α",
            "tokens/verify",
            "mean k",
            "bound",
            "efficiency",
        ],
        rows,
    )


def _identity(r: Result) -> str:
    if r.reference == r.method or r.sampled:
        return "–"
    suffix = "" if r.reference == "target" else f" (vs {r.reference})"
    return ("yes" if r.identical_to_target else f"**no** (token {r.first_divergence})") + suffix


def cost_curve_markdown(curve: CostCurve) -> str:
    """The verify-cost table of docs/performance.md."""
    ms = list(curve.target_min)
    lines = _table(
        ["m tokens", *map(str, ms)],
        [
            ["target, min (ms)", *[f"{curve.target_min[m] * 1e3:.0f}" for m in ms]],
            ["target, median (ms)", *[f"{curve.target_median[m] * 1e3:.0f}" for m in ms]],
        ],
    )
    if curve.draft_min is not None and curve.draft_median is not None:
        c = curve.draft_median / curve.target_median[ms[0]] if ms and ms[0] == 1 else None
        ratio = f", c = {c:.2f}" if c is not None else ""
        lines.append(
            f"\ndraft 1-token step: min {curve.draft_min * 1e3:.0f} ms, "
            f"median {curve.draft_median * 1e3:.0f} ms{ratio}"
        )
    lines.append(f"\n({curve.repeats} interleaved repeats after a {curve.context_tokens}-token context)")
    return "\n".join(lines) + "\n"


def roofline_markdown(
    curve: CostCurve,
    models: dict[str, StepBytes],
    bandwidth: float | None,
    limit: float | None = None,
    one_core: float | None = None,
) -> str:
    """Bytes one decoding step reads, the speed achieved, and the share of the memory's limit.

    `limit` (bytes/s) defaults to the measured streaming bandwidth; `one_core` is the same
    read by one thread, what a process left one core by a busy neighbour can stream.
    """
    limit = limit or bandwidth
    seconds = {"target": curve.target_min.get(1), "draft": curve.draft_min}
    rows = []
    for name, b in models.items():
        t = seconds.get(name)
        achieved = b.total / t if t else None
        rows.append(
            [
                name,
                f"{b.weights / 1e9:.3f}",
                f"{b.kv_cache / 1e6:.1f}",
                "–" if t is None else f"{t * 1e3:.0f}",
                "–" if achieved is None else f"{achieved / 1e9:.1f}",
                "–" if achieved is None or not limit else f"{achieved / limit:.0%}",
                "–" if not limit else f"{b.total / limit * 1e3:.0f}",
            ]
        )
    lines = _table(
        ["model", "weights read (GB)", "KV read (MB)", "1-token step, min (ms)", "achieved GB/s",
         "% of limit", "floor at limit (ms)"],
        rows,
    )  # fmt: skip
    context = next(iter(models.values())).context_tokens if models else 0
    measured = (
        f"{bandwidth / 1e9:.1f} GB/s measured (streaming sum of 256 MiB in 2 MB pages where granted, best of 5)"
        if bandwidth
        else "not measured"
    )
    if bandwidth and one_core:
        measured += f"; one thread streams {one_core / 1e9:.1f} GB/s ({one_core / bandwidth:.0%})"
    lines.append(f"\n(limit: {measured}; KV cache at {context} cached tokens)")
    return "\n".join(lines) + "\n"


def fusion_markdown(gains: dict[str, FusionGain]) -> str:
    """Separate vs fused q/k/v and gate/up: min ms of an m-token forward, interleaved."""
    rows = []
    for name, g in gains.items():
        for m in g.sizes:
            a, b = g.separate_min[m], g.fused_min[m]
            rows.append([name, str(m), f"{a * 1e3:.1f}", f"{b * 1e3:.1f}", f"{(a - b) / a:+.0%}"])
    lines = _table(["model", "m tokens", "separate, min (ms)", "fused, min (ms)", "saved"], rows)
    return "\n".join(lines) + "\n"


def under_load_markdown(runs: list[LoadRun]) -> str:
    """Each condition's median tok/s, and what share of the quiet speed it kept."""
    import statistics

    conditions = list(dict.fromkeys((r.busy, r.governor) for r in runs))
    median = {
        c: statistics.median(r.tokens_per_s for r in runs if (r.busy, r.governor) == c) for c in conditions
    }
    rows = []
    for busy, governor in conditions:
        quiet = median.get((False, governor))
        mine = [r for r in runs if (r.busy, r.governor) == (busy, governor)]
        rows.append(
            [
                "one busy process" if busy else "no extra load",
                governor,
                f"{median[(busy, governor)]:.2f}",
                _pct(median[(busy, governor)] / quiet) if quiet else "–",
                ", ".join(str(r.threads_at_end) for r in mine),
                ", ".join(f"{r.load_average:.1f}" for r in mine),
            ]
        )
    lines = _table(
        ["machine", "threads", "tok/s (median)", "of its quiet speed", "threads at end", "load avg at start"],
        rows,
    )
    return "\n".join(lines) + "\n"


# -- plot --------------------------------------------------------------------------


def plot_speedups(report: BenchReport, path: Path) -> None:
    """Grouped bars: geomean speedup vs `target` per category (and overall), one bar per method."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed; safe in tests and on servers
    import matplotlib.pyplot as plt

    methods = [m for m in report.summary if m != "target"]
    groups = [g for g in next(iter(report.summary.values()), {}) if g != "all"] + ["all"]
    width = 0.8 / max(1, len(methods))
    fig, ax = plt.subplots(figsize=(max(6.0, 1.3 * len(groups) + 2), 4.5))
    for i, method in enumerate(methods):
        values = [
            report.summary[method][g].geomean_speedup_vs_target or 0.0 if g in report.summary[method] else 0.0
            for g in groups
        ]
        xs = [j + (i - (len(methods) - 1) / 2) * width for j in range(len(groups))]
        ax.bar(xs, values, width, label=method)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(groups)), groups, rotation=20, ha="right")
    ax.set_ylabel("speedup vs target alone (geomean)")
    c = report.config
    ax.set_title(
        f"{Path(str(c['target'])).name} · {c['device']} {c['precision']} · {c['max_new_tokens']} tokens"
    )
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
