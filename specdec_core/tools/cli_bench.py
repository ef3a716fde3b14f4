"""`specdec bench`: the command line of `bench` (what runs) and `bench_report` (what it writes).

Progress goes to stderr; the summary table to stdout; `--json`, `--markdown` and
`--plot` write files. See docs/benchmarks.md for the documented full run.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from contextlib import ExitStack
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ..errors import SpecdecError
from ..kernels.cpu.huge_pages import granted_bytes
from ..kernels.cpu.threads import default_governor
from ..progress import Progress, TerminalProgress
from .bench import (
    ALL_METHODS,
    AUTO_DRAFTER,
    BASELINE,
    PEER_METHODS,
    BenchProgress,
    BenchPrompt,
    BenchReport,
    BenchSettings,
    Decoding,
    Method,
    build_methods,
    check_exactness,
    load_prompts,
    needs_draft_model,
    run_bench,
    start_peers,
)
from .cli import add_model_options, parse_draft_length


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "bench",
        help="time our engine against the target alone and transformers' assisted generation",
        description="Runs every method on every prompt, interleaved, same weights and precision: greedy "
        "(texts compared with the target's), or seeded sampling with --temperature.",
    )
    from ..models.catalog import DEFAULT_DRAFT, DEFAULT_TARGET

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
        default=",".join(ALL_METHODS),
        help=f"comma-separated subset of {','.join(ALL_METHODS)} (target is always needed; "
        "llama-server methods are skipped, with the reason, where they cannot run)",
    )
    p.add_argument(
        "--llama-server",
        type=Path,
        default=None,
        metavar="PATH",
        help="llama.cpp's llama-server binary (default: one on PATH or beside this Python)",
    )
    p.add_argument("--categories", default=None, help="comma-separated categories to keep")
    p.add_argument("--ids", default=None, help="comma-separated prompt ids to keep")
    p.add_argument("--limit", type=int, default=None, help="keep the first N prompts (after --categories)")
    p.add_argument(
        "--draft-length", default="auto", help="our methods' k: 'auto' (adaptive, as the app) or a fixed K"
    )
    p.add_argument("--warmup-tokens", type=int, default=16, help="length of each method's warm-up generation")
    p.add_argument(
        "--temperature", type=float, default=0.0,
        help="sample every method at this temperature, seeded (0: greedy, texts compared)",
    )  # fmt: skip
    p.add_argument("--top-k", type=int, default=0, help="with --temperature: top-k (0: off)")
    p.add_argument("--top-p", type=float, default=1.0, help="with --temperature: top-p (1: off)")
    p.add_argument("--seed", type=int, default=0, help="with --temperature: every method's seed")
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
    p.add_argument(
        "--under-load",
        action="store_true",
        help="only time the target alone (our engine) quiet and beside one busy process, "
        "threads pinned vs chosen by the governor",
    )
    p.set_defaults(func=_bench)


def _bench(args: argparse.Namespace) -> int:
    from ..models.loading import load_model
    from ..models.pair import load_draft

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
    settings = BenchSettings(args.max_new_tokens, args.repeats, args.warmup_tokens, _decoding(args))
    if settings.max_new_tokens < 1 or settings.repeats < 1:
        raise SpecdecError("--max-new-tokens and --repeats must be at least 1")
    draft_length = parse_draft_length(args.draft_length)
    _quiet_transformers()

    from .bench.render import machine_info

    machine = machine_info()  # before loading: the load average then is the machine's, not ours
    progress = TerminalProgress()
    target = load_model(target_ref, device=args.device, precision=args.precision, progress=progress)
    needs_draft = any(needs_draft_model(m) for m in methods)
    if args.cost_curve or args.under_load:
        needs_draft = args.cost_curve and draft_spec not in ("ngram", "none")
    draft = load_draft(draft_spec, target, progress=progress)[1] if needs_draft else None
    progress.close()
    if args.cost_curve:
        return _cost_curve(target, draft, machine, args)
    if args.under_load:
        return _under_load(target, prompts[0], machine, args)
    print(f"specdec bench: target on {target.description}, calibrating…", file=sys.stderr)
    built = _build_ours(methods, target, draft, draft_length, settings.decoding)
    exactness = check_exactness(built)
    with ExitStack() as servers:
        peers, skipped = _start_peers(methods, target_ref, draft_spec, args, servers, settings.decoding)
        everything: dict[str, Method] = {**built, **peers}
        start = time.perf_counter()
        label = str(exactness["label"]) if exactness else "unchecked"
        results = run_bench(everything, prompts, target.tokenizer, settings, _BenchBar(progress), label)
        wall = time.perf_counter() - start
    config = {
        **_run_config(args, target, draft, settings, len(prompts)),
        "methods": list(everything),
        "skipped_methods": skipped,
        "exactness": exactness,
        "wall_seconds": round(wall, 1),
    }
    _write_outputs(BenchReport.build(config, machine, results), args)
    return 0


def _run_config(
    args: argparse.Namespace, target: Any, draft: Any, settings: BenchSettings, prompts: int
) -> dict[str, Any]:
    """What was asked and what it resolved to: the JSON's `config` (with what the run adds)."""
    return {
        "command": _command_line(args),
        "target": args.target,
        "draft": args.draft if draft is not None else None,
        "device": target.device,
        "precision": target.precision,
        # "int8/int4": 4-bit draft steps; "int4 (int8 reads)": long reads in int8 (draft_bulk)
        "draft_precision": draft.precision if draft is not None else None,
        "int8_kernel": _int8_kernel(target.device, target.precision),
        "huge_page_bytes": granted_bytes(),  # the process's memory in 2 MB pages (huge_pages)
        "max_new_tokens": settings.max_new_tokens,
        "repeats": settings.repeats,
        "warmup_tokens": settings.warmup_tokens,
        "prompts_file": str(args.prompts) if args.prompts else "default suite",
        "prompts": prompts,
        "auto_drafter": AUTO_DRAFTER,
        "draft_length": args.draft_length,
        "decoding": asdict(settings.decoding),
        "threads": _threads_config(),
    }


def _int8_kernel(device: str, precision: str) -> str | None:
    """Which CPU int8 kernel the linears run (quant_cpu), with oneDNN's ISA cap if any."""
    if device != "cpu" or precision != "int8":
        return None
    from ..kernels.cpu.quant_cpu import ONEDNN_ISA_ENV, kernel_name

    name = kernel_name()
    return f"{name} ({os.environ[ONEDNN_ISA_ENV]})" if name == "onednn" and ONEDNN_ISA_ENV in os.environ else name


def _decoding(args: argparse.Namespace) -> Decoding:
    """Every method's way of picking tokens, checked as the session checks a chat's parameters."""
    if args.temperature < 0 or args.top_k < 0 or not 0 < args.top_p <= 1:
        raise SpecdecError("--temperature and --top-k must be at least 0, --top-p in (0, 1]")
    return Decoding(args.temperature, args.top_k, args.top_p, args.seed)


def _build_ours(
    methods: list[str], target: Any, draft: Any, draft_length: int | None, decoding: Decoding
) -> dict[str, Method]:
    from ..models.chat import stop_token_ids

    return build_methods(
        methods,
        target.model,
        target.tokenizer,
        sorted(stop_token_ids(target.tokenizer, target.model)),
        draft_model=draft.model if draft else None,
        draft_name=draft.name if draft else "draft",
        draft_length=draft_length,
        decoding=decoding,
    )


def _start_peers(
    methods: list[str], target_ref: str, draft_spec: str, args: argparse.Namespace, stack: ExitStack,
    decoding: Decoding,
) -> tuple[dict[str, Method], dict[str, str]]:  # fmt: skip
    """llama.cpp's server at our thread count; skipped methods are said on stderr and kept in the JSON."""
    wanted = [m for m in methods if m in PEER_METHODS]
    if wanted:
        print("specdec bench: starting llama-server…", file=sys.stderr)
    draft_ref = None if draft_spec in ("ngram", "none") else draft_spec
    threads = default_governor().max_threads
    peers, skipped = start_peers(
        wanted, target_ref, draft_ref, threads, stack, args.llama_server, decoding=decoding
    )
    for name, reason in skipped.items():
        print(f"specdec bench: skipping {name}: {reason}", file=sys.stderr)
    return dict(peers), skipped


def _threads_config() -> dict[str, object]:
    governor = default_governor()
    return {"max": governor.max_threads, "pinned": governor.pinned, "cores": governor.cores}


def _cost_curve(target: Any, draft: Any, machine: dict[str, Any], args: argparse.Namespace) -> int:
    from .bench import measure_bandwidth, measure_cost_curve, measure_fusion_gain, step_bytes
    from .bench.render import cost_curve_markdown, fusion_markdown, machine_line, roofline_markdown

    print("specdec bench: timing forwards…", file=sys.stderr)
    curve = measure_cost_curve(target.model, draft.model if draft else None)
    bandwidth = measure_bandwidth() if target.device == "cpu" else None
    one_core = measure_bandwidth(threads=1) if target.device == "cpu" else None
    models = {"target": step_bytes(target.model, curve.context_tokens)}
    if draft is not None:
        models["draft"] = step_bytes(draft.model, curve.context_tokens)
    text = (
        f"{target.ref} on {target.description}; {machine_line(machine)}\n\n"
        + cost_curve_markdown(curve)
        + "\n"
        + roofline_markdown(curve, models, bandwidth, one_core=one_core)
    )
    # Loaded unfused (SPECDEC_FUSE=0): also time what fusing would change, interleaved.
    gains = {}
    for name, loaded in (("target", target), ("draft", draft)):
        if loaded is not None and not _is_fused(loaded.model):
            gain = measure_fusion_gain(loaded.model)
            if gain is not None:
                gains[name] = gain
    if gains:
        text += "\n" + fusion_markdown(gains)
    doc = {
        "machine": machine,
        "target": target.ref,
        "precision": target.precision,
        **asdict(curve),
        "step_bytes": {name: asdict(b) for name, b in models.items()},
        "bandwidth_bytes_per_s": bandwidth,
        "bandwidth_one_thread_bytes_per_s": one_core,
        "fused": _is_fused(target.model),
        "fusion_gain": {name: asdict(g) for name, g in gains.items()},
    }
    return _write_report(text, doc, args)


def _under_load(target: Any, prompt: BenchPrompt, machine: dict[str, Any], args: argparse.Namespace) -> int:
    from ..engine.speculative import SpeculativeEngine
    from ..models.chat import stop_token_ids
    from .bench import encode_prompt, measure_under_load
    from .bench.render import machine_line, under_load_markdown

    engine = SpeculativeEngine(
        target.model, target.tokenizer, stop_token_ids=stop_token_ids(target.tokenizer, target.model)
    )
    print("specdec bench: timing the target quiet and beside a busy process…", file=sys.stderr)
    ids = encode_prompt(target.tokenizer, prompt)
    runs = measure_under_load(engine, ids, args.max_new_tokens, args.repeats)
    text = f"{target.ref} on {target.description}; {machine_line(machine)}\n\n" + under_load_markdown(runs)
    doc = {
        "machine": machine,
        "target": target.ref,
        "prompt": prompt.id,
        "runs": [asdict(r) for r in runs],
    }
    return _write_report(text, doc, args)


def _write_report(text: str, doc: dict[str, Any], args: argparse.Namespace) -> int:
    """The markdown on stdout (and in --markdown), the document in --json."""
    sys.stdout.write(text)
    if args.markdown:
        args.markdown.write_text(text, encoding="utf-8")
    if args.json:
        args.json.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    return 0


def _is_fused(model: Any) -> bool:
    from ..kernels.cpu.fused_int8 import FusedGateUpMLP, FusedProjection

    return any(isinstance(m, (FusedProjection, FusedGateUpMLP)) for m in model.modules())


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
    words += ["--cost-curve"] if args.cost_curve else []
    words += ["--under-load"] if args.under_load else []
    if args.llama_server:
        words += ["--llama-server", str(args.llama_server)]
    return " ".join(shlex.quote(w) for w in words)


def _method_names(spec: str, draft_spec: str) -> list[str]:
    """The methods asked for, checked before any model loads."""
    names = [m.strip() for m in spec.split(",") if m.strip()]
    unknown = sorted(set(names) - set(ALL_METHODS))
    if unknown:
        raise SpecdecError(f"unknown method(s) {', '.join(unknown)}: choose from {', '.join(ALL_METHODS)}")
    if BASELINE not in names:
        raise SpecdecError(f"the methods must include {BASELINE!r}: it is the reference output and speed")
    if draft_spec in ("ngram", "none"):
        # No draft model: the methods that need one are dropped (asked for explicitly: an error).
        asked = [m for m in names if needs_draft_model(m)]
        if asked and spec != ",".join(ALL_METHODS):
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


class _BenchBar:
    """The bench's runs on the one terminal bar (`progress.TerminalProgress`), with the
    current prompt, method and speed after it."""

    def __init__(self, bar: TerminalProgress) -> None:
        self.bar = bar

    def __call__(self, p: BenchProgress) -> None:
        speed = f" {p.last_tokens_per_s:.2f} tok/s" if p.last_tokens_per_s is not None else ""
        self.bar(Progress("Benchmarking", p.done, p.total, unit="runs"), f"{p.prompt_id} · {p.method}{speed}")
        if p.total and p.done >= p.total:
            self.bar.close()


def _write_outputs(report: BenchReport, args: argparse.Namespace) -> None:
    from .bench.render import plot_speedups, to_markdown

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
