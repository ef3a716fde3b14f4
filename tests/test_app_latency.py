"""The UI thread stays on time while a fresh window answers, in wall-clock time (issue #57).

What a user feels is the heartbeat's wall-clock lateness (tests/heartbeat.py) from Send
to the last token, in a freshly built window with fresh settings and data folders and
the app's garbage collection as it ships. Tiny models stream hundreds of tokens a
second (the most signals and redraws per second); their tokens carry a canned answer's
text (tests/answers.py) so that code blocks open and grow as in a real answer.

The bound is the issue's bar: p95 ≤ 20 ms and max ≤ 80 ms. Other processes on a shared
machine can make one answer late, so a measurement passes if one of three tries stays
within it (each in a fresh window); a UI thread that stalls stalls on every try, and
the last test shows that a stall of 150 ms fails the bound.
"""

from __future__ import annotations

import gc
import itertools
import os
import time
from collections.abc import Callable

import pytest

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

from answers import answer_texts, long_conversation, reading_only_the_last_question, with_canned_text
from heartbeat import Lateness, first_within, measure_answer, wait_for
from specdec_app.conversations import ConversationStore
from specdec_app.main import build_main_window
from specdec_app.token_view import TokenView
from specdec_app.window import MainWindow
from tiny import perturbed, tiny_model, tiny_tokenizer

MAX_P95_MS = 20.0
MAX_LATE_MS = 80.0
TRIES = 3
LOAD_TIMEOUT_S = 120.0  # a loaded 2-core CI machine imports and loads slowly
PROSE_FIRST = 150  # tokens of prose before the first code block opens
STALL_S = 0.15
PROMPT = "def add(a, b):"
CONTEXT = 2048  # room for a 1,000-token answer


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[str, str]:
    """A tiny target that never stops early and a perturbed copy as its draft."""
    import torch

    root = tmp_path_factory.mktemp("latency-models")
    tokenizer = tiny_tokenizer()
    target = tiny_model(len(tokenizer), seed=0)
    with torch.no_grad():  # zeroed stop-token rows: the answer runs to its token limit
        for token in ("<|im_end|>", "<|endoftext|>"):
            target.lm_head.weight[tokenizer.convert_tokens_to_ids(token)] = 0.0
    refs = []
    for name, model in (("target", target), ("draft", perturbed(target, 0.05))):
        model.config.max_position_embeddings = CONTEXT
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
        refs.append(str(root / name))
    return refs[0], refs[1]


@pytest.fixture
def fresh_window(qtbot, tmp_path, monkeypatch, pair) -> Callable[..., MainWindow]:
    """A freshly built window on fresh settings and data folders, its pair loaded, answering
    `tokens` tokens of a canned answer; `before` runs on the new data folder first."""
    windows = itertools.count()

    def build(tokens: int, before: Callable[[], None] = lambda: None) -> MainWindow:
        monkeypatch.setenv("SPECDEC_DATA_DIR", str(tmp_path / f"data-{next(windows)}"))
        before()
        argv = ["--target", pair[0], "--draft", pair[1], "--device", "cpu", "--precision", "fp32"]
        window = build_main_window([*argv, "--theme", "light"])
        qtbot.addWidget(window)
        window.resize(1200, 800)
        window.show()
        wait_for(window.modelReady, LOAD_TIMEOUT_S, "loading the tiny pair", failed=window.errorShown)
        window.side.generation.max_new_tokens.setValue(tokens)
        with_canned_text(window.worker.session, answer_texts(tokens, seed=7, prose_first=PROSE_FIRST))
        return window

    return build


def _report(runs: list[Lateness]) -> str:
    return "; ".join(
        f"p95 {r.p95_ms} max {r.max_ms} ms ({r.late_beats} late: running {r.late_running_ms:.0f},"
        f" waiting for a core {r.late_waiting_for_core_ms:.0f}, asleep {r.late_asleep_ms:.0f} ms;"
        f" the latest: running {r.worst_running_ms:.0f}, waiting for a core {r.worst_waiting_for_core_ms:.0f} ms)"
        for r in runs
    )


def test_a_fresh_window_streams_a_1000_token_answer_with_code_blocks_on_time(fresh_window):
    windows: list[MainWindow] = []

    def first_answer() -> Lateness:
        windows.append(fresh_window(1024))
        return measure_answer(windows[-1], PROMPT, timeout_s=LOAD_TIMEOUT_S)

    runs = first_within(TRIES, first_answer, MAX_P95_MS, MAX_LATE_MS)
    assert runs[-1].within(MAX_P95_MS, MAX_LATE_MS), _report(runs)
    assert runs[-1].tokens >= 1000
    assert windows[-1].view.toPlainText().count("return 3.14 * r ** 2") >= 3  # several code blocks


def test_an_answer_after_twenty_long_answers_stays_on_time(fresh_window, qtbot):
    stored = long_conversation(answers=20, tokens=1000)

    def answer_after_twenty() -> Lateness:
        window = fresh_window(500, before=lambda: ConversationStore().save(stored))
        with qtbot.waitSignal(window.conversationOpened, timeout=int(LOAD_TIMEOUT_S * 1000)):
            window.open_conversation(stored.id)
        while window.view.is_rendering():
            wait_for(window.view.renderingFinished, LOAD_TIMEOUT_S, "drawing the conversation")
        assert window.view.message_count() == 40
        reading_only_the_last_question(window.worker.session)
        return measure_answer(window, PROMPT, timeout_s=LOAD_TIMEOUT_S)

    runs = first_within(TRIES, answer_after_twenty, MAX_P95_MS, MAX_LATE_MS)
    assert runs[-1].within(MAX_P95_MS, MAX_LATE_MS), _report(runs)


def test_a_ui_thread_stalled_when_the_first_code_block_opens_fails_the_bound(fresh_window, monkeypatch):
    redraw = TokenView._redraw_live
    stalled: list[bool] = []

    def redraw_stalling_once(view: TokenView) -> None:
        if not stalled and any("```" in token.text for token in view.live_tokens()):
            stalled.append(True)
            time.sleep(STALL_S)  # the stall under test, on the UI thread
        redraw(view)

    monkeypatch.setattr(TokenView, "_redraw_live", redraw_stalling_once)
    lateness = measure_answer(fresh_window(300), PROMPT, timeout_s=LOAD_TIMEOUT_S)
    assert stalled
    assert not lateness.within(MAX_P95_MS, MAX_LATE_MS)
    assert lateness.max_ms >= STALL_S * 1000 - 20, _report([lateness])


def test_what_a_load_leaves_alive_is_kept_out_of_later_collections(fresh_window):
    """A full collection on the UI thread walks only what was allocated since the load,
    not the imports and the pair (gc_guard.freeze_long_lived)."""
    fresh_window(8)
    assert gc.get_freeze_count() > 100_000  # torch, transformers, Qt and the pair
    assert len(gc.get_objects()) < gc.get_freeze_count() // 10
