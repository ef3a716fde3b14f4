"""The app's Qt-free parts and small widgets: Markdown layout with token ownership,
the conversation store, the settings wrapper, the answer footer."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

from specdec_app.conversations import Conversation, ConversationStore, StoredMessage, StoredToken, title_from
from specdec_app.markup import layout, owners

from specdec_core.engine.stats import GenerationStats


def test_code_fence_keeps_every_character_owned_by_its_token():
    tokens = ["Here", ":\n```", "py", "thon\n", "def f", "():\n", "    return", " 1\n", "```", "\nDone"]
    blocks = layout("".join(tokens), owners(tokens))
    code = [b for b in blocks if b.kind == "code"]
    assert [b.text for b in code] == ["def f():", "    return 1"]
    assert code[0].language == "python" and code[0].first_in_group and not code[1].first_in_group
    assert all(run.code for b in code for run in b.runs)
    # "def f" is token 4, "():" token 5: the run boundaries follow the tokens.
    assert [(r.text, r.token) for r in code[0].runs] == [("def f", 4), ("():", 5)]
    assert blocks[-1].kind == "paragraph" and blocks[-1].text == "Done"


def test_unclosed_fence_while_streaming_is_code_to_the_end():
    blocks = layout("```js\nlet x = 1;\nlet y")
    assert [b.kind for b in blocks] == ["code", "code"]
    assert blocks[1].text == "let y"


def test_inline_markup_is_hidden_and_styled():
    (block,) = layout("Use **bold**, *it* and `x = 1` here")
    assert block.text == "Use bold, it and x = 1 here"
    styled = {r.text: (r.bold, r.italic, r.code) for r in block.runs}
    assert styled["bold"] == (True, False, False)
    assert styled["it"] == (False, True, False)
    assert styled["x = 1"] == (False, False, True)


def test_lists_headings_and_quotes():
    blocks = layout("# Title\n- one\n  - two\n3. three\n> said\n---")
    assert [(b.kind, b.level, b.number) for b in blocks] == [
        ("heading", 1, 0),
        ("bullet", 0, 0),
        ("bullet", 1, 0),
        ("ordered", 0, 3),
        ("quote", 0, 0),
        ("rule", 0, 0),
    ]


def test_store_saves_atomically_lists_newest_first_and_deletes(tmp_path):
    store = ConversationStore(tmp_path)
    first = Conversation.new("be brief")
    first.messages.append(StoredMessage("user", "hi"))
    store.save(first)
    second = Conversation.new()
    second.messages += [
        StoredMessage("user", "2+2?"),
        StoredMessage("assistant", "4", tokens=[StoredToken("4", "bonus", 1, 0.9, None)], footer="Draft: x"),
    ]
    store.save(second)
    assert [c.id for c in store.list()] == [second.id, first.id]
    again = store.load(second.id)
    assert again.messages[1].tokens == [StoredToken("4", "bonus", 1, 0.9, None)]
    assert again.messages[1].footer == "Draft: x" and again.system_prompt == ""
    assert store.load(first.id).system_prompt == "be brief"
    assert not [p for p in (tmp_path / "conversations").iterdir() if p.name.startswith(".tmp")]
    store.delete(first.id)
    assert [c.id for c in store.list()] == [second.id]


def test_a_damaged_file_does_not_hide_the_others(tmp_path):
    store = ConversationStore(tmp_path)
    good = Conversation.new()
    store.save(good)
    (tmp_path / "conversations" / "broken.json").write_text("{not json", encoding="utf-8")
    (tmp_path / "conversations" / "foreign.json").write_text(json.dumps({"x": 1}), encoding="utf-8")
    assert [c.id for c in store.list()] == [good.id]


def test_title_is_the_first_line_shortened_on_a_word():
    assert title_from("How do I sort a list?\nmore") == "How do I sort a list?"
    long = title_from("word " * 30)
    assert long.endswith("…") and len(long) <= 49


def test_footer_reads_like_the_issue_says():
    from specdec_app.side_panel import answer_footer

    stats = GenerationStats(
        drafter="d",
        prompt_tokens=5,
        new_tokens=200,
        stop_reason="eos",
        steps=60,
        proposed=180,
        accepted=143,
        per_position_acceptance=(),
        decode_seconds=10.0,
        target_token_seconds=0.105,
    )
    footer = answer_footer(stats, "qwen2.5-coder-0.5b")
    assert footer.startswith("Draft: qwen2.5-coder-0.5b · accepted 143/180 (79%) · 2.1× faster")
    unread = dataclasses.replace(stats, new_tokens=0, steps=0, proposed=0, accepted=0, stop_reason="cancelled")
    assert answer_footer(unread, "qwen2.5-coder-0.5b") == "Draft: qwen2.5-coder-0.5b · stopped before the first token"


def test_settings_round_trip_through_the_typed_wrapper(qapp, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_DATA_DIR", str(tmp_path))
    from specdec_app.settings import AppSettings

    settings = AppSettings()
    settings.target, settings.draft, settings.precision = "/m/t", "ngram", "int8"
    settings.provenance = False
    settings.temperature = 0.7
    settings.remember_model("/m/a")
    settings.remember_model("/m/b")
    settings.remember_model("/m/a")
    settings.sync()
    again = AppSettings()
    assert (again.target, again.draft, again.precision) == ("/m/t", "ngram", "int8")
    assert again.provenance is False and again.temperature == pytest.approx(0.7)
    assert again.recent_models == ["/m/a", "/m/b"]
    assert (tmp_path / "settings.ini").is_file()


def test_gauge_grows_its_scale_and_shows_the_bound(qtbot):
    from PySide6.QtGui import QColor
    from specdec_app.gauges import Gauge

    gauge = Gauge("speedup", 4.0, lambda v: f"{v:.2f}×", QColor("red"))
    qtbot.addWidget(gauge)
    assert gauge.text() == "–"
    gauge.set_value(9.0, marker=2.5)
    assert gauge.text() == "9.00×" and gauge.marker() == 2.5
    assert "theoretical 2.50×" in gauge.toolTip()
    gauge.grab()  # paints without error


def test_qt_calls_that_return_nothing_keep_none_alive(qapp):
    """PySide6 6.12.0 on Python < 3.12 drops a reference to None per void call: a few
    thousand text-format setters later the interpreter aborts. The pin excludes it."""
    import sys

    from PySide6.QtGui import QTextBlockFormat

    fmt = QTextBlockFormat()
    before = sys.getrefcount(None)
    for _ in range(2000):
        fmt.setLeftMargin(4)
    assert sys.getrefcount(None) - before > -100


def test_settings_are_declared_once_with_unique_keys_and_bad_values_read_as_defaults(qapp, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_DATA_DIR", str(tmp_path))
    from specdec_app.settings import KEY_MAX_NEW_TOKENS, KEY_THEME, AppSettings

    declared = AppSettings.declared()
    keys = [setting.key for setting in declared.values()]
    assert len(keys) == len(set(keys)) and {"theme", "seed", "geometry"} <= set(declared)
    settings = AppSettings()
    settings.qsettings.setValue(KEY_THEME, "purple")
    settings.qsettings.setValue(KEY_MAX_NEW_TOKENS, "many")
    assert settings.theme == "system" and settings.max_new_tokens == 512
    settings.seed = 7
    settings.sync()
    assert AppSettings().seed == 7 and AppSettings().geometry.isEmpty()


def test_streaming_layout_equals_the_whole_layout_at_every_prefix():
    from specdec_app.markup import LiveLayout

    tokens = ["Intro **bo", "ld** and `x", "`\n", "```", "py", "thon\n", "def f", "():\n", "\n", "    return", " 1\n"]
    tokens += ["```", "\n\n", "- one\n", "  - two", "\n3. three\n", "> said\n", "---", "\npara", "graph\nmore\n"]
    live = LiveLayout()
    for n, token in enumerate(tokens, 1):
        live.extend([token])
        prefix = tokens[:n]
        assert live.blocks() == layout("".join(prefix), owners(prefix)), f"after {prefix!r}"
        assert live.blocks()[: live.stable_count] == live.stable_blocks()


def test_markdown_sections_split_at_blank_lines_and_around_fences_but_never_inside_one():
    from specdec_app.markup import markdown_sections

    text = "para one\nstill one\n\n```py\na = 1\n\nb = 2\n```\n\n\n- list"
    assert markdown_sections(text) == ["para one\nstill one", "```py\na = 1\n\nb = 2\n```", "- list"]
    assert markdown_sections("Here:\n```py\nx\n```\nAfter") == ["Here:", "```py\nx\n```", "After"]


def test_token_index_finds_tokens_by_position_and_forgets_a_cut_tail():
    from specdec_app.token_index import TokenIndex

    a, b = StoredToken("ab", "accepted", 1), StoredToken("cd", "bonus", 1)
    index = TokenIndex()
    index.add(0, 2, a)
    index.add(5, 7, b)
    assert (index.at(0), index.at(1), index.at(2), index.at(6), index.at(7)) == (a, a, None, b, None)
    with pytest.raises(ValueError):
        index.add(6, 8, a)
    index.cut(5)
    assert index.at(6) is None and len(index) == 1


def test_every_precision_on_the_menu_says_what_it_costs():
    from specdec_app.model_toolbar import PRECISION_COSTS

    from specdec_core import PRECISIONS

    assert set(PRECISIONS) <= set(PRECISION_COSTS)
