"""ChatSession: the one API the app and the CLI use — load once, answer exactly, fail in one line."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from tiny import hf_greedy, tiny_model, tiny_tokenizer

from specdec_core import session as session_module
from specdec_core.engine.events import DoneEvent, TokenEvent
from specdec_core.engine.speculative import GenerationParams
from specdec_core.engine.suffix_drafter import library_of
from specdec_core.errors import (
    ContextTooLong,
    IncompatibleDraftError,
    InternalError,
    InvalidParameter,
    NotLoaded,
    OutOfMemory,
)
from specdec_core.models.chat import Message
from specdec_core.session import ChatSession, LoadSpec, check_params

GREEDY = GenerationParams(max_new_tokens=16)


@pytest.fixture(scope="module")
def foreign_folder(tmp_path_factory) -> Path:
    """A model whose tokenizer maps ids to other tokens: never a valid draft for the target."""
    other = tiny_tokenizer(vocab_size=300, extra="a different corpus makes different merges entirely")
    folder = tmp_path_factory.mktemp("foreign")
    tiny_model(len(other)).save_pretrained(folder)
    other.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def loaded(tiny_folder, sibling_folder) -> ChatSession:
    session = ChatSession()
    session.load(LoadSpec(target=str(tiny_folder), draft=str(sibling_folder), device="cpu", precision="fp32"))
    return session


def answer(session: ChatSession, text: str = "Write a loop.", params: GenerationParams = GREEDY):
    events = list(session.answer([Message("user", text)], params=params))
    done = events[-1]
    assert isinstance(done, DoneEvent)
    return events, done


def test_answer_equals_the_target_alone_and_its_text_holds_no_stop_token(loaded, target):
    events, done = answer(loaded, params=GenerationParams(max_new_tokens=40))
    prompt = loaded.engine.target.ids[: done.stats.prompt_tokens]
    assert list(done.token_ids) == hf_greedy(target, prompt, 40, eos=sorted(loaded.engine.stop_token_ids))
    assert "<|im_end|>" not in done.text
    tokens = [e for e in events if isinstance(e, TokenEvent)]
    assert [t.token_id for t in tokens] == list(done.token_ids)


def test_info_says_what_was_loaded(loaded, tiny_folder, sibling_folder):
    info = loaded.info
    assert info is not None
    assert (info.target, info.draft, info.warning) == (str(tiny_folder), str(sibling_folder), "")
    assert info.description == "cpu · fp32" and (info.device, info.precision) == ("cpu", "fp32")
    assert info.context_length == 1024
    assert info.exactness is not None and loaded.engine.exactness is info.exactness
    assert info.exactness.label in ("bitwise", "near-ties may differ")


def test_a_draft_that_does_not_fit_falls_back_to_ngram_loading_the_target_once(
    monkeypatch, tiny_folder, foreign_folder
):
    loads: list[str] = []
    real = session_module.load_model
    monkeypatch.setattr(session_module, "load_model", lambda ref, **kw: loads.append(ref) or real(ref, **kw))
    session = ChatSession()
    info = session.load(LoadSpec(str(tiny_folder), draft=str(foreign_folder), device="cpu", precision="fp32"))
    assert loads == [str(tiny_folder)]
    assert info.draft == "ngram" and info.draft_name == "n-gram"
    assert "does not fit" in info.warning and info.warning.endswith("Using n-gram instead.")
    assert answer(session)[1].stats.new_tokens > 0


def test_a_draft_that_does_not_fit_is_refused_when_fallback_is_off(tiny_folder, foreign_folder):
    spec = LoadSpec(
        str(tiny_folder), draft=str(foreign_folder), device="cpu", precision="fp32", draft_fallback=False
    )
    with pytest.raises(IncompatibleDraftError, match="does not fit"):
        ChatSession().load(spec)


def test_swap_draft_keeps_the_target_and_a_failed_swap_keeps_the_old_drafter(
    tiny_folder, sibling_folder, foreign_folder
):
    session = ChatSession()
    session.load(LoadSpec(str(tiny_folder), draft="none", device="cpu", precision="fp32"))
    model = session.engine.target.model
    _, before = answer(session)
    info = session.swap_draft(str(sibling_folder))
    assert info.draft == str(sibling_folder) and session.engine.target.model is model
    _, after = answer(session)
    assert after.token_ids == before.token_ids  # exact with any drafter
    with pytest.raises(IncompatibleDraftError):
        session.swap_draft(str(foreign_folder))
    assert session.info is not None and session.info.draft == str(sibling_folder)
    assert session.engine.drafter.name.endswith(Path(sibling_folder).name)


def test_rate_drafts_judges_each_candidate_with_a_reason(loaded, sibling_folder, foreign_folder):
    verdicts = loaded.rate_drafts(["ngram", "none", str(sibling_folder), str(foreign_folder)])
    assert verdicts["ngram"].compatible and verdicts["none"].compatible
    assert verdicts[str(sibling_folder)].compatible
    assert not verdicts[str(foreign_folder)].compatible and verdicts[str(foreign_folder)].reason


def test_speculation_toggle_reaches_the_engine(loaded):
    loaded.speculation_enabled = False
    try:
        assert loaded.engine.speculation_enabled is False
        _, done = answer(loaded)
        assert done.stats.proposed == 0
    finally:
        loaded.speculation_enabled = True
    assert loaded.engine.speculation_enabled is True


def test_calls_before_load_say_so():
    session = ChatSession()
    with pytest.raises(NotLoaded):
        session.answer([Message("user", "hi")])
    with pytest.raises(NotLoaded):
        session.calibrate()


def test_a_prompt_longer_than_the_context_is_refused_in_one_line(tmp_path, tokenizer):
    folder = short_context_folder(tmp_path, tokenizer, positions=24)
    session = ChatSession()
    session.load(LoadSpec(str(folder), draft="ngram", device="cpu", precision="fp32"))
    with pytest.raises(ContextTooLong, match="holds 24") as err:
        session.answer([Message("user", "The quick brown fox jumps over the lazy dog. " * 3)])
    assert "\n" not in str(err.value)


def test_generation_stops_at_the_models_last_position(tmp_path, tokenizer):
    folder = short_context_folder(tmp_path, tokenizer, positions=24)
    session = ChatSession()
    session.load(LoadSpec(str(folder), draft="none", device="cpu", precision="fp32"))
    _, done = answer(session, "hi", GenerationParams(max_new_tokens=100))
    if done.stats.stop_reason != "eos":
        assert done.stats.stop_reason == "context_full"
        assert done.stats.prompt_tokens + done.stats.new_tokens == 24


def short_context_folder(tmp_path: Path, tokenizer, positions: int) -> Path:
    model = tiny_model(len(tokenizer))
    model.config.max_position_embeddings = positions
    folder = tmp_path / f"ctx{positions}"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_out_of_memory_while_generating_leaves_a_usable_session(loaded, monkeypatch):
    _, expected = answer(loaded)
    runner = loaded.engine.target
    real_forward = runner.forward
    calls = {"n": 0}

    def forward_that_runs_out(ids, logits_to_keep):
        calls["n"] += 1
        if calls["n"] == 3:
            real_forward(ids, logits_to_keep)  # the cache grew before memory ran out
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real_forward(ids, logits_to_keep)

    monkeypatch.setattr(runner, "forward", forward_that_runs_out)
    with pytest.raises(OutOfMemory, match="session is still usable"):
        answer(loaded)
    monkeypatch.undo()
    assert answer(loaded)[1].token_ids == expected.token_ids


def test_an_unexpected_failure_is_an_internal_error_with_its_cause(loaded, monkeypatch):
    def broken(*args, **kwargs):
        raise IndexError("index 7 is out of bounds")

    monkeypatch.setattr(loaded.engine, "generate", broken)
    with pytest.raises(InternalError) as err:
        answer(loaded)
    assert err.value.exit_code == 1 and "IndexError" in str(err.value)
    assert isinstance(err.value.__cause__, IndexError)


def test_cancel_stops_the_answer(loaded):
    cancel = threading.Event()
    cancel.set()
    events = list(loaded.answer([Message("user", "hi")], params=GREEDY, cancel=cancel))
    assert events[-1].stats.stop_reason == "cancelled"


@pytest.mark.parametrize(
    ("field", "value", "allowed"),
    [
        ("temperature", float("nan"), "≥ 0"),
        ("temperature", -1.0, "≥ 0"),
        ("top_p", 0.0, "(0, 1]"),
        ("top_p", 2.0, "(0, 1]"),
        ("top_k", -3, "≥ 0"),
        ("max_new_tokens", 0, "≥ 1"),
        ("max_new_tokens", -5, "≥ 1"),
        ("draft_length", 99, "from 0 to 8"),
        ("max_draft_length", 16, "from 0 to 15"),
        ("max_draft_length", -1, "from 0 to 15"),
        ("seed", -1, "from 0"),
    ],
)
def test_parameters_out_of_range_are_refused_naming_the_range(field, value, allowed):
    import dataclasses

    with pytest.raises(InvalidParameter, match=field) as err:
        check_params(dataclasses.replace(GenerationParams(), **{field: value}))
    assert allowed in str(err.value)


def test_remembered_conversations_reach_the_drafters_library_and_survive_a_draft_swap(
    tiny_folder, sibling_folder
):
    session = ChatSession()
    session.load(LoadSpec(target=str(tiny_folder), draft="suffix", device="cpu", precision="fp32"))
    past = [[Message("user", "Write a loop."), Message("assistant", "for i in range(3):\n    print(i)")]]
    held = session.remember(past)
    assert held > 10
    session.swap_draft(str(sibling_folder))  # a model draft, with prompt lookup: no library
    assert library_of(session.engine.drafter) is None
    session.swap_draft("suffix")
    suffix = library_of(session.engine.drafter)
    assert suffix is not None and suffix.library.tokens == held  # the library survived the swaps
    session.swap_draft("ngram")  # prompt lookup keeps no library
    assert session.remember(past) == 0
    _, done = answer(session)  # still answers, exactly as before
    assert done.token_ids


def test_max_copy_length_is_checked_like_max_draft_length():
    with pytest.raises(InvalidParameter, match="max_copy_length"):
        check_params(GenerationParams(max_copy_length=16))
