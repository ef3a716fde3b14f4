"""Reading ahead while the user types: the answer after a read ahead is the answer without one,
whatever was typed, deleted or sent meanwhile; only the reuse changes."""

from __future__ import annotations

import threading

import pytest

from specdec_core.engine.events import DoneEvent, PrefillEvent, ReadAheadEvent
from specdec_core.engine.speculative import GenerationParams
from specdec_core.models.chat import Message, encode_chat, settled_prefix
from specdec_core.session import ChatSession, LoadSpec

GREEDY = GenerationParams(max_new_tokens=24)
HISTORY = [Message("user", "def add(a, b):"), Message("assistant", "    return a + b")]
PASTE = "for i in range(10):\n    print(i * i)\n\nThe quick brown fox jumps over the lazy dog. "


@pytest.fixture(scope="module")
def session(tiny_folder, sibling_folder) -> ChatSession:
    session = ChatSession()
    session.load(LoadSpec(target=str(tiny_folder), draft=str(sibling_folder), device="cpu", precision="fp32"))
    session.engine.prefill_chunk = 8  # several chunks even for the tiny prompts here
    return session


def fresh(session: ChatSession) -> None:
    """Nothing cached: the answer reads its whole prompt."""
    session.engine.target.reset()
    session.engine.drafter.reset()


def answer(session: ChatSession, text: str) -> tuple[list[int], PrefillEvent]:
    events = list(session.answer([*HISTORY, Message("user", text)], params=GREEDY))
    prefill = next(e for e in events if isinstance(e, PrefillEvent))
    done = events[-1]
    assert isinstance(done, DoneEvent)
    return list(done.token_ids), prefill


def without_read_ahead(session: ChatSession, text: str) -> list[int]:
    fresh(session)
    tokens, prefill = answer(session, text)
    assert prefill.reused_tokens == 0
    return tokens


def read_ahead(
    session: ChatSession, typing: str, stop: threading.Event | None = None
) -> list[ReadAheadEvent]:
    return list(session.read_ahead(HISTORY, typing, stop=stop))


def test_the_session_reads_ahead_in_chunks_on_the_tiny_pair(session):
    assert session.engine._prefill_chunk() == 8  # the self-check measured chunks bitwise


def test_after_a_read_ahead_the_answer_is_the_same_and_reads_only_the_rest(session):
    sent = PASTE + "What does it print?"
    expected = without_read_ahead(session, sent)
    fresh(session)
    events = read_ahead(session, PASTE + "What does")
    assert events[0].cached == 0 and events[-1].cached == events[-1].total > 0
    tokens, prefill = answer(session, sent)
    assert tokens == expected
    assert prefill.reused_tokens >= events[-1].total  # the read ahead was a prefix of the prompt


def test_the_draft_model_reads_ahead_too(session):
    fresh(session)
    events = read_ahead(session, PASTE + "What does")
    drafter_ids = session.engine.drafter.runners()[0].ids
    prompt = encode_chat(session.engine.tokenizer, [*HISTORY, Message("user", PASTE + "What does it")])
    assert len(drafter_ids) == events[-1].total
    assert drafter_ids == prompt[: len(drafter_ids)]


def test_text_deleted_after_the_read_ahead_keeps_the_answer(session):
    sent = "The quick brown fox. What is this?"
    expected = without_read_ahead(session, sent)
    fresh(session)
    read_ahead(session, PASTE + "and then much more text that the user deletes again ")
    tokens, prefill = answer(session, sent)
    assert tokens == expected
    assert prefill.reused_tokens > 0  # the conversation before the message was kept


def test_send_in_the_middle_of_a_read_keeps_what_was_read_and_the_answer(session):
    sent = PASTE + "What does it print?"
    expected = without_read_ahead(session, sent)
    fresh(session)
    stop = threading.Event()
    reads = session.read_ahead(HISTORY, PASTE + "What does", stop=stop)
    first, second = next(reads), next(reads)  # before the first chunk, then after it
    stop.set()  # Send: the read ends at the chunk boundary
    assert list(reads) == []
    assert second.cached == first.cached + 8 < second.total
    tokens, prefill = answer(session, sent)
    assert tokens == expected
    assert prefill.reused_tokens == second.cached


def test_a_read_ahead_for_another_conversation_never_changes_the_answer(session):
    sent = "What does it print?"
    expected = without_read_ahead(session, sent)
    fresh(session)
    list(session.read_ahead([Message("user", "Ünïcödé текст")], PASTE, system="Be brief."))
    tokens, _ = answer(session, sent)
    assert tokens == expected


@pytest.mark.parametrize(
    "typed, more",
    [
        (PASTE, "What does it print?"),
        (PASTE + "What does", " it print?"),
        (PASTE + "What do", "es it print?"),
        ("def add(a, b):\n", "    return a + b\n"),
        ("Größe, naïve café,", " 東京 and 🚀"),
        ("", "hello"),
    ],
)
def test_the_settled_prefix_is_a_prefix_of_the_prompt_sent(tokenizer, typed, more):
    settled = settled_prefix(tokenizer, HISTORY, typed)
    prompt = encode_chat(tokenizer, [*HISTORY, Message("user", (typed + more).strip())])
    assert settled == prompt[: len(settled)]
    turn = tokenizer.convert_tokens_to_ids("<|im_start|>")
    new_message = [i for i, token in enumerate(prompt) if token == turn][-2]  # before the assistant's
    assert len(settled) >= new_message  # at least the conversation before the new message


def test_a_served_engine_reads_nothing_ahead():
    session = ChatSession()
    session._served = object()  # type: ignore[assignment]  # only its presence is read
    assert list(session.read_ahead(HISTORY, PASTE)) == []


def test_a_seeded_sampled_answer_is_the_same_after_a_read_ahead(session):
    sent = PASTE + "What does it print?"
    params = GenerationParams(max_new_tokens=24, temperature=0.8, top_p=0.9, seed=7, draft_length=3)

    def sampled() -> list[int]:
        events = list(session.answer([*HISTORY, Message("user", sent)], params=params))
        done = events[-1]
        assert isinstance(done, DoneEvent)
        return list(done.token_ids)

    fresh(session)
    expected = sampled()
    fresh(session)
    read_ahead(session, PASTE + "What does")
    assert sampled() == expected
