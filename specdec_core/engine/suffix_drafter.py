"""Copies from everything the user has written: the suffix index as a drafter.

`SuffixDrafter` keeps two `SuffixIndex`es (SuffixDecoding's two trees): the
conversation (the prompt as the chat template renders it, then each committed token,
indexed as it commits) and a library of other documents (past conversations, given as
token sequences through `add_documents`; they stay across conversations). Each draft
is the better-scoring of the two indexes' proposals: the most frequent continuation of
the longest suffix of the text that occurred before, as long as its estimated
probability holds (`SuffixIndex.propose`). Unlike prompt lookup's fixed n-gram and
latest occurrence, a long match tells apart the many places a short one fits (every
`    return` of a file), and the draft's length follows the match and the agreement of
what followed it, up to the longest copied draft (`DraftPlan.copy_limit`).

The drafter is deterministic, like `NgramDrafter`: its q is one-hot on each token, so
rejection sampling keeps the target's distribution, and greedy output is the target's.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from .drafters import SUFFIX, DraftPlan, LookupDrafter, LookupThenModelDrafter
from .suffix_index import DEPTH, MAX_NODES, NO_PROPOSAL, ROOT, Proposal, SuffixIndex

# The keys the source policy keeps copy acceptance under: a match's length, rounded down
# to one of these. Exact lengths up to the index's depth would spread the verdicts thin.
MATCH_KEYS = (1, 2, 3, 4, 6, 8, 12, 16)


def match_key(match: int) -> int:
    return max((key for key in MATCH_KEYS if key <= match), default=0)


class SuffixDrafter(LookupDrafter):
    """Drafts the most frequent continuation of the longest earlier match (SuffixDecoding)."""

    name = SUFFIX

    def __init__(
        self,
        min_match: int = 1,
        min_prob: float = 0.1,
        factor: float = 1.0,
        depth: int = DEPTH,
        max_nodes: int = MAX_NODES,
    ) -> None:
        self.min_match = min_match
        self.min_prob = min_prob  # a draft ends where its estimated probability falls below
        self.factor = factor  # a draft is at most this many times longer than its match
        self.depth = depth
        self.max_nodes = max_nodes
        self.library = SuffixIndex(depth, max_nodes)
        super().__init__()
        self.reset()

    # -- what is indexed -----------------------------------------------------------------------

    def add_documents(self, documents: Iterable[Sequence[int]]) -> int:
        """Index other token sequences (past conversations) for the drafts of every
        conversation to come; returns the tokens the library holds. A document past the
        library's memory bound is indexed only in part, and later ones not at all."""
        for document in documents:
            if self.library.full:
                break
            self.library.begin()
            self.library.extend(document)
        self._library_node = self.library.match(self._tokens)
        return self.library.tokens

    def clear_documents(self) -> None:
        self.library = SuffixIndex(self.depth, self.max_nodes)
        self._library_node = ROOT

    def reset(self) -> None:
        """Forget the conversation (the library stays)."""
        self._tokens: list[int] = []
        self.conversation = SuffixIndex(self.depth, self.max_nodes)
        self._library_node = ROOT

    def sync(self, tokens: Sequence[int]) -> None:
        if len(tokens) < len(self._tokens) or list(tokens[: len(self._tokens)]) != self._tokens:
            self.reset()  # a different conversation: start over
        new = tokens[len(self._tokens) :]
        if not new:
            return
        self._tokens.extend(new)
        self.conversation.extend(new)
        if self.library.tokens:
            self._library_node = self._follow(self.library, self._library_node, new)
        if self.conversation.full:
            self._rebuild()

    def _follow(self, index: SuffixIndex, node: int, new: Sequence[int]) -> int:
        """The match of the text after `new` tokens, from `node`, the match before them."""
        if len(new) > index.depth:  # only the last `depth` tokens can be matched
            return index.match(new)
        for token in new:
            node = index.follow(node, token)
        return node

    def _rebuild(self) -> None:
        """Past its memory bound, index the conversation's latest tokens only: half of what
        the bound holds at worst (every suffix new), so it is not rebuilt at once again."""
        keep = self._tokens[-max(1, self.max_nodes // (2 * self.depth)) :]
        self.conversation = SuffixIndex(self.depth, self.max_nodes)
        self.conversation.extend(keep)

    # -- proposing -----------------------------------------------------------------------------

    def match(self, tokens: Sequence[int], k: int) -> tuple[list[int], int]:
        return self.match_after(tokens, (), k)

    def match_after(self, tokens: Sequence[int], extra: Sequence[int], k: int) -> tuple[list[int], int]:
        """Up to k tokens to copy after `tokens` then `extra` (draft tokens, matched but never
        indexed, so a rejected draft leaves the index as it was), and the match's key."""
        self.sync(tokens)
        if k <= 0:
            return [], 0
        conversation = self._follow(self.conversation, self.conversation.tail(), extra)
        best = self._propose(self.conversation, conversation, k)
        if self.library.tokens:
            library = self._follow(self.library, self._library_node, extra)
            other = self._propose(self.library, library, k)
            if other.score > best.score:
                best = other
        return best.tokens, match_key(best.match)

    def _propose(self, index: SuffixIndex, node: int, k: int) -> Proposal:
        if node == ROOT:
            return NO_PROPOSAL
        return index.propose(node, k, self.min_match, self.min_prob, self.factor)

    # -- DraftStrategy ---------------------------------------------------------------------------

    def max_k(self, plan: DraftPlan) -> int:
        return plan.copy_limit  # a copy runs longer than a model's draft: it costs nothing to make


def library_of(drafter: object) -> SuffixDrafter | None:
    """The suffix drafter that keeps `drafter`'s library (itself, or its lookup), if any."""
    if isinstance(drafter, LookupThenModelDrafter):
        drafter = drafter.lookup_drafter
    return drafter if isinstance(drafter, SuffixDrafter) else None


def set_library(drafter: object, documents: Sequence[Sequence[int]]) -> int:
    """Replace the library of `drafter` (where it keeps one) with `documents`; returns the
    tokens it now holds (0: this drafter keeps no library)."""
    suffix = library_of(drafter)
    if suffix is None:
        return 0
    suffix.clear_documents()
    return suffix.add_documents(documents)
