"""Plausible answers as stored tokens (prose, a heading, lists, fenced Python), and a
session wrapper that makes a real engine's stream carry such text.

Tiny models write no code fences, yet the first code block and the transcript's
growth are what a streaming answer's redraws cost (issue #57). `with_canned_text`
keeps the engine's own events and pace and swaps only the tokens' text.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
from collections.abc import Iterator, Sequence

from specdec_app.conversations import Conversation, StoredMessage, StoredToken

from specdec_core import ChatSession, DoneEvent, Event, Message, TokenEvent

SOURCES = ("accepted", "accepted", "accepted", "corrected", "bonus", "target")
PROSE = [
    "the",
    "model",
    "writes",
    "a",
    "**bold**",
    "claim",
    "and",
    "some",
    "`inline",
    "code`",
    "then",
    "explains",
    "it",
]
CODE = ["def", " area", "(r", "):", "\n    return", " 3.14", " *", " r", " **", " 2", "\n"]


def answer_texts(count: int, seed: int = 0, prose_first: int = 0) -> list[str]:
    """`count` token texts: paragraphs, headings, lists and Python fences, at random after
    `prose_first` tokens of plain prose (the first code block opens mid-answer)."""
    rng = random.Random(seed)
    texts: list[str] = []
    while len(texts) < prose_first:
        texts += [" " + rng.choice(PROSE) for _ in range(20)] + [".\n\n"]
    while len(texts) < count:
        kind = rng.choice(("prose", "prose", "list", "code", "heading"))
        if kind == "prose":
            texts += [" " + rng.choice(PROSE) for _ in range(rng.randint(8, 40))] + [".\n\n"]
        elif kind == "list":
            texts += ["- item", " " + rng.choice(PROSE), "\n"] * rng.randint(2, 5) + ["\n"]
        elif kind == "code":
            texts += ["```", "python\n", *CODE * rng.randint(1, 4), "```\n\n"]
        else:
            texts += ["## ", "Section", "\n"]
    return texts[:count]


def answer_tokens(count: int, seed: int = 0) -> list[StoredToken]:
    """`count` tokens of a plausible answer, each with a provenance."""
    rng = random.Random(seed)
    return [
        StoredToken(text, rng.choice(SOURCES), i // 3, 0.5, 0.25)
        for i, text in enumerate(answer_texts(count, seed))
    ]


def answer(count: int, seed: int = 0) -> StoredMessage:
    tokens = answer_tokens(count, seed)
    return StoredMessage("assistant", "".join(t.text for t in tokens), tokens=tokens, footer="Draft: test")


def long_conversation(answers: int, tokens: int) -> Conversation:
    """A conversation of `answers` questions, each answered with `tokens` tokens."""
    conversation = Conversation.new()
    for seed in range(answers):
        conversation.messages += [StoredMessage("user", f"question {seed}"), answer(tokens, seed)]
    return conversation


def with_canned_text(session: ChatSession, texts: list[str]) -> None:
    """From now on `session`'s answers stream `texts` (cycled) as their tokens' text."""
    answer_events = session.answer

    def canned(*args: object, **kwargs: object) -> Iterator[Event]:
        cycle = itertools.cycle(texts)
        written: list[str] = []
        for event in answer_events(*args, **kwargs):  # type: ignore[arg-type]
            if isinstance(event, TokenEvent) and not event.is_stop:
                written.append(next(cycle))
                event = dataclasses.replace(event, text=written[-1])
            elif isinstance(event, DoneEvent):
                event = dataclasses.replace(event, text="".join(written))
            yield event

    session.answer = canned  # type: ignore[method-assign]


def reading_only_the_last_question(session: ChatSession) -> None:
    """From now on `session`'s answers read only the conversation's last message: the window
    still holds and draws the whole transcript, without a prefill of all of it first."""
    answer_events = session.answer

    def last_only(messages: Sequence[Message], **kwargs: object) -> Iterator[Event]:
        return answer_events(messages[-1:], **kwargs)  # type: ignore[arg-type]

    session.answer = last_only  # type: ignore[method-assign]
