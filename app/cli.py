"""`specdec chat`: open the desktop window (registered into the `specdec` command)."""

from __future__ import annotations

import argparse

from .options import add_chat_options


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("chat", help="open the chat window (default: the catalog's default pair)")
    add_chat_options(parser)
    parser.set_defaults(func=_chat)


def _chat(args: argparse.Namespace) -> int:
    from .main import run  # Qt is imported only when the window is wanted

    return run(args)
