"""The `specdec` command: one entry point, one subcommand per tool.

`generate` is the headless contract the other tools build on; `models`/`fetch`
(cli_models), `bench` (cli_bench) and `chat` (the Qt app) register themselves.
Errors a user can act on print as one line, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from collections.abc import Sequence

from .chat import Message, encode_chat
from .engine import GenerationParams
from .errors import SpecdecError
from .events import DoneEvent, TokenEvent
from .loading import DEVICES, PRECISIONS
from .progress import Progress

# Subcommand modules contributed by other parts; each has `register(subparsers)`.
_PLUGINS = ("specdec_core.cli_models", "specdec_core.cli_bench", "app.cli")


def add_model_options(parser: argparse.ArgumentParser, draft_default: str | None = None) -> None:
    """--target/--draft/--device/--precision, shared by generate, bench and chat."""
    parser.add_argument(
        "--target", required=draft_default is None, help="model: HF folder, .gguf, catalog name, hub id"
    )
    parser.add_argument(
        "--draft", default=draft_default or "ngram", help="draft model REF, 'ngram' or 'none'"
    )
    parser.add_argument("--device", default="auto", choices=DEVICES)
    parser.add_argument("--precision", default="auto", choices=PRECISIONS)


def add_generation_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--draft-length", default="auto", help="'auto' (adaptive) or a fixed k")


def parse_draft_length(text: str) -> int | None:
    """`--draft-length`: 'auto' (adaptive, None) or a pinned k; shared by generate and bench."""
    if text == "auto":
        return None
    if text.isdigit():
        return int(text)
    raise SpecdecError(f"--draft-length must be 'auto' or a whole number, not {text!r}")


def generation_params(args: argparse.Namespace) -> GenerationParams:
    pinned = parse_draft_length(args.draft_length)
    return GenerationParams(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        draft_length=pinned,
    )


def stderr_progress(p: Progress) -> None:
    """A one-line terminal progress bar on stderr."""
    if p.total > 0:
        width = 30
        filled = int(width * p.done / p.total)
        sys.stderr.write(
            f"\r{p.stage}: [{'#' * filled}{'.' * (width - filled)}] {p.done / 2**20:.0f}/{p.total / 2**20:.0f} MiB"
        )
        if p.done >= p.total:
            sys.stderr.write("\n")
    else:
        sys.stderr.write(f"{p.stage}…\n")
    sys.stderr.flush()


def _register_generate(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("generate", help="generate one answer headlessly (text or --json)")
    add_model_options(p)
    add_generation_options(p)
    p.add_argument("--prompt", required=True, help="the user message")
    p.add_argument("--system", default=None, help="a system prompt")
    p.add_argument("--raw", action="store_true", help="tokenize the prompt as is, without the chat template")
    p.add_argument("--no-calibrate", action="store_true", help="skip timing the target before generating")
    p.add_argument("--json", action="store_true", help="print one JSON document with tokens and stats")
    p.set_defaults(func=_generate)


def _generate(args: argparse.Namespace) -> int:
    from .pair import load_pair

    params = generation_params(args)
    pair = load_pair(
        args.target, args.draft, device=args.device, precision=args.precision, progress=stderr_progress
    )
    print(f"specdec: target on {pair.description}, draft {args.draft}", file=sys.stderr)
    tokenizer = pair.target.tokenizer
    if args.raw:
        prompt_ids = [int(i) for i in tokenizer(args.prompt)["input_ids"]]
    else:
        prompt_ids = encode_chat(tokenizer, [Message("user", args.prompt)], args.system)
    if not args.no_calibrate and params.draft_length is None:
        pair.engine.calibrate()
    tokens: list[dict[str, object]] = []
    done: DoneEvent | None = None
    for event in pair.engine.generate(prompt_ids, params):
        if isinstance(event, TokenEvent):
            tokens.append({"id": event.token_id, "text": event.text, "source": event.source.value})
            if not args.json:
                sys.stdout.write(event.text)
                sys.stdout.flush()
        elif isinstance(event, DoneEvent):
            done = event
    assert done is not None
    stats = done.stats
    if args.json:
        doc = {"prompt_token_ids": prompt_ids, "tokens": tokens, "text": done.text, "stats": stats.as_dict()}
        doc["target"] = {"ref": args.target, "device": pair.target.device, "precision": pair.target.precision}
        json.dump(doc, sys.stdout, ensure_ascii=False)
        sys.stdout.write("\n")
    else:
        sys.stdout.write("\n")
    print(
        f"specdec: {stats.new_tokens} tokens, {stats.tokens_per_second:.2f} tok/s, "
        f"acceptance {stats.acceptance_rate:.0%}, {stats.measured_speedup:.2f}x vs target alone",
        file=sys.stderr,
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specdec", description="Exact speculative decoding for local LLMs.")
    subparsers = parser.add_subparsers(dest="command", required=True)
    _register_generate(subparsers)
    for module_name in _PLUGINS:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name != module_name:  # the plugin exists but something it needs is missing
                raise
            continue
        module.register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except SpecdecError as exc:
        print(f"specdec: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("specdec: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
