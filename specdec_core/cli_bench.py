"""`specdec bench`: the command line of `bench` (what runs) and `bench_report` (what it writes).

Progress goes to stderr; the summary table to stdout; `--json`, `--markdown` and
`--plot` write files. See docs/benchmarks.md for the documented full run.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from .bench import (
    AUTO_DRAFTER,
    METHODS,
    BenchProgress,
    BenchPrompt,
    BenchReport,
    BenchSettings,
    build_methods,
    load_prompts,
    needs_draft_model,
    run_bench,
)
from .cli import add_model_options, stderr_progress
from .errors import SpecdecError


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "bench",
        help="time our engine against the target alone and transformers' assisted generation",
        description="Runs every method on every prompt, interleaved, greedy, same weights and precision.",
    )
    from .catalog import DEFAULT_DRAFT, DEFAULT_TARGET

    # The default pair, so that `specdec bench` alone measures what the app runs.
    add_model_options(p, draft_default=DEFAULT_DRAFT)
    p.set_defaults(target=DEFAULT_TARGET)
    p.add_argument(
        "--prompts", type=Path, default=None, help="JSONL prompts file (default: the shipped suite)"
    )
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument(
        "--repeats", type=int, default=1, help="timed runs per prompt and method (median reported)"
    )
    p.add_argument(
        "--methods",
        default=",".join(METHODS),
        help=f"comma-separated subset of {','.join(METHODS)} (target is always needed)",
    )
    p.add_argument("--categories", default=None, help="comma-separated categories to keep")
    p.add_argument("--ids", default=None, help="comma-separated prompt ids to keep")
    p.add_argument("--limit", type=int, default=None, help="keep the first N prompts (after --categories)")
    p.add_argument(
        "--draft-length", default="auto", help="our methods' k: 'auto' (adaptive, as the app) or a fixed K"
    )
    p.add_argument("--warmup-tokens", type=int, default=16, help="length of each method's warm-up generation")
    p.add_argument("--json", type=Path, default=None, metavar="OUT", help="write the full results as JSON")
    p.add_argument("--markdown", type=Path, default=None, metavar="OUT", help="write a readable report")
    p.add_argument("--plot", type=Path, default=None, metavar="OUT.png", help="bar chart of speedups")
    p.add_argument(
        "--from-json",
        type=Path,
        default=None,
        metavar="RESULTS",
        help="render a saved --json run again (markdown, plot, summary) without running anything",
    )
    p.add_argument(
        "--cost-curve",
        action="store_true",
        help="only time target forwards of 1..16 tokens and a draft step (the verify-cost curve)",
    )
    p.set_defaults(func=_bench)


def _bench(args: argparse.Namespace) -> int:
    from .chat import stop_token_ids
    from .loading import load_model
    from .pair import load_draft

    if args.from_json:
        try:
            doc = json.loads(args.from_json.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise SpecdecError(f"cannot read bench results {args.from_json}: {exc}") from exc
        _write_outputs(BenchReport.from_json(doc), args)
        return 0
    target_ref, draft_spec = args.target, args.draft
    methods = _method_names(args.methods, draft_spec)
    prompts = _select_prompts(args)
    settings = BenchSettings(args.max_new_tokens, args.repeats, args.warmup_tokens)
    if settings.max_new_tokens < 1 or settings.repeats < 1:
        raise SpecdecError("--max-new-tokens and --repeats must be at least 1")
    _quiet_transformers()

    from .bench_report import machine_info

    machine = machine_info()  # before loading: the load average then is the machine's, not ours
    target = load_model(target_ref, device=args.device, precision=args.precision, progress=stderr_progress)
    needs_draft = any(needs_draft_model(m) for m in methods)
    if args.cost_curve:
        needs_draft = draft_spec not in ("ngram", "none")
    draft = load_draft(draft_spec, target, progress=stderr_progress)[1] if needs_draft else None
    if args.cost_curve:
        return _cost_curve(target, draft, machine, args)
    print(f"specdec bench: target on {target.description}, calibrating…", file=sys.stderr)
    built = build_methods(
        methods,
        target.model,
        target.tokenizer,
        sorted(stop_token_ids(target.tokenizer, target.model)),
        draft_model=draft.model if draft else None,
        draft_name=draft.name if draft else "draft",
        draft_length=_draft_length(args.draft_length),
    )
    start = time.perf_counter()
    results = run_bench(built, prompts, target.tokenizer, settings, _ProgressBar(start))
    config = {
        "command": _command_line(args),
        "target": target_ref,
        "draft": draft_spec if draft else None,
        "device": target.device,
        "precision": target.precision,
        "max_new_tokens": settings.max_new_tokens,
        "repeats": settings.repeats,
        "warmup_tokens": settings.warmup_tokens,
        "methods": list(built),
        "prompts_file": str(args.prompts) if args.prompts else "default suite",
        "prompts": len(prompts),
        "auto_drafter": AUTO_DRAFTER,
        "draft_length": args.draft_length,
        "wall_seconds": round(time.perf_counter() - start, 1),
    }
    report = BenchReport.build(config, machine, results)
    _write_outputs(report, args)
    return 0


def _cost_curve(target: Any, draft: Any, machine: dict[str, Any], args: argparse.Namespace) -> int:
    from .bench import measure_cost_curve
    from .bench_report import cost_curve_markdown, machine_line

    print("specdec bench: timing forwards…", file=sys.stderr)
    curve = measure_cost_curve(target.model, draft.model if draft else None)
    text = f"{target.ref} on {target.description}; {machine_line(machine)}\n\n" + cost_curve_markdown(curve)
    sys.stdout.write(text)
    if args.markdown:
        args.markdown.write_text(text, encoding="utf-8")
    if args.json:
        doc = {"machine": machine, "target": target.ref, "precision": target.precision, **asdict(curve)}
        args.json.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    return 0


def _command_line(args: argparse.Namespace) -> str:
    """The run as one command with every option explicit: what docs/benchmarks.md quotes."""
    words = ["specdec", "bench", "--target", args.target, "--draft", args.draft]
    words += ["--device", args.device, "--precision", args.precision]
    if args.prompts:
        words += ["--prompts", str(args.prompts)]
    words += ["--max-new-tokens", str(args.max_new_tokens), "--repeats", str(args.repeats)]
    words += ["--methods", args.methods, "--draft-length", args.draft_length]
    words += ["--warmup-tokens", str(args.warmup_tokens)]
    if args.categories:
        words += ["--categories", args.categories]
    if args.ids:
        words += ["--ids", args.ids]
    if args.limit is not None:
        words += ["--limit", str(args.limit)]
    return " ".join(shlex.quote(w) for w in words)


def _draft_length(text: str) -> int | None:
    if text == "auto":
        return None
    if not text.isdigit():
        raise SpecdecError(f"--draft-length must be 'auto' or a whole number, not {text!r}")
    return int(text)


def _method_names(spec: str, draft_spec: str) -> list[str]:
    names = [m.strip() for m in spec.split(",") if m.strip()]
    if draft_spec in ("ngram", "none"):
        # No draft model: the methods that need one are dropped (asked for explicitly: an error).
        asked = [m for m in names if needs_draft_model(m)]
        if asked and spec != ",".join(METHODS):
            raise SpecdecError(f"{', '.join(asked)} need a draft model: pass --draft REF")
        names = [m for m in names if not needs_draft_model(m)]
    return names


def _select_prompts(args: argparse.Namespace) -> list[BenchPrompt]:
    prompts = load_prompts(args.prompts)
    if args.categories:
        wanted = {c.strip() for c in args.categories.split(",")}
        known = {p.category for p in prompts}
        if wanted - known:
            raise SpecdecError(
                f"no prompts in categor(ies) {', '.join(sorted(wanted - known))}; known: {', '.join(sorted(known))}"
            )
        prompts = [p for p in prompts if p.category in wanted]
    if args.ids:
        wanted = {i.strip() for i in args.ids.split(",")}
        missing = wanted - {p.id for p in prompts}
        if missing:
            raise SpecdecError(f"no prompt with id(s) {', '.join(sorted(missing))}")
        prompts = [p for p in prompts if p.id in wanted]
    if args.limit is not None:
        prompts = prompts[: max(1, args.limit)]
    return prompts


def _quiet_transformers() -> None:
    # generate() logs notes about assisted decoding and caches on every call: noise in a progress bar.
    from transformers.utils import logging

    logging.set_verbosity_error()


class _ProgressBar:
    """`[#####.....] 12/112 code-is-prime · ours-draft 5.3 tok/s, ~4 min left` on stderr."""

    def __init__(self, start: float) -> None:
        self.start = start

    def __call__(self, p: BenchProgress) -> None:
        width = 30
        filled = int(width * p.done / p.total) if p.total else 0
        elapsed = time.perf_counter() - self.start
        eta = f", ~{elapsed / p.done * (p.total - p.done) / 60:.0f} min left" if p.done else ""
        speed = f" {p.last_tokens_per_s:.2f} tok/s" if p.last_tokens_per_s is not None else ""
        sys.stderr.write(
            f"\r[{'#' * filled}{'.' * (width - filled)}] {p.done}/{p.total} "
            f"{p.prompt_id} · {p.method}{speed}{eta}\033[K"
        )
        if p.done == p.total and p.total:
            sys.stderr.write("\n")
        sys.stderr.flush()


def _write_outputs(report: BenchReport, args: argparse.Namespace) -> None:
    from .bench_report import plot_speedups, to_markdown

    markdown = to_markdown(report)
    if args.json:
        args.json.write_text(
            json.dumps(report.as_dict(), indent=1, ensure_ascii=False) + "\n", encoding="utf-8"
        )
    if args.markdown:
        args.markdown.write_text(markdown, encoding="utf-8")
    if args.plot:
        plot_speedups(report, args.plot)
    # The summary and the bars on stdout; the per-prompt table stays in the files.
    sys.stdout.write(markdown.split("\n## Speedup vs")[0])
    for label, path in (("json", args.json), ("markdown", args.markdown), ("plot", args.plot)):
        if path:
            print(f"specdec bench: wrote {label} to {path}", file=sys.stderr)
