"""The window's served-engine parts: the "Server…" target entry and an answer footer whose
figures the server could not give (speedup unknown, an answer the server cut short)."""

from __future__ import annotations

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

from specdec_app import model_toolbar
from specdec_app.model_toolbar import SERVER, ModelToolbar
from specdec_app.side_panel import answer_footer

from specdec_core.engine.stats import GenerationStats


def served_stats(**changes: object) -> GenerationStats:
    fields: dict = dict(
        drafter="draft-simple", prompt_tokens=19, new_tokens=40, stop_reason="max_tokens", steps=30,
        proposed=30, accepted=20, per_position_acceptance=(), decode_seconds=2.0, speedup_known=False,
    )  # fmt: skip
    fields.update(changes)
    return GenerationStats(**fields)


def test_a_served_footer_says_the_speedup_is_unknown_instead_of_a_figure():
    footer = answer_footer(served_stats(), "the server's (draft-simple)")
    assert "accepted 20/30 (67%)" in footer and "speedup unknown" in footer and "faster" not in footer


def test_a_served_footer_says_why_the_server_ended_the_answer():
    note = "the server at http://127.0.0.1:8080/v1 closed the stream before the answer ended"
    footer = answer_footer(served_stats(stop_reason="server_stopped", note=note), "d")
    assert footer.endswith(f"stopped: {note}")


def test_the_target_menu_asks_for_a_server_address_and_chooses_it(qtbot, monkeypatch):
    toolbar = ModelToolbar("auto", "auto")
    qtbot.addWidget(toolbar)
    toolbar.fill_target_menu("", [])
    index = toolbar.target_menu.findData(SERVER)
    assert index >= 0 and toolbar.target_menu.itemText(index) == "Server…"
    monkeypatch.setattr(
        model_toolbar.QInputDialog, "getText", lambda *args: (" http://127.0.0.1:8080/v1 ", True)
    )
    with qtbot.waitSignal(toolbar.targetChosen) as chosen:
        toolbar._on_target_activated(index)
    assert chosen.args == ["http://127.0.0.1:8080/v1"]
