"""The chat window end to end on tiny models: streaming, provenance, stop, toggle, menus,
persistence. Waits on signals, never sleeps (the UI thread's timing: test_app_latency.py).

A worker paused inside its first token batch (`PausedWorker`) makes "mid-generation"
deterministic: the UI acts while the engine is held between two steps.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest
import torch

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

from PySide6.QtCore import QElapsedTimer, Qt
from PySide6.QtGui import QGuiApplication, QTextCursor
from specdec_app.main import build_main_window
from specdec_app.settings import AppSettings
from specdec_app.token_view import TOKEN_SOURCE, token_tooltip
from tiny import perturbed, tiny_model, tiny_tokenizer

from specdec_core.errors import Cancelled
from specdec_core.models.compat import check_folders
from specdec_core.tools import cli

LOAD_TIMEOUT_MS = 120_000  # generous: a loaded 2-core CI machine imports and loads slowly
ANSWER_TIMEOUT_MS = 120_000
PROMPT = "def add(a, b):"


def _save(model, tokenizer, folder: Path) -> str:
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def _never_ends(model, tokenizer):
    """Zero the lm_head rows of the stop tokens: their logit is 0 while the peaked random
    logits always have a larger maximum, so greedy answers run to max_new_tokens."""
    with torch.no_grad():
        for token in ("<|im_end|>", "<|endoftext|>"):
            model.lm_head.weight[tokenizer.convert_tokens_to_ids(token)] = 0.0
    return model


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("app-models")
    tok = tiny_tokenizer()
    target = tiny_model(len(tok), seed=0)
    chatty = _never_ends(tiny_model(len(tok), seed=0), tok)
    other_tok = tiny_tokenizer(300, extra="entirely different words zzz qqq")
    return {
        "target": _save(target, tok, root / "target"),
        "near": _save(perturbed(target, 0.05), tok, root / "near-draft"),
        "chatty": _save(chatty, tok, root / "chatty"),
        "chatty_copy": _save(chatty, tok, root / "chatty-copy"),
        "other": _save(tiny_model(len(other_tok), seed=3), other_tok, root / "other-vocab"),
    }


@pytest.fixture
def open_window(qtbot, tmp_path, monkeypatch):
    """Build the window like `specdec chat ARGS` and wait until its models are ready."""
    monkeypatch.setenv("SPECDEC_DATA_DIR", str(tmp_path / "data"))
    releases: list[threading.Event] = []

    def open_(*args: str, wait: bool = True):
        window = build_main_window([*args, "--device", "cpu", "--precision", "fp32", "--theme", "light"])
        qtbot.addWidget(window)
        window.show()
        window.worker.emit_interval_s = 0.0  # a batch per step: "mid-generation" is reachable
        window.releases = releases
        if wait:
            with qtbot.waitSignal(window.modelReady, timeout=LOAD_TIMEOUT_MS):
                pass
        return window

    yield open_
    for release in releases:  # never leave a worker parked if a test failed half way
        release.set()


class PausedWorker:
    """Parks the worker thread inside its first token batch until `release()`."""

    def __init__(self, window) -> None:
        self.release_event = threading.Event()
        window.releases.append(self.release_event)
        self.first_step: int | None = None
        # Direct: runs in the worker thread; the window's queued delivery was posted first.
        window.worker.streamed.connect(self._hold, Qt.ConnectionType.DirectConnection)

    def _hold(self, batch) -> None:
        if self.first_step is None and batch:
            self.first_step = batch[-1].step
            self.release_event.wait(60)

    def release(self) -> None:
        self.release_event.set()


def _pin_draft_length(window, k: int) -> None:
    menu = window.side.generation.draft_length
    menu.setCurrentIndex(menu.findData(k))


def _send(qtbot, window, text: str):
    window.prompt.setPlainText(text)
    with qtbot.waitSignal(window.answerFinished, timeout=ANSWER_TIMEOUT_MS) as blocker:
        qtbot.keyClick(window.prompt, Qt.Key.Key_Return)  # Enter sends
    return blocker.args[0]


def _generate_json(capsys, *args: str) -> dict:
    capsys.readouterr()
    assert cli.main(["generate", *args, "--device", "cpu", "--precision", "fp32", "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_answer_is_tinted_hoverable_and_equals_specdec_generate(qtbot, open_window, models, capsys):
    window = open_window("--target", models["target"], "--draft", models["near"])
    assert window.findChild(object, "resolvedLabel").text() == "cpu · fp32 · as stored (fp32)"
    _pin_draft_length(window, 3)
    message = _send(qtbot, window, PROMPT)

    reference = _generate_json(
        capsys,
        "--target",
        models["target"],
        "--draft",
        models["near"],
        "--prompt",
        PROMPT,
        "--draft-length",
        "3",
    )
    assert window.live_token_ids() == [t["id"] for t in reference["tokens"]]
    assert message.content == reference["text"].removesuffix("<|im_end|>")
    assert [t.source for t in message.tokens] == [t["source"] for t in reference["tokens"]][
        : len(message.tokens)
    ]

    shown = window.view.rendered_sources()
    assert len(shown) >= 2, shown  # e.g. accepted and corrected
    assert message.footer.startswith("Draft: near-draft · accepted ")
    assert window.gauges.acceptance.value() == pytest.approx(
        reference["stats"]["accepted"] / reference["stats"]["proposed"]
    )
    assert window.gauges.speedup.value() > 0 and window.gauges.tokens_per_second.value() > 0
    exactness = window.findChild(object, "exactnessLabel").text()
    assert exactness.startswith("Exactness: ") and exactness in window.speculation_action.toolTip()

    # Hovering a tinted character finds its token; the tooltip names step and source.
    view = window.view
    block = view.document().begin()
    while block.isValid() and not any(
        it.fragment().charFormat().hasProperty(TOKEN_SOURCE) for it in _fragments(block)
    ):
        block = block.next()
    fragment = next(
        f for f in (it.fragment() for it in _fragments(block)) if f.charFormat().hasProperty(TOKEN_SOURCE)
    )
    cursor = QTextCursor(view.document())
    cursor.setPosition(fragment.position())
    token = view.token_at(
        view.cursorRect(cursor).center() + view.cursorRect(cursor).topRight() * 0 + _right(3)
    )
    assert token is not None and token.source == fragment.charFormat().property(TOKEN_SOURCE)
    assert f"step {token.step}" in token_tooltip(token)

    # Provenance off: the plain rendered answer, no tints.
    window.findChild(object, "provenanceToggle").trigger()
    assert view.rendered_sources() == {} and view.tinted_backgrounds() == set()
    assert message.content.strip().split()[0] in view.toPlainText()


def _fragments(block):
    it = block.begin()
    while not it.atEnd():
        yield it
        it += 1


def _right(dx: int):
    from PySide6.QtCore import QPoint

    return QPoint(dx, 0)


def test_stop_mid_generation_then_a_new_message_works(qtbot, open_window, models):
    window = open_window("--target", models["chatty"], "--draft", "ngram")
    window.side.generation.max_new_tokens.setValue(300)
    paused = PausedWorker(window)
    window.prompt.setPlainText(PROMPT)
    with qtbot.waitSignal(window.answerProgressed, timeout=ANSWER_TIMEOUT_MS):
        window.send_button.click()
    assert window.findChild(object, "stopButton").isEnabled()
    with qtbot.waitSignal(window.answerFinished, timeout=ANSWER_TIMEOUT_MS) as blocker:
        qtbot.mouseClick(window.stop_button, Qt.MouseButton.LeftButton)
        paused.release()
    stopped = blocker.args[0]
    assert stopped.stopped and "stopped" in stopped.footer
    assert 0 < len(window.live_token_ids()) < 300

    window.side.generation.max_new_tokens.setValue(12)
    answer = _send(qtbot, window, "and again")
    assert not answer.stopped and len(window.live_token_ids()) == 12
    assert [m.role for m in window.conversation.messages] == ["user", "assistant", "user", "assistant"]


def test_a_long_prompt_shows_its_reading_and_stop_ends_it_before_the_first_token(qtbot, open_window, models):
    window = open_window("--target", models["chatty"], "--draft", "ngram")
    engine = window.worker.session.engine
    assert engine.exactness is not None and engine.exactness.bitwise  # the loader's row-wise CPU forward
    engine.prefill_chunk = 4
    statuses: list[str] = []
    window.statusBar().messageChanged.connect(statuses.append)
    parked, release = threading.Event(), threading.Event()
    window.releases.append(release)

    def hold(event) -> None:  # runs in the worker thread, inside the prompt's reading
        if event.read == 8:
            parked.set()
            release.wait(60)

    window.worker.reading.connect(hold, Qt.ConnectionType.DirectConnection)
    window.prompt.setPlainText(PROMPT * 8)
    window.send_button.click()
    assert parked.wait(60)
    qtbot.waitUntil(lambda: any(s.startswith("Reading the prompt: 4 of ") for s in statuses), timeout=5000)
    with qtbot.waitSignal(window.answerFinished, timeout=ANSWER_TIMEOUT_MS) as blocker:
        qtbot.mouseClick(window.stop_button, Qt.MouseButton.LeftButton)
        release.set()
    stopped = blocker.args[0]
    assert stopped.stopped and stopped.tokens == [] and window.live_token_ids() == []
    assert stopped.footer.endswith("stopped before the first token")
    assert not any(s.startswith("Reading the prompt: 12 of") for s in statuses)  # no chunk after the stop

    window.side.generation.max_new_tokens.setValue(6)
    answer = _send(qtbot, window, "and again")
    assert not answer.stopped and len(window.live_token_ids()) == 6


def test_speculation_toggle_switches_the_next_tokens_to_target(qtbot, open_window, models):
    # A draft identical to the target: every draft token is accepted while speculating.
    window = open_window("--target", models["chatty"], "--draft", models["chatty_copy"])
    _pin_draft_length(window, 4)
    window.side.generation.max_new_tokens.setValue(40)
    paused = PausedWorker(window)
    window.prompt.setPlainText(PROMPT)
    with qtbot.waitSignal(window.answerProgressed, timeout=ANSWER_TIMEOUT_MS):
        window.send_button.click()
    toggle = window.findChild(object, "speculationToggle")
    assert toggle.isChecked()
    with qtbot.waitSignal(window.answerFinished, timeout=ANSWER_TIMEOUT_MS) as blocker:
        toggle.trigger()  # off, while the engine is parked between two steps
        paused.release()
    tokens = blocker.args[0].tokens
    before = [t.source for t in tokens if t.step <= paused.first_step]
    after = [t.source for t in tokens if t.step > paused.first_step]
    assert set(before) == {"accepted", "bonus"}
    assert after and set(after) == {"target"}


def test_draft_menu_disables_an_incompatible_tokenizer_with_its_reason(qtbot, open_window, models, tmp_path):
    os.environ["SPECDEC_DATA_DIR"] = str(tmp_path / "data")  # same as the fixture's, set before it
    AppSettings().remember_model(models["other"])
    window = open_window("--target", models["target"], "--draft", models["near"], wait=False)
    with qtbot.waitSignals([window.draftMenuUpdated, window.modelReady], timeout=LOAD_TIMEOUT_MS):
        pass
    entries = {ref: (label, enabled, tip) for label, ref, enabled, tip in window.draft_menu_entries()}
    reason = check_folders(models["target"], models["other"]).reason
    assert entries[models["other"]][1] is False
    assert reason in entries[models["other"]][2]
    assert entries[models["near"]][1] is True and "compatible" in entries[models["near"]][2]
    refs = [ref for _, ref, _, _ in window.draft_menu_entries()]
    # Compatible drafts first, then n-gram and None; the incompatible one after them.
    assert refs.index(models["near"]) < refs.index("ngram") < refs.index("none") < refs.index(models["other"])

    # Choosing n-gram swaps the drafter without reloading the target.
    index = window.draft_menu.findData("ngram")
    with qtbot.waitSignal(window.modelReady, timeout=LOAD_TIMEOUT_MS) as blocker:
        window.draft_menu.setCurrentIndex(index)
        window.draft_menu.activated.emit(index)
    assert blocker.args[0].draft == "ngram"


def test_an_incompatible_draft_falls_back_to_ngram_with_a_message(qtbot, open_window, models):
    window = open_window("--target", models["target"], "--draft", models["other"], wait=False)
    with qtbot.waitSignals([window.errorShown, window.modelReady], timeout=LOAD_TIMEOUT_MS):
        pass
    assert window.pair.draft == "ngram"
    assert "does not fit" in window.error_text.text() and "Using n-gram instead" in window.error_text.text()


def test_a_missing_model_is_a_message_not_a_crash(qtbot, open_window, tmp_path):
    window = open_window("--target", str(tmp_path / "nowhere"), "--draft", "ngram", wait=False)
    with qtbot.waitSignal(window.errorShown, timeout=LOAD_TIMEOUT_MS) as blocker:
        pass
    assert "nowhere" in blocker.args[0]
    assert not window.send_button.isEnabled() and window.error_banner.isVisible()


def test_conversations_survive_a_restart(qtbot, open_window, models):
    window = open_window("--target", models["chatty"], "--draft", "ngram")
    window.side.generation.max_new_tokens.setValue(8)
    answer = _send(qtbot, window, "remember me")
    conversation_id = window.conversation.id
    window.rename_conversation(conversation_id, "Kept")
    window.close()
    assert window.engine_thread.isFinished()

    again = open_window("--target", models["chatty"], "--draft", "ngram")
    assert again.conversation.id == conversation_id and again.conversation.title == "Kept"
    assert [m.content for m in again.conversation.messages] == ["remember me", answer.content]
    assert again.conversation.messages[1].tokens == answer.tokens
    assert "remember me" in again.view.toPlainText()
    titles = [again.conversation_list.item(i).text() for i in range(again.conversation_list.count())]
    assert titles == ["Kept"]
    again.delete_conversation(conversation_id)
    assert again.conversation_list.count() == 0 and again.conversation.messages == []


def test_a_mistyped_last_conversation_is_a_message_and_the_app_still_starts(qtbot, open_window, models, tmp_path):
    folder = tmp_path / "data" / "conversations"
    folder.mkdir(parents=True)
    (folder / "t.json").write_text(json.dumps({"id": "t", "messages": [1]}), encoding="utf-8")
    settings = AppSettings()
    settings.last_conversation = "t"
    settings.sync()
    window = open_window("--target", models["target"], "--draft", "ngram")
    assert "t.json: messages[0] is int, not an object" in window.error_text.text()
    assert window.conversation.messages == [] and window.send_button.isEnabled()
    [item] = [window.conversation_list.item(i) for i in range(window.conversation_list.count())]
    assert item.text() == "t.json (unreadable)" and "messages[0] is int" in item.toolTip()


def test_a_shared_file_naming_a_path_outside_cannot_make_delete_leave_the_folder(qtbot, open_window, models, tmp_path):
    victim = tmp_path / "outside" / "victim.json"
    victim.parent.mkdir()
    victim.write_text("precious", encoding="utf-8")
    folder = tmp_path / "data" / "conversations"
    folder.mkdir(parents=True)
    shared = {"id": "../../outside/victim", "title": "Shared", "messages": [{"role": "user", "content": "hi"}]}
    (folder / "shared.json").write_text(json.dumps(shared), encoding="utf-8")
    window = open_window("--target", models["target"], "--draft", "ngram")
    assert window.conversation_list.item(0).text() == "Shared"
    with qtbot.waitSignal(window.conversationOpened, timeout=LOAD_TIMEOUT_MS):
        window.open_conversation("shared")  # read in the background
    assert window.conversation.id == "shared"
    window.delete_conversation(window.conversation.id)
    window.chat.library.wait()  # files are written and deleted in the background
    assert victim.read_text(encoding="utf-8") == "precious" and not (folder / "shared.json").exists()
    assert window.conversation_list.count() == 0


def test_regenerate_and_edit_and_resend_replace_what_followed(qtbot, open_window, models):
    window = open_window("--target", models["chatty"], "--draft", "ngram")
    window.side.generation.max_new_tokens.setValue(6)
    first = _send(qtbot, window, "first question")
    _send(qtbot, window, "second question")
    with qtbot.waitSignal(window.answerFinished, timeout=ANSWER_TIMEOUT_MS):
        window.regenerate_action.trigger()  # answers the last question again
    assert [m.content for m in window.conversation.messages[:3]] == ["first question", first.content, "second question"]
    assert len(window.conversation.messages) == 4

    window.chat.start_edit(2)
    assert window.prompt.toPlainText() == "second question" and window.edit_banner.isVisible()
    answer = _send(qtbot, window, "edited question")
    assert [m.content for m in window.conversation.messages] == [
        "first question", first.content, "edited question", answer.content
    ]
    assert not window.edit_banner.isVisible()
    assert window.view.message_count() == 4 and "edited question" in window.view.toPlainText()
    assert "second question" not in window.view.toPlainText()


def test_closing_during_a_long_load_returns_at_once_and_cancels_it(qtbot, open_window, models):
    """A first-use conversion ends its current chunk before it sees the cancel: closing hides the
    window and returns without waiting for it; the engine thread ends on its own once it has."""
    window = open_window("--target", models["target"], "--draft", "ngram")
    entered, chunk_done = threading.Event(), threading.Event()
    window.releases.append(chunk_done)
    saw_cancel: list[bool] = []

    def converting(spec, *, progress=None, cancel=None):
        entered.set()
        saw_cancel.append(cancel.wait(60))
        chunk_done.wait(60)
        raise Cancelled("conversion cancelled: the finished chunks are kept")

    window.worker.session.load = converting
    window.models.request_load(models["near"], "ngram")
    assert entered.wait(60)
    clock = QElapsedTimer()
    clock.start()
    window.close()
    assert clock.elapsed() < 500, f"close() blocked the UI thread {clock.elapsed()} ms"
    assert not window.isVisible() and not window.engine_thread.isFinished()
    with qtbot.waitSignal(window.engine_thread.finished, timeout=LOAD_TIMEOUT_MS):
        chunk_done.set()
    assert saw_cancel == [True]


@pytest.mark.parametrize(("interval_s", "batches"), [(0.0, [[1, "step"], [2, "step"]]), (3600.0, [[1, "step", 2, "step"]])])
def test_the_worker_forwards_core_events_in_batches_that_end_on_a_step(qapp, interval_s, batches):
    from specdec_app.worker import EngineWorker

    from specdec_core.engine.events import (
        DoneEvent,
        PrefillEvent,
        ReadingEvent,
        Source,
        StepEvent,
        TokenEvent,
    )

    def step(n: int) -> StepEvent:
        return StepEvent(n, 1, 1, 1, 1, 0.0, 0.0, 1.0, 1.0, 1.0)

    done = DoneEvent((1, 2), "ab", stats=None)
    events = [ReadingEvent(0, 3), PrefillEvent(3, 0, 0.0), TokenEvent(1, "a", Source.TARGET, 1), step(1)]
    events += [TokenEvent(2, "b", Source.TARGET, 2), step(2), done]
    worker = EngineWorker()
    worker.emit_interval_s = interval_s
    seen: list[object] = []
    worker.reading.connect(lambda event: seen.append("reading"))
    worker.prefilled.connect(lambda event: seen.append("prefill"))
    worker.streamed.connect(lambda batch: seen.append([getattr(e, "token_id", "step") for e in batch]))
    worker.answerDone.connect(seen.append)
    worker._forward(iter(events))  # the events are the session's own objects, never re-typed
    assert seen == ["reading", "prefill", *batches, done]


def test_a_paste_is_read_ahead_in_the_background_and_send_mid_read_keeps_the_answer(
    qtbot, open_window, models, capsys
):
    window = open_window("--target", models["target"], "--draft", models["near"])
    engine = window.worker.session.engine
    engine.prefill_chunk = 16
    window.side.generation.max_new_tokens.setValue(12)
    parked, release = threading.Event(), threading.Event()
    window.releases.append(release)
    held: list[object] = []

    def hold(request, event) -> None:  # runs in the worker thread, between two chunks of the read
        if event.cached >= 32 and not held:
            held.append(event)
            parked.set()
            release.wait(60)

    window.worker.readAhead.connect(hold, Qt.ConnectionType.DirectConnection)
    prefills: list[object] = []
    window.worker.prefilled.connect(prefills.append, Qt.ConnectionType.DirectConnection)
    paste = PROMPT + "\n    return a + b\n" + "for i in range(10):\n    print(i * i)\n" * 6
    QGuiApplication.clipboard().setText(paste)
    qtbot.keyClick(window.prompt, Qt.Key.Key_V, Qt.KeyboardModifier.ControlModifier)
    assert parked.wait(60)  # the paste started a read at once, in the worker thread
    qtbot.waitUntil(lambda: window.read_ahead_label.text().startswith("reading ahead: "), timeout=5000)
    # The worker is held inside the read: the UI types and sends without waiting for it.
    qtbot.keyClicks(window.prompt, "What does it print?")
    assert window.prompt.toPlainText().endswith("What does it print?")
    with qtbot.waitSignal(window.answerFinished, timeout=ANSWER_TIMEOUT_MS):
        qtbot.keyClick(window.prompt, Qt.Key.Key_Return)
        assert window.read_ahead_label.text() == ""  # Send stopped the read
        release.set()
    assert prefills[-1].reused_tokens >= held[0].cached  # the answer kept what was read

    message = (paste + "What does it print?").strip()
    reference = _generate_json(
        capsys, "--target", models["target"], "--draft", models["near"], "--prompt", message,
        "--max-new-tokens", "12",
    )  # fmt: skip
    assert window.live_token_ids() == [t["id"] for t in reference["tokens"]]


def test_a_typing_pause_reads_the_message_ahead_and_the_label_says_so(qtbot, open_window, models):
    window = open_window("--target", models["target"], "--draft", models["near"])
    requests: list[object] = []
    window.chat.read_ahead.requested.connect(requests.append)
    qtbot.keyClicks(window.prompt, "Write a loop that prints the squares")
    qtbot.waitUntil(lambda: window.read_ahead_label.text().startswith("read "), timeout=10_000)
    assert len(requests) == 1  # one read after the pause, none per keystroke
    assert window.read_ahead_label.text().endswith(" tokens ahead")
