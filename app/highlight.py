"""Syntax colours for fenced code blocks, from Pygments, as spans of one line.

The provenance tints are backgrounds, so syntax colours are foregrounds: a code
token keeps both. Lines are lexed one at a time — a streaming answer's code grows
line by line and a finished line never changes colour — at the cost of not
following constructs that span lines (a multi-line string colours only its first
line). Unknown languages and plain text stay uncoloured.
"""

from __future__ import annotations

import threading
from functools import lru_cache

from pygments.lexer import Lexer
from pygments.lexers import get_all_lexers, get_lexer_by_name
from pygments.styles import get_style_by_name
from pygments.token import _TokenType
from pygments.util import ClassNotFound

# Chosen for contrast with the tints underneath: dark text on pale tints, light on deep.
STYLE_FOR_THEME = {"light": "default", "dark": "github-dark"}
PLAIN_LANGUAGES = frozenset({"", "text", "plain", "plaintext", "txt", "output", "console-output"})
# What chat answers mostly contain; the first lookup of a lexer takes ~0.1-0.2 s.
COMMON_LANGUAGES = ("python", "bash", "javascript", "typescript", "json", "c", "cpp", "rust", "go", "java")

Span = tuple[int, int, str]  # start, end (in the line), "#rrggbb"


@lru_cache(maxsize=1)
def _builtin_aliases() -> frozenset[str]:
    # Pygments' own lexers only: looking up a name it lacks would scan the installed
    # packages for plugin lexers (~0.1 s on the UI thread, for every unknown name;
    # scripts/transcript-timings measures both).
    return frozenset(alias for _, aliases, _, _ in get_all_lexers(plugins=False) for alias in aliases)


@lru_cache(maxsize=64)
def _lexer(language: str) -> Lexer | None:
    if language.lower() in PLAIN_LANGUAGES or language.lower() not in _builtin_aliases():
        return None
    try:
        # No stripping or added newline: token offsets must match the line's characters.
        return get_lexer_by_name(language, stripnl=False, stripall=False, ensurenl=False)
    except ClassNotFound:
        return None


class Highlighter:
    """Colours for code lines in one Pygments style."""

    def __init__(self, theme: str = "light") -> None:
        self._style = get_style_by_name(STYLE_FOR_THEME.get(theme, STYLE_FOR_THEME["light"]))
        self._colors: dict[_TokenType, str | None] = {}

    def spans(self, language: str, line: str) -> list[Span]:
        """Coloured stretches of `line` (uncoloured characters are left out)."""
        lexer = _lexer(language)
        if lexer is None or not line:
            return []
        out: list[Span] = []
        for start, kind, value in lexer.get_tokens_unprocessed(line):
            color = self._color(kind)
            if color is None or not value:
                continue
            if out and out[-1][1] == start and out[-1][2] == color:
                out[-1] = (out[-1][0], start + len(value), color)  # fewer, longer fragments
            else:
                out.append((start, start + len(value), color))
        return out

    def _color(self, kind: _TokenType) -> str | None:
        if kind not in self._colors:
            color = self._style.style_for_token(kind).get("color")
            self._colors[kind] = f"#{color}" if color else None
        return self._colors[kind]


def warm_up(languages: tuple[str, ...] = COMMON_LANGUAGES) -> threading.Thread:
    """Load the common lexers in a background thread, so that the first code block of a
    session does not stall the UI thread while Pygments imports and compiles a lexer."""

    def load() -> None:
        for language in languages:
            lexer = _lexer(language)
            if lexer is not None:
                list(lexer.get_tokens_unprocessed("x"))

    thread = threading.Thread(target=load, name="specdec-lexers", daemon=True)
    thread.start()
    return thread
