"""Code comments state rules; the figures behind them live in the docs.

A comment or docstring in `specdec_core` (outside `bench/`, whose prompts and targets are
data) or `app` carries no timing figure: no `12 ms`, `9.5 tok/s`, `1.06x` or `1.5×`. It
says which rule the code keeps and links the doc section that holds the measurement
(`docs/performance.md#measurements-behind-the-design`), and every such link names a
heading that exists.
Python comments are COMMENT tokens and docstrings (string tokens that are statements);
C comments are `//` and `/* */` spans outside string and character literals.
"""

from __future__ import annotations

import io
import re
import tokenize
from collections.abc import Iterator
from pathlib import Path

from test_docs import _anchors

ROOT = Path(__file__).resolve().parent.parent
SCANNED = ("specdec_core", "app")
SKIPPED = ROOT / "specdec_core" / "tools" / "bench"

_FIGURE = re.compile(
    r"\d+(?:\.\d+)?\s*(?:ms|µs|us|ns|tok/s)(?![\w/])"  # a duration or a speed
    r"|\b\d+\.\d+x\b"  # a ratio written 1.06x
    r"|\d+(?:\.\d+)?\s*×"  # a ratio written 1.06×
)
_DOC_LINK = re.compile(r"docs/[\w./-]+\.md#[\w-]+")
_STATEMENT_START = {tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENCODING}


def _lines(start_line: int, text: str) -> Iterator[tuple[int, str]]:
    for offset, line in enumerate(text.splitlines()):
        yield start_line + offset, line


def python_comments(source: str) -> Iterator[tuple[int, str]]:
    """(line, text) of each comment and each line of a string that stands as a statement."""
    tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    previous = tokenize.ENCODING  # what came before the first token: a statement may start
    for index, token in enumerate(tokens):
        if token.type == tokenize.COMMENT:
            yield token.start[0], token.string
        elif token.type == tokenize.STRING and previous in _STATEMENT_START:
            following = tokens[index + 1].type if index + 1 < len(tokens) else tokenize.ENDMARKER
            if following in (tokenize.NEWLINE, tokenize.ENDMARKER, tokenize.COMMENT):
                yield from _lines(token.start[0], token.string)
        if token.type not in (tokenize.COMMENT, tokenize.NL):
            previous = token.type


def c_comments(source: str) -> Iterator[tuple[int, str]]:
    """(line, text) of each line of every `//` and `/* */` comment outside literals."""
    index, line = 0, 1
    while index < len(source):
        char = source[index]
        if char in "\"'":
            end = index + 1
            while end < len(source) and source[end] not in (char, "\n"):
                end += 2 if source[end] == "\\" else 1
            line += source.count("\n", index, end)
            index = end + 1
        elif source.startswith("//", index):
            end = source.find("\n", index)
            end = len(source) if end < 0 else end
            yield line, source[index:end]
            index = end
        elif source.startswith("/*", index):
            end = source.find("*/", index + 2)
            end = len(source) if end < 0 else end + 2
            yield from _lines(line, source[index:end])
            line += source.count("\n", index, end)
            index = end
        else:
            line += char == "\n"
            index += 1


def figures_in(path: Path) -> list[str]:
    """`path:line: text` for each comment line of `path` that carries a timing figure."""
    source = path.read_text(encoding="utf-8")
    comments = python_comments(source) if path.suffix == ".py" else c_comments(source)
    name = path.relative_to(ROOT)
    return [f"{name}:{number}: {text.strip()}" for number, text in comments if _FIGURE.search(text)]


def broken_doc_links(path: Path) -> list[str]:
    """`path:line: link` for each `docs/....md#anchor` in a comment of `path` whose heading is gone."""
    source = path.read_text(encoding="utf-8")
    comments = python_comments(source) if path.suffix == ".py" else c_comments(source)
    broken = []
    for number, text in comments:
        for link in _DOC_LINK.findall(text):
            doc, _, anchor = link.partition("#")
            if not (ROOT / doc).is_file() or anchor not in _anchors(ROOT / doc):
                broken.append(f"{path.relative_to(ROOT)}:{number}: {link}")
    return broken


def scanned_files() -> list[Path]:
    files = []
    for folder in SCANNED:
        for path in sorted((ROOT / folder).rglob("*")):
            if path.suffix in (".py", ".c", ".h") and SKIPPED not in path.parents:
                files.append(path)
    return files


def test_no_comment_or_docstring_in_the_code_carries_a_timing_figure() -> None:
    found = [hit for path in scanned_files() for hit in figures_in(path)]
    message = "timing figures in code comments (move them to docs/performance.md):\n"
    assert found == [], message + "\n".join(found)


def test_every_doc_section_a_code_comment_links_exists() -> None:
    broken = [link for path in scanned_files() for link in broken_doc_links(path)]
    assert broken == [], "links to missing doc sections in code comments:\n" + "\n".join(broken)


def test_the_scan_covers_the_kernels_and_the_app() -> None:
    names = {path.name for path in scanned_files()}
    assert {"speculative.py", "int4_cpu.c", "simd16.h", "window.py"} <= names
    assert not any(SKIPPED in path.parents for path in scanned_files())


def test_python_figures_are_found_in_comments_and_docstrings_only() -> None:
    source = (
        '"""Module doc: 36.0 ms a step."""\n'
        "X = 1  # 1.064x faster\n"
        "def f() -> str:\n"
        '    """Rows: 16 rows, 9.5 tok/s."""\n'
        '    return "a string value of 12 ms is data, not a comment"\n'
        "Y = [\n"
        '    "a list item of 3 ms",\n'
        "]\n"
        '"""A bare string: 2× the speed."""\n'
    )
    hits = [number for number, text in python_comments(source) if _FIGURE.search(text)]
    assert hits == [1, 2, 4, 9]


def test_c_figures_are_found_in_comments_outside_literals() -> None:
    source = (
        "/* Block comment,\n"
        "   36.0 -> 33.9 ms on one CPU. */\n"
        'const char *s = "// 12 ms in a string";\n'
        "int x = '/'; // 1.5x here\n"
        "int rows = 16; /* 16 rows, a unit that is not a figure */\n"
    )
    hits = [number for number, text in c_comments(source) if _FIGURE.search(text)]
    assert hits == [2, 4]


def test_units_that_are_not_timings_pass() -> None:
    for text in ("16 rows", "64 bytes", "T(k) in ms per step", "0x1F", "2 MB pages", "k = 8 tokens", "3x3"):
        assert not _FIGURE.search(text), text
