"""Greedy exactness: the engine commits exactly transformers' greedy tokens, for every drafter."""

from __future__ import annotations

import copy
import threading

import pytest
from tiny import hf_greedy, perturbed, tiny_model

from specdec_core.engine.drafters import LookupThenModelDrafter, ModelDrafter, NgramDrafter, NoDrafter
from specdec_core.engine.events import DoneEvent, PrefillEvent, ReadingEvent, Source, StepEvent, TokenEvent
from specdec_core.engine.selfcheck import NEAR_TIES, UNVERIFIED, ExactnessReport, check_exactness
from specdec_core.engine.speculative import GenerationParams, SpeculativeEngine
from specdec_core.models.chat import Message, encode_chat
from specdec_core.models.cpu_backend import prepare_for_cpu


def run(engine: SpeculativeEngine, prompt: list[int], **params) -> DoneEvent:
    events = list(engine.generate(prompt, GenerationParams(**params)))
    assert isinstance(events[-1], DoneEvent)
    return events[-1]


@pytest.fixture(scope="module")
def drafters(tokenizer, target):
    v = len(tokenizer)
    return {
        "same": lambda: ModelDrafter(tiny_model(v, seed=0), "same"),
        "perturbed": lambda: ModelDrafter(perturbed(target, 0.05), "perturbed"),
        "random": lambda: ModelDrafter(tiny_model(v, seed=7), "random"),
        "ngram": lambda: NgramDrafter(),
        "lookup+perturbed": lambda: LookupThenModelDrafter(
            ModelDrafter(perturbed(target, 0.05), "perturbed")
        ),
        "none": lambda: NoDrafter(),
    }


PROMPTS = {
    "code": "def add(a, b):\n    return a + b\n\nfor i in range(10):",
    "one_token": "def",
}


@pytest.mark.parametrize("draft_length", [None, 1, 4, 7])
@pytest.mark.parametrize("drafter_name", ["same", "perturbed", "random", "ngram", "lookup+perturbed", "none"])
@pytest.mark.parametrize("prompt_name", list(PROMPTS))
def test_greedy_output_equals_transformers_generate(
    tokenizer, target, drafters, drafter_name, prompt_name, draft_length
):
    prompt = tokenizer(PROMPTS[prompt_name])["input_ids"]
    if prompt_name == "one_token":
        prompt = prompt[:1]
    expected = hf_greedy(target, prompt, 40)
    engine = SpeculativeEngine(target, tokenizer, drafters[drafter_name]())
    done = run(engine, prompt, max_new_tokens=40, draft_length=draft_length)
    assert list(done.token_ids) == expected
    assert done.stats.steps >= 3


def test_identical_draft_accepts_everything(tokenizer, target, drafters):
    prompt = tokenizer(PROMPTS["code"])["input_ids"]
    done = run(
        SpeculativeEngine(target, tokenizer, drafters["same"]()), prompt, max_new_tokens=40, draft_length=4
    )
    assert done.stats.proposed > 0
    assert done.stats.acceptance_rate == 1.0
    assert done.stats.mean_accepted_length > 4  # 4 accepted + bonus per step (last step may be cut)


def test_random_draft_is_almost_never_accepted(tokenizer, target, drafters):
    prompt = tokenizer(PROMPTS["code"])["input_ids"]
    done = run(
        SpeculativeEngine(target, tokenizer, drafters["random"]()), prompt, max_new_tokens=40, draft_length=4
    )
    assert done.stats.acceptance_rate < 0.1


def test_perturbed_draft_is_partially_accepted(tokenizer, target, drafters):
    prompt = tokenizer(PROMPTS["code"])["input_ids"]
    engine = SpeculativeEngine(target, tokenizer, drafters["perturbed"]())
    done = run(engine, prompt, max_new_tokens=60, draft_length=4)
    assert 0.1 < done.stats.acceptance_rate < 1.0


def test_multi_turn_chat_prompts_stay_exact_and_reuse_the_cache(tokenizer, target, drafters):
    engine = SpeculativeEngine(target, tokenizer, drafters["perturbed"]())
    history = [Message("user", "Write a loop.")]
    first = encode_chat(tokenizer, history, system="Be brief.")
    done1 = run(engine, first, max_new_tokens=20, draft_length=3)
    assert list(done1.token_ids) == hf_greedy(target, first, 20)
    history += [Message("assistant", done1.text), Message("user", "Now add a print.")]
    second = encode_chat(tokenizer, history, system="Be brief.")
    events = list(engine.generate(second, GenerationParams(max_new_tokens=20, draft_length=3)))
    assert events[0].reused_tokens > len(first) // 2  # the shared prefix was not recomputed
    assert list(events[-1].token_ids) == hf_greedy(target, second, 20)


def test_eos_inside_an_accepted_run_stops_there(tokenizer, target, drafters):
    prompt = tokenizer(PROMPTS["code"])["input_ids"]
    free_run = hf_greedy(target, prompt, 30)
    # Pick as "EOS" a token first produced mid-way, so it lands inside a 4-token accepted run.
    position = next(i for i in range(6, 30) if free_run[i] not in free_run[:i] and i % 5 != 4)
    eos = free_run[position]
    expected = hf_greedy(target, prompt, 30, eos=[eos])
    assert expected[-1] == eos and len(expected) == position + 1
    engine = SpeculativeEngine(target, tokenizer, drafters["same"](), stop_token_ids=[eos])
    done = run(engine, prompt, max_new_tokens=30, draft_length=4)
    assert list(done.token_ids) == expected
    assert done.stats.stop_reason == "eos"


@pytest.mark.parametrize("max_new_tokens", [1, 2, 7, 9])
def test_max_new_tokens_ending_mid_draft(tokenizer, target, drafters, max_new_tokens):
    prompt = tokenizer(PROMPTS["code"])["input_ids"]
    engine = SpeculativeEngine(target, tokenizer, drafters["same"]())
    done = run(engine, prompt, max_new_tokens=max_new_tokens, draft_length=4)
    assert list(done.token_ids) == hf_greedy(target, prompt, max_new_tokens)
    assert done.stats.stop_reason == "max_tokens"


@pytest.mark.parametrize("drafter_name", ["same", "perturbed", "ngram", "lookup+perturbed"])
def test_caches_hold_only_committed_tokens_after_every_verify(tokenizer, target, drafters, drafter_name):
    prompt = tokenizer(PROMPTS["code"])["input_ids"]
    drafter = drafters[drafter_name]()
    engine = SpeculativeEngine(target, tokenizer, drafter)
    tokens = list(prompt)
    steps = 0
    for event in engine.generate(prompt, GenerationParams(max_new_tokens=30, draft_length=4)):
        if isinstance(event, TokenEvent):
            tokens.append(event.token_id)
        if isinstance(event, StepEvent):
            steps += 1
            # Target: every committed token but the last (the next forward starts from it).
            assert engine.target.ids == tokens[:-1]
            assert engine.target.cache.get_seq_length() == len(tokens) - 1
            if isinstance(drafter, (ModelDrafter, LookupThenModelDrafter)):
                cached = drafter.runner.ids
                assert cached == tokens[: len(cached)]
                assert drafter.runner.cache.get_seq_length() == len(cached)
    assert steps >= 3


def test_all_accepted_draft_catches_up_on_bonus_token(tokenizer, target):
    drafter = ModelDrafter(tiny_model(len(tokenizer), seed=0), "same")
    engine = SpeculativeEngine(target, tokenizer, drafter)
    prompt = tokenizer(PROMPTS["code"])["input_ids"]
    gen = engine.generate(prompt, GenerationParams(max_new_tokens=30, draft_length=4))
    tokens = list(prompt)
    for event in gen:
        if isinstance(event, TokenEvent):
            tokens.append(event.token_id)
        if isinstance(event, StepEvent) and event.accepted == 4:
            break
    # After 4 accepted + bonus, the draft has cached up to d_3: it lacks d_4 and the bonus.
    assert len(drafter.runner.ids) == len(tokens) - 2
    fresh = ModelDrafter(tiny_model(len(tokenizer), seed=0), "fresh")
    sampling = GenerationParams().sampling
    assert (
        drafter.propose(tokens, 3, sampling, None).tokens == fresh.propose(tokens, 3, sampling, None).tokens
    )
    assert drafter.runner.ids[: len(tokens)] == tokens  # it caught up on both tokens
    gen.close()


def test_provenance_labels_follow_the_verdicts(tokenizer, target, drafters):
    prompt = tokenizer(PROMPTS["code"])["input_ids"]
    same = SpeculativeEngine(target, tokenizer, drafters["same"]())
    sources = {
        e.source
        for e in same.generate(prompt, GenerationParams(max_new_tokens=20, draft_length=4))
        if isinstance(e, TokenEvent)
    }
    assert sources == {Source.ACCEPTED, Source.BONUS}
    rand = SpeculativeEngine(target, tokenizer, drafters["random"]())
    sources = {
        e.source
        for e in rand.generate(prompt, GenerationParams(max_new_tokens=20, draft_length=4))
        if isinstance(e, TokenEvent)
    }
    assert Source.CORRECTED in sources
    plain = SpeculativeEngine(target, tokenizer, NoDrafter())
    sources = {
        e.source
        for e in plain.generate(prompt, GenerationParams(max_new_tokens=10))
        if isinstance(e, TokenEvent)
    }
    assert sources == {Source.TARGET}


def test_speculation_toggle_applies_at_the_next_step(tokenizer, target, drafters):
    prompt = tokenizer(PROMPTS["code"])["input_ids"]
    engine = SpeculativeEngine(target, tokenizer, drafters["same"]())
    sources_after: list[Source] = []
    for event in engine.generate(prompt, GenerationParams(max_new_tokens=30, draft_length=4)):
        if isinstance(event, StepEvent) and event.step == 2:
            engine.speculation_enabled = False
        elif isinstance(event, TokenEvent) and not engine.speculation_enabled:
            sources_after.append(event.source)
        elif isinstance(event, DoneEvent):
            assert list(event.token_ids) == hf_greedy(target, prompt, 30)
    assert sources_after and set(sources_after) == {Source.TARGET}


def test_cancel_stops_within_a_step_and_the_engine_stays_usable(tokenizer, target, drafters):
    prompt = tokenizer(PROMPTS["code"])["input_ids"]
    engine = SpeculativeEngine(target, tokenizer, drafters["perturbed"]())
    cancel = threading.Event()
    steps_after_cancel = 0
    for event in engine.generate(prompt, GenerationParams(max_new_tokens=50, draft_length=3), cancel=cancel):
        if isinstance(event, StepEvent):
            if cancel.is_set():
                steps_after_cancel += 1
            if event.step == 2:
                cancel.set()
        if isinstance(event, DoneEvent):
            assert event.stats.stop_reason == "cancelled"
            assert event.stats.steps == 2
    assert steps_after_cancel == 0
    done = run(engine, prompt, max_new_tokens=25, draft_length=3)
    assert list(done.token_ids) == hf_greedy(target, prompt, 25)


def test_abandoned_generator_leaves_the_engine_usable(tokenizer, target, drafters):
    prompt = tokenizer(PROMPTS["code"])["input_ids"]
    engine = SpeculativeEngine(target, tokenizer, drafters["same"]())
    gen = engine.generate(prompt, GenerationParams(max_new_tokens=50, draft_length=4))
    for event in gen:
        if isinstance(event, TokenEvent) and event.source is Source.ACCEPTED:
            break  # stop mid-step, between two token events
    gen.close()
    other = tokenizer("for i in range(3):")["input_ids"]
    assert list(run(engine, other, max_new_tokens=20, draft_length=4).token_ids) == hf_greedy(
        target, other, 20
    )


def test_draft_with_a_larger_vocabulary_is_padded_not_trusted(tokenizer, target):
    v = len(tokenizer)
    drafter = ModelDrafter(tiny_model(v + 16, seed=0), "wide", vocab_size=v)
    engine = SpeculativeEngine(target, tokenizer, drafter)
    prompt = tokenizer(PROMPTS["code"])["input_ids"]
    assert list(run(engine, prompt, max_new_tokens=30, draft_length=4).token_ids) == hf_greedy(
        target, prompt, 30
    )


@pytest.mark.parametrize("auto", [False, True])
def test_a_draft_reads_only_the_latest_window_of_a_long_prompt_and_the_output_stays_the_targets(
    tokenizer, target, auto
):
    model_drafter = ModelDrafter(perturbed(target, 0.05), "windowed")
    model_drafter.max_catch_up, model_drafter.window = 24, 16
    drafter = LookupThenModelDrafter(model_drafter) if auto else model_drafter
    engine = SpeculativeEngine(target, tokenizer, drafter)
    prompt = tokenizer(PROMPTS["code"] * 3)["input_ids"]
    assert len(prompt) > 40
    done = list(engine.generate(prompt, GenerationParams(max_new_tokens=24, draft_length=4)))[-1]
    assert isinstance(done, DoneEvent)
    assert list(done.token_ids) == hf_greedy(target, prompt, 24)
    tokens = [*prompt, *done.token_ids]
    start = model_drafter.window_start
    assert 0 < start <= len(prompt) - 16 + 1  # cut once, at the first draft: the rest was read step by step
    cached = model_drafter.runner.ids
    assert cached == tokens[start : start + len(cached)]
    # A short conversation after it is read whole again.
    short = tokenizer("def f():")["input_ids"]
    model_drafter.propose(short, 2, GenerationParams().sampling, None)
    assert model_drafter.window_start == 0 and model_drafter.runner.ids[: len(short) - 1] == short[:-1]


@pytest.fixture(scope="module")
def rowwise_target(target):
    """The tiny target as the CPU loader prepares it: each row's numbers its own (batch-invariant)."""
    model = copy.deepcopy(target)
    prepare_for_cpu(model, "fp32")
    return model


def bitwise_engine(tokenizer, target, drafter, chunk: int) -> SpeculativeEngine:
    """An engine whose self-check measured bitwise, reading prompts `chunk` tokens at a time."""
    engine = SpeculativeEngine(target, tokenizer, drafter)
    engine.exactness = check_exactness(engine)
    assert engine.exactness.bitwise  # the tiny model runs the CPU's row-wise kernels
    engine.prefill_chunk = chunk
    return engine


def test_a_long_prompt_is_read_in_chunks_that_report_progress_and_change_nothing(
    tokenizer, rowwise_target, target
):
    prompt = tokenizer(PROMPTS["code"] * 3)["input_ids"]
    drafter = LookupThenModelDrafter(ModelDrafter(perturbed(target, 0.05), "perturbed"))
    engine = bitwise_engine(tokenizer, rowwise_target, drafter, chunk=8)
    events = list(engine.generate(prompt, GenerationParams(max_new_tokens=24, draft_length=3)))
    reading = [e for e in events if isinstance(e, ReadingEvent)]
    total = len(prompt) - 1  # the last prompt token is the first step's input
    assert [e.read for e in reading] == list(range(0, total, 8))
    assert {e.total for e in reading} == {total}
    first_other = next(i for i, e in enumerate(events) if not isinstance(e, ReadingEvent))
    assert first_other == len(reading) and isinstance(events[first_other], PrefillEvent)
    assert events[-1].stats.target_forwards >= len(reading)
    assert list(events[-1].token_ids) == hf_greedy(target, prompt, 24)


def test_a_prompt_is_one_forward_unless_the_self_check_measured_bitwise(tokenizer, target):
    prompt = tokenizer(PROMPTS["code"] * 3)["input_ids"]
    engine = SpeculativeEngine(target, tokenizer, NoDrafter())
    engine.prefill_chunk = 8
    near_ties = ExactnessReport(label=NEAR_TIES, max_logit_diff=1e-6, positions=8, seconds=0.0)
    unverified = ExactnessReport(label=UNVERIFIED, max_logit_diff=0.0, positions=8, seconds=0.0)
    # Unchecked, rows that may depend on each other, or a check cut short by its budget.
    for report in (None, near_ties, unverified):
        engine.exactness = report
        engine.target.reset()
        events = list(engine.generate(prompt, GenerationParams(max_new_tokens=4)))
        assert not any(isinstance(e, ReadingEvent) for e in events)
        assert events[-1].stats.target_forwards == 1 + 4  # the prefill, then one per token


def test_stop_while_reading_a_prompt_ends_before_the_first_token_and_keeps_what_was_read(
    tokenizer, rowwise_target, target
):
    prompt = tokenizer(PROMPTS["code"] * 3)["input_ids"]
    engine = bitwise_engine(tokenizer, rowwise_target, NoDrafter(), chunk=8)
    cancel = threading.Event()
    events = []
    for event in engine.generate(prompt, GenerationParams(max_new_tokens=10), cancel=cancel):
        events.append(event)
        if isinstance(event, ReadingEvent) and event.read == 16:
            cancel.set()  # the third chunk is announced: it is not read
    done = events[-1]
    assert isinstance(done, DoneEvent) and done.stats.stop_reason == "cancelled"
    assert done.token_ids == () and not any(isinstance(e, (PrefillEvent, TokenEvent)) for e in events)
    assert engine.target.ids == prompt[:16]
    # Sent again, the answer starts from the chunks already read and is the target's.
    again = list(engine.generate(prompt, GenerationParams(max_new_tokens=10)))
    prefill = next(e for e in again if isinstance(e, PrefillEvent))
    assert prefill.reused_tokens == 16
    assert list(again[-1].token_ids) == hf_greedy(target, prompt, 10)
