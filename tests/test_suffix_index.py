"""The suffix index and its drafter: matches, incremental updates, frequencies, bounded memory."""

from __future__ import annotations

import random

import pytest
from tiny import hf_greedy, perturbed

from specdec_core.engine.adaptive import CostModel
from specdec_core.engine.drafters import DraftPlan, LookupThenModelDrafter, ModelDrafter, NgramDrafter
from specdec_core.engine.sampling import SamplingParams
from specdec_core.engine.speculative import MAX_DRAFT_LENGTH, GenerationParams, SpeculativeEngine
from specdec_core.engine.suffix_drafter import SuffixDrafter, library_of, match_key, set_library
from specdec_core.engine.suffix_index import ROOT, SuffixIndex

GREEDY = SamplingParams()


def index_of(*sequences: list[int], depth: int = 8, max_nodes: int = 100_000) -> SuffixIndex:
    index = SuffixIndex(depth, max_nodes)
    for sequence in sequences:
        index.begin()
        index.extend(sequence)
    return index


def test_the_longest_earlier_match_decides_the_continuation():
    # "2 3" is followed by 9 once and by 4 once; "1 2 3" only by 4.
    index = index_of([1, 2, 3, 4, 5, 7, 2, 3, 9, 1, 2, 3])
    proposal = index.propose(index.tail(), 2)
    assert proposal.tokens == [4, 5] and proposal.match == 3


def test_the_most_frequent_continuation_wins_and_the_latest_breaks_a_tie():
    index = index_of([5, 1, 5, 2, 5, 2, 5])
    assert index.propose(index.tail(), 1).tokens == [2]  # 5 -> 2 twice, 5 -> 1 once
    tie = index_of([5, 1, 5, 2, 5])
    assert tie.propose(tie.tail(), 1).tokens == [2]  # once each: the latest


def test_counts_are_occurrences_of_each_string():
    index = index_of([1, 2, 1, 2, 1])
    one_two = index.follow(index.follow(ROOT, 1), 2)
    assert index.count(one_two) == 2 and index.depth_of(one_two) == 2
    assert index.count(index.follow(ROOT, 1)) == 3


def test_a_draft_stops_where_its_estimated_probability_falls_under_the_threshold():
    # After "7" the text went on with 1 twice and 2 and 3 once each: p(1) = 1/2.
    index = index_of([7, 1, 7, 2, 7, 1, 7, 3, 7])
    assert index.propose(index.tail(), 4, min_prob=0.4).tokens == [1]
    assert index.propose(index.tail(), 4, min_prob=0.6).tokens == []


def test_a_draft_is_at_most_factor_times_its_match():
    index = index_of([1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2])
    assert index.propose(index.tail(), 15, factor=1.0).tokens == [3, 4]
    assert index.propose(index.tail(), 15, factor=3.0).tokens == [3, 4, 5, 6, 7, 8]


def test_a_draft_runs_past_the_trie_depth_on_repeated_text():
    block = list(range(100, 140))
    index = index_of(block + block[:10], depth=6)
    proposal = index.propose(index.tail(), MAX_DRAFT_LENGTH, factor=10.0)
    assert proposal.tokens == block[10:25] and proposal.match == 5  # depth 6: the tail node is a leaf


def test_appending_updates_the_index_like_a_rebuild():
    rng = random.Random(1)
    text = [rng.randrange(6) for _ in range(300)]
    grown = index_of(text[:100])
    grown.extend(text[100:])
    whole = index_of(text)
    for end in range(20, 300, 17):
        context = text[:end]
        a, b = grown.match(context), whole.match(context)
        assert grown.propose(a, 6) == whole.propose(b, 6)
    assert grown.nodes == whole.nodes and grown.tokens == whole.tokens == 300


def test_follow_finds_the_longest_suffix_the_index_holds():
    index = index_of([1, 2, 3, 4])
    node = ROOT
    for token in [9, 2, 3]:
        node = index.follow(node, token)
    assert index.depth_of(node) == 2  # "2 3"
    assert index.depth_of(index.follow(node, 7)) == 0


def test_no_match_runs_across_two_documents():
    index = index_of([1, 2], [3, 4])
    assert index.count(index.match([2, 3])) == 1 and index.depth_of(index.match([2, 3])) == 1


def test_memory_is_bounded_by_the_node_limit():
    rng = random.Random(2)
    index = index_of([rng.randrange(1000) for _ in range(5000)], depth=16, max_nodes=2000)
    assert index.nodes <= 2000 and index.full


def test_the_drafter_rebuilds_over_the_latest_tokens_past_its_memory_bound():
    rng = random.Random(3)
    text = [rng.randrange(1000) for _ in range(3000)]
    drafter = SuffixDrafter(depth=8, max_nodes=4000)
    drafter.sync(text)
    assert drafter.conversation.nodes <= 4000 and not drafter.conversation.full
    repeat = text[-200:-190]
    found, _ = drafter.match([*text, *repeat], 5)
    assert found == text[-190:-185]  # the latest tokens are still matched


def test_drafter_follows_committed_tokens_and_starts_over_on_another_conversation():
    drafter = SuffixDrafter()
    drafter.sync([1, 2, 3, 4, 5, 1, 2])
    assert drafter.match([1, 2, 3, 4, 5, 1, 2], 3) == ([3, 4], 2)  # as long as the match
    assert drafter.match([1, 2, 3, 4, 5, 1, 2, 3], 2) == ([4, 5], 3)
    assert drafter.match([9, 8, 9], 1) == ([8], 1)  # not a continuation: a new index


def test_a_match_past_draft_tokens_indexes_nothing():
    drafter = SuffixDrafter()
    tokens = [1, 2, 3, 4, 5, 6, 1]
    found, n = drafter.match_after(tokens, [2, 3], 3)
    assert (found, n) == ([4, 5, 6], 3)
    assert drafter.conversation.tokens == len(tokens)


def test_library_documents_give_drafts_and_survive_a_new_conversation():
    drafter = SuffixDrafter()
    assert drafter.add_documents([[40, 41, 42, 43, 44, 45]]) == 6
    drafter.reset()
    assert drafter.match([7, 40, 41, 42], 3) == ([43, 44, 45], 3)
    drafter.clear_documents()
    assert drafter.match([7, 40, 41, 42], 3) == ([], 0)


def test_the_better_scoring_index_drafts():
    drafter = SuffixDrafter()
    drafter.add_documents([[1, 2, 3, 4, 5, 6, 7, 8]])
    # The conversation matches "3" once (followed by 9); the library matches "1 2 3".
    found, n = drafter.match([3, 9, 1, 2, 3], 4)
    assert found == [4, 5, 6] and n == 3


def test_set_library_reaches_the_suffix_lookup_of_a_mixed_drafter(target):
    mixed = LookupThenModelDrafter(ModelDrafter(target, "d"), SuffixDrafter(min_match=2))
    assert library_of(mixed) is mixed.lookup_drafter
    assert set_library(mixed, [[1, 2, 3]]) == 3
    assert set_library(LookupThenModelDrafter(ModelDrafter(target, "d")), [[1, 2, 3]]) == 0


def test_match_keys_round_lengths_down():
    assert [match_key(n) for n in (0, 1, 2, 5, 7, 11, 16, 40)] == [0, 1, 2, 4, 6, 8, 16, 16]


def test_the_drafter_may_copy_past_the_model_draft_length():
    drafter = SuffixDrafter()
    drafter.start(DraftPlan(CostModel(), max_k=8, pinned=None, max_copy=MAX_DRAFT_LENGTH))
    block = list(range(200, 240))
    drafter.controller.acceptance.observe(MAX_DRAFT_LENGTH, MAX_DRAFT_LENGTH)
    drafter.controller.costs = CostModel(verify={m: 0.1 * (1 + 0.05 * (m - 1)) for m in range(1, 17)})
    draft = drafter.draft([*block, *block[:20]], MAX_DRAFT_LENGTH, GREEDY, None)
    assert len(draft.tokens) > 8 and draft.tokens == block[20 : 20 + len(draft.tokens)]


@pytest.mark.parametrize("max_copy", [0, MAX_DRAFT_LENGTH])
def test_long_copies_never_change_greedy_output(tokenizer, target, max_copy):
    """Repeated code: the suffix copies run long, and the output is the target's."""
    text = "def area(w, h):\n    return w * h\n\nprint(area(2, 3))\n" * 4
    prompt = tokenizer(text)["input_ids"]
    alone = hf_greedy(target, prompt, 48)
    params = GenerationParams(max_new_tokens=48, max_copy_length=max_copy)
    for drafter in (
        SuffixDrafter(),
        LookupThenModelDrafter(ModelDrafter(perturbed(target, 0.05), "d"), SuffixDrafter(min_match=2)),
        LookupThenModelDrafter(ModelDrafter(perturbed(target, 0.05), "d"), NgramDrafter()),
    ):
        engine = SpeculativeEngine(target, tokenizer, drafter)
        done = list(engine.generate(prompt, params))[-1]
        assert list(done.token_ids) == alone, drafter
        assert max(done.stats.k_histogram, default=0) <= max(8, max_copy)


def test_committed_tokens_extend_the_index_without_a_rebuild():
    drafter = SuffixDrafter()
    text = list(range(500))
    drafter.sync(text)
    index, nodes = drafter.conversation, drafter.conversation.nodes
    drafter.sync([*text, 7, 8])
    assert drafter.conversation is index and index.tokens == 502 and index.nodes > nodes
