"""The `specdec` command: one entry point, one subcommand per tool.

`generate` is the headless contract the other tools build on; `models`/`fetch`
(cli_models), `bench` (cli_bench) and `chat` (the Qt app) register themselves.
Every failure prints one line, `specdec: error: ...`, and exits 2 when the user can
change something (input, model, machine) or 1 for a bug of ours (`--debug` shows the
traceback); Ctrl-C exits 130. Heavy imports (torch, transformers) happen inside
`main`'s handlers, so even an interrupt during start-up is one line.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import json
import os
import sys
import traceback
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ..errors import InternalError, InvalidParameter, SpecdecError
from ..progress import TerminalProgress
from ..startup import prepare_process

if TYPE_CHECKING:
    from ..engine.speculative import GenerationParams
    from ..session import ChatSession, LoadSpec

# Subcommand modules contributed by other parts; each has `register(subparsers)`.
_PLUGINS = (
    "specdec_core.tools.cli_models",
    "specdec_core.tools.cli_bench",
    "specdec_core.tools.cli_eval",
    "specdec_app.cli",
)


def add_model_options(
    parser: argparse.ArgumentParser, draft_default: str | None = None, *, server: bool = False
) -> None:
    """--target/--draft/--device/--precision/--offload/--trust-remote-code, shared by generate, bench and chat.

    With `server`, also --server/--served-model (a served engine instead of a local target)."""
    from ..models.loading import DEVICES, PRECISIONS

    parser.add_argument(
        "--target",
        required=draft_default is None and not server,
        help="model: HF folder, .gguf, catalog name, hub id",
    )
    if server:
        parser.add_argument(
            "--server",
            metavar="URL",
            default=None,
            help="answer through an OpenAI-compatible server instead, e.g. http://127.0.0.1:8080/v1 "
            "(API key: SPECDEC_API_KEY or the keyring; see docs/serving.md)",
        )
        parser.add_argument(
            "--served-model",
            default="",
            help="with --server: the model to ask for (default: the one it serves)",
        )
    parser.add_argument(
        "--draft", default=draft_default or "ngram", help="draft model REF, 'ngram' or 'none'"
    )
    parser.add_argument("--device", default="auto", choices=DEVICES)
    parser.add_argument("--precision", default="auto", choices=PRECISIONS)
    parser.add_argument(
        "--offload", action="store_true", help="CUDA: put layers that do not fit on the CPU (slow)"
    )
    parser.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="allow a model's own Python code (auto_map) to run; only for authors you trust",
    )


def load_spec(args: argparse.Namespace, *, draft_fallback: bool = True) -> LoadSpec:
    from ..session import LoadSpec

    server = getattr(args, "server", None)
    if server and args.target:
        raise InvalidParameter("give --target or --server, not both")
    if not server and not args.target:
        raise InvalidParameter("--target or --server is required")
    return LoadSpec(
        target=server or args.target,
        draft=args.draft,
        device=args.device,
        precision=args.precision,
        offload=getattr(args, "offload", False),
        trust_remote_code=getattr(args, "trust_remote_code", False),
        draft_fallback=draft_fallback,
        served_model=getattr(args, "served_model", "") or "",
    )


def add_generation_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-new-tokens", type=_number(int), default=256)
    parser.add_argument("--temperature", type=_number(float), default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-p", type=_number(float), default=1.0)
    parser.add_argument("--top-k", type=_number(int), default=0)
    parser.add_argument("--seed", type=_number(int), default=None)
    parser.add_argument("--draft-length", default="auto", help="'auto' (adaptive) or a fixed k")


def parse_draft_length(text: str) -> int | None:
    """`--draft-length`: 'auto' (adaptive, None) or a pinned k; shared by generate and bench."""
    if text == "auto":
        return None
    if text.isdigit():
        return int(text)
    raise InvalidParameter(f"--draft-length must be 'auto' or a whole number, not {text!r}")


def generation_params(args: argparse.Namespace) -> GenerationParams:
    """The parameters of the command line, checked against their ranges (before any model loads)."""
    from ..engine.speculative import GenerationParams
    from ..session import check_params

    pinned = parse_draft_length(args.draft_length)
    params = GenerationParams(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        draft_length=pinned,
    )
    try:
        check_params(params)
    except InvalidParameter as exc:  # name the flag the user typed
        name = str(exc).split(" ", 1)[0]
        raise InvalidParameter(f"--{name.replace('_', '-')} {str(exc).split(' ', 1)[1]}") from None
    return params


def _number(kind: type) -> Any:
    """An argparse type whose error message is ours (and one line)."""

    def parse(text: str) -> Any:
        try:
            return kind(text)
        except ValueError:
            word = "a whole number" if kind is int else "a number"
            raise argparse.ArgumentTypeError(f"must be {word}, not {text!r}") from None

    parse.__name__ = kind.__name__
    return parse


def _register_generate(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("generate", help="generate one answer headlessly (text or --json)")
    add_model_options(p, server=True)
    add_generation_options(p)
    p.add_argument("--prompt", required=True, help="the user message")
    p.add_argument("--system", default=None, help="a system prompt")
    p.add_argument("--raw", action="store_true", help="tokenize the prompt as is, without the chat template")
    p.add_argument("--no-calibrate", action="store_true", help="skip timing the target before generating")
    p.add_argument("--json", action="store_true", help="print one JSON document with tokens and stats")
    p.add_argument(
        "--check-exactness",
        action="store_true",
        help="with --server: answer the prompt greedily with speculation on and off and compare token for token",
    )
    p.add_argument(
        "--against",
        metavar="URL",
        default=None,
        help="with --check-exactness: the same model served without a draft, for a server that cannot "
        "switch speculation off per request",
    )
    p.set_defaults(func=_generate)


def _generate(args: argparse.Namespace) -> int:
    from ..engine.events import DoneEvent, PrefillEvent, ReadingEvent, TokenEvent
    from ..models.chat import Message, check_text
    from ..session import ChatSession

    params = generation_params(args)  # bad input fails before minutes of loading
    check_text(args.prompt, "--prompt")
    if args.system:
        check_text(args.system, "--system")
    if args.raw and not args.prompt:
        raise InvalidParameter("--prompt is empty: a --raw prompt needs at least one token")
    spec = load_spec(args, draft_fallback=False)
    if (args.check_exactness or args.against) and not args.server:
        raise InvalidParameter("--check-exactness and --against need --server")
    if not args.server:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # the weights' bar: ours is the one terminal bar
    session = ChatSession()
    # A draft that does not fit is refused here, not replaced: the run asked for it.
    progress = TerminalProgress()
    info = session.load(spec, progress=progress)
    progress.close()
    if info.warning:  # before any branch: a served engine's key notices matter to every command
        print(f"specdec: warning: {info.warning}", file=sys.stderr)
    if args.check_exactness:
        return _check_server(args, session, params)
    print(f"specdec: target on {info.description}, draft {info.draft_name}", file=sys.stderr)
    if info.fidelity:
        print(f"specdec: fidelity: {info.fidelity}", file=sys.stderr)
    if info.exactness is not None:
        print(f"specdec: exactness: {info.exactness.summary()}", file=sys.stderr)
    if not args.no_calibrate and params.draft_length is None:
        session.calibrate()
    if args.raw:
        events = session.complete(args.prompt, params=params)
    else:
        events = session.answer([Message("user", args.prompt)], system=args.system, params=params)
    tokens: list[dict[str, object]] = []
    done: DoneEvent | None = None
    show_reading = sys.stderr.isatty()  # one line, rewritten in place
    for event in events:
        if isinstance(event, ReadingEvent) and show_reading:
            sys.stderr.write(f"\rspecdec: reading the prompt: {event.read:,} of {event.total:,} tokens")
            sys.stderr.flush()
        elif isinstance(event, PrefillEvent) and show_reading:
            sys.stderr.write("\r\033[K")  # the reading line, if any, gives way to the answer
            sys.stderr.flush()
        elif isinstance(event, TokenEvent):
            token_id = None if event.token_id < 0 else event.token_id  # -1: the server did not say
            tokens.append({"id": token_id, "text": event.text, "source": event.source.value})
            if not args.json and not event.is_stop:  # a stop token is counted, never printed
                sys.stdout.write(event.text)
                sys.stdout.flush()
        elif isinstance(event, DoneEvent):
            done = event
    if done is None:
        raise InternalError("the generation ended without its final event")
    _report(args, session, done, tokens)
    return 0


def _report(
    args: argparse.Namespace, session: ChatSession, done: Any, tokens: list[dict[str, object]]
) -> None:
    """The answer's end: the JSON document (--json) or a newline, then the stats line on stderr."""
    stats = done.stats
    info = session.info
    assert info is not None
    if args.json:
        prompt_ids = None if info.server else list(session.engine.target.ids[: stats.prompt_tokens] or [])
        doc: dict[str, Any] = {"prompt_token_ids": prompt_ids, "tokens": tokens, "text": done.text}
        doc["stats"] = stats.as_dict()  # with the self-check's exactness label and max logit difference
        doc["target"] = {
            "ref": info.target, "device": info.device, "precision": info.precision or None,
            "fidelity": info.fidelity or None,
        }  # fmt: skip
        draft_ref = info.server.speculation if info.server else info.draft  # a server runs its own
        doc["draft"] = {"ref": draft_ref, "precision": info.draft_precision or None}
        if info.server:
            doc["server"] = _served_fields(info.server, stats)
        json.dump(doc, sys.stdout, ensure_ascii=False)
    sys.stdout.write("\n")
    sys.stdout.flush()
    if stats.stop_reason == "context_full":
        print(
            f"specdec: warning: the answer reached the model's last position ({info.context_length} "
            "tokens of context) and was cut there",
            file=sys.stderr,
        )
    if stats.stop_reason == "server_stopped":
        print(f"specdec: warning: the answer ended early: {stats.note}", file=sys.stderr)
    speedup = f"{stats.measured_speedup:.2f}x" if stats.speedup_known else "speedup unknown"
    print(
        f"specdec: {stats.new_tokens} tokens, {stats.tokens_per_second:.2f} tok/s, "
        f"acceptance {stats.acceptance_rate:.0%}, {speedup} vs target alone",
        file=sys.stderr,
    )


def _served_fields(server: Any, stats: Any) -> dict[str, Any]:
    """What a served engine provided, field by field, for --json (the rest was timed here)."""
    return {
        "url": server.url,
        "kind": server.kind,
        "model": server.model,
        "speculation": server.speculation,
        "exactness": server.exactness,
        "provided": {
            "token_ids": "server" if server.token_ids else "unavailable",
            "draft_counts": "server" if server.kind in ("llama.cpp", "vLLM") else "unavailable",
            "tokens_per_second": "measured here",
            "measured_speedup": "measured against the server with speculation off"
            if stats.speedup_known
            else "unknown",
            "token_sources": "unknown",
        },
        "notes": [*server.notes, *([stats.note] if stats.note else [])],
    }


def _check_server(args: argparse.Namespace, session: ChatSession, params: GenerationParams) -> int:
    """--check-exactness: one line with the verdict; exit 0 when the answers are identical, else 1."""
    result = session.check_server_exactness(args.prompt, against=args.against, params=params)
    if args.json:
        json.dump(dataclasses.asdict(result), sys.stdout, ensure_ascii=False)
        sys.stdout.write("\n")
    print(f"specdec: exactness: {result.summary()} ({result.drafted} draft tokens)", file=sys.stderr)
    return 0 if result.identical else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specdec", description="Exact speculative decoding for local LLMs.")
    parser.add_argument("--debug", action="store_true", help="print the traceback of an error")
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
    debug = "--debug" in (sys.argv[1:] if argv is None else argv)
    try:
        prepare_process()
        _quiet_transformers()
        args = build_parser().parse_args(argv)
        return int(args.func(args))
    except SpecdecError as exc:
        if debug:
            traceback.print_exc()
        print(f"specdec: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except ImportError as exc:  # prepare_process: a transformers we cannot drive
        print(f"specdec: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("specdec: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader went away (`specdec generate ... | head -1`): stop quietly, as cat does,
        # and keep Python from complaining when it flushes stdout at exit.
        _detach_stdout()
        return 141
    except MemoryError:
        print("specdec: error: out of memory: free memory or raise the limit (ulimit -v)", file=sys.stderr)
        return 2
    except Exception as exc:  # a bug: one line, the traceback with --debug
        if debug:
            traceback.print_exc()
        detail = " ".join(str(exc).split())
        if isinstance(exc, ImportError | OSError) and "failed to map segment" in detail:
            # A library could not even be mapped: the address-space limit, not a bug.
            print(
                "specdec: error: not enough memory to start (a library failed to map into memory): "
                "free memory or raise the limit (ulimit -v)",
                file=sys.stderr,
            )
            return 2
        print(
            f"specdec: error: internal error: {type(exc).__name__}: {detail} (rerun with --debug for the traceback)",
            file=sys.stderr,
        )
        return 1


def _detach_stdout() -> None:
    with contextlib.suppress(OSError, ValueError, AttributeError):  # no real file behind stdout (tests)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def _quiet_transformers() -> None:
    """transformers' own warnings and load reports are not ours to print: what matters
    reaches the user as one of our lines. Read by transformers when it is first imported,
    so `specdec --help` imports nothing heavy for it."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


if __name__ == "__main__":
    sys.exit(main())
