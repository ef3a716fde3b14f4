"""The chat window's command-line options, shared by `specdec chat`, `specdec-chat` and the settings.

Qt-free, so that `specdec --help` does not import Qt.
"""

from __future__ import annotations

import argparse

from specdec_core import add_model_options

# The colour themes a user can pick (settings.py keeps the choice).
THEMES = ("system", "light", "dark")


def add_chat_options(parser: argparse.ArgumentParser) -> None:
    """The same model options as `specdec generate`; unset means "last used, else the default pair"."""
    add_model_options(parser, draft_default="ngram", server=True)
    # None marks "not given on the command line" so the window can fall back to the last
    # used model (settings) and then to the catalog's default pair.
    parser.set_defaults(target=None, draft=None, device=None, precision=None)
    parser.add_argument("--theme", choices=THEMES, default=None, help="colour theme (default: the system's)")
    parser.add_argument(
        "--smoke-test",
        metavar="PROMPT",
        default=None,
        help="check that the app works, with no display needed: open the window offscreen (unless "
        "QT_QPA_PLATFORM says otherwise), load the models, send PROMPT, stop after the first tokens, "
        "print one line and exit 0, or 1 with the error; conversations and settings are left as they were",
    )


def chat_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specdec chat", description="Chat with a local model in a window.")
    add_chat_options(parser)
    return parser
