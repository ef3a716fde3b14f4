"""`specdec-chat --smoke-test PROMPT` in-process: one line and exit 0 after the first tokens, or
1 with the error; the user's conversations and settings are not touched. (tests/test_bundle.py
runs the same option in the built bundle.)"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from specdec_app.conversations import DATA_DIR_ENV
from specdec_app.main import run
from specdec_app.options import chat_parser


@pytest.fixture
def user_dirs(tmp_path, monkeypatch) -> Path:
    """A home of the user's own: where conversations and settings would go without the scratch folder."""
    monkeypatch.delenv(DATA_DIR_ENV, raising=False)
    for name in ("XDG_DATA_HOME", "XDG_CONFIG_HOME"):
        monkeypatch.setenv(name, str(tmp_path / name))
    return tmp_path


def _smoke(*args: str) -> int:
    argv = [*args, "--device", "cpu", "--precision", "fp32", "--smoke-test", "def add(a, b):"]
    return run(chat_parser().parse_args(argv))


def test_a_smoke_run_prints_its_first_tokens_and_leaves_the_users_data_alone(
    qapp, tiny_folder, user_dirs, capsys
):
    assert _smoke("--target", str(tiny_folder), "--draft", "ngram") == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 1 and out[0].startswith("smoke test ok: first tokens "), out
    assert out[0].endswith("(cpu · fp32, draft n-gram)")
    assert not [p for p in user_dirs.rglob("*") if "specdec" in p.name], "the run wrote into the user's folders"
    assert DATA_DIR_ENV not in os.environ


def test_a_smoke_run_that_cannot_load_says_why_in_one_line_and_exits_one(qapp, tmp_path, user_dirs, capsys):
    missing = tmp_path / "no-such-model"
    assert _smoke("--target", str(missing), "--draft", "ngram") == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    expected = f"smoke test failed: model not found: {missing} (no such file or folder)"
    assert captured.err.strip().splitlines()[-1:] == [expected]

