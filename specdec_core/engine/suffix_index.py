"""A suffix index over token sequences: what followed each recent context, and how often.

After SuffixDecoding (Oliaro et al., arXiv 2411.04975): a suffix trie cut at `depth`
tokens holds every substring of the indexed sequences up to that length, each node
counting its occurrences. Appending a token extends the paths of the last `depth`
suffixes by one node each (O(depth), no rebuild), so the index follows the tokens as
they commit. A node also keeps the child seen most often (the latest on a tie) and its
suffix link (the node of its string without the first token), so

- the longest suffix of a context that occurred before is found by following links
  (Aho-Corasick), token by token, and
- a draft walks from that node along the most frequent children; at the cut it drops
  the oldest context token through the link and goes on, so a draft may run longer
  than the trie is deep.

A draft token's probability is its child's count over the occurrences that continued
(SuffixDecoding's estimate); the draft stops when the product over the draft falls
under `min_prob`, or when it is `factor` times longer than the match (a short match
predicts a short way). Memory is bounded by `max_nodes`: past it nothing new is
indexed (`full`), and the owner rebuilds over fewer tokens.

Nodes live in flat arrays and the edges in one dict keyed by `parent << 32 | token`:
one small dict per node would cost several times the memory.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

ROOT = 0
_SHIFT = 32  # token ids are below 2**32
DEPTH = 16  # the longest context the trie tells apart; drafts go on past it through links
MAX_NODES = 400_000  # bounds memory: a node is six array entries and one dict entry


@dataclass(frozen=True)
class Proposal:
    tokens: list[int]
    match: int  # how many context tokens the draft's first token was predicted from
    score: float  # the expected tokens accepted, by the index's own probabilities


NO_PROPOSAL = Proposal([], 0, 0.0)


class SuffixIndex:
    """A suffix trie of bounded depth over sequences that grow token by token."""

    def __init__(self, depth: int = DEPTH, max_nodes: int = MAX_NODES) -> None:
        if depth < 1:
            raise ValueError("depth must be at least 1")
        self.depth = depth
        self.max_nodes = max_nodes
        self._edges: dict[int, int] = {}
        self._token = array("q", [-1])  # the token that leads to the node
        self._depth = array("q", [0])
        self._link = array("q", [ROOT])
        self._count = array("q", [0])  # occurrences of the node's string
        self._continued = array("q", [0])  # occurrences followed by a token (its children's counts)
        self._best = array("q", [-1])  # the child seen most often, the latest on a tie; -1: none
        self._tails = [ROOT]  # the nodes of the last 0..depth tokens of the sequence being indexed
        self.tokens = 0  # tokens indexed
        self.full = False  # a node was refused: the index no longer holds every suffix

    @property
    def nodes(self) -> int:
        return len(self._depth)

    def begin(self) -> None:
        """Start a new sequence: no match runs across the boundary."""
        self._tails = [ROOT]

    def extend(self, tokens: Iterable[int]) -> None:
        for token in tokens:
            self.append(token)

    def append(self, token: int) -> None:
        """Index one more token of the current sequence: every suffix ending at it."""
        tails, edges, count, continued, best = (
            self._tails, self._edges, self._count, self._continued, self._best,
        )  # fmt: skip
        room = self.max_nodes - len(count)
        new = [ROOT]
        link = ROOT
        for parent in tails[: self.depth]:
            key = parent << _SHIFT | token
            child = edges.get(key)
            if child is None:
                if room <= 0:
                    self.full = True
                    break  # the deeper suffixes hang below this one: none of them fits either
                room -= 1
                child = edges[key] = len(count)
                self._token.append(token)
                self._depth.append(len(new))
                self._link.append(link)
                count.append(0)
                continued.append(0)
                best.append(-1)
            count[child] += 1
            continued[parent] += 1
            top = best[parent]
            if top < 0 or count[child] >= count[top]:
                best[parent] = child
            new.append(child)
            link = child
        self._tails = new
        self.tokens += 1

    # -- matching ----------------------------------------------------------------------------

    def tail(self) -> int:
        """The node of the longest suffix of the indexed text (at most `depth` tokens)."""
        return self._tails[-1]

    def follow(self, node: int, token: int) -> int:
        """The node of the longest suffix of (`node`'s string + `token`) the index holds."""
        while True:
            if self._depth[node] < self.depth:
                child = self._edges.get(node << _SHIFT | token)
                if child is not None:
                    return child
            if node == ROOT:
                return ROOT
            node = self._link[node]

    def match(self, context: Sequence[int]) -> int:
        """The node of the longest suffix of `context` the index holds."""
        node = ROOT
        for token in context[-self.depth :]:
            node = self.follow(node, token)
        return node

    def depth_of(self, node: int) -> int:
        return self._depth[node]

    def count(self, node: int) -> int:
        return self._count[node]

    # -- proposing -----------------------------------------------------------------------------

    def propose(
        self, node: int, limit: int, min_match: int = 1, min_prob: float = 0.1, factor: float = 1.0
    ) -> Proposal:
        """The most frequent continuation of `node`'s string, or of its longest suffix that
        was ever continued and is at least `min_match` tokens long."""
        best, link = self._best, self._link
        while node != ROOT and best[node] < 0:
            node = link[node]
        match = self._depth[node]
        if match < min_match or match == 0:
            return NO_PROPOSAL
        limit = min(limit, max(1, int(factor * match)))
        return self._walk(node, match, limit, min_prob)

    def _walk(self, node: int, match: int, limit: int, min_prob: float) -> Proposal:
        depth, link, best, count, continued, token = (
            self._depth, self._link, self._best, self._count, self._continued, self._token,
        )  # fmt: skip
        out: list[int] = []
        prob, score = 1.0, 0.0
        while len(out) < limit:
            if depth[node] >= self.depth:
                node = link[node]  # the cut: predict from one context token fewer
            child = best[node]
            if child < 0:
                break
            prob *= count[child] / continued[node]
            if prob < min_prob:
                break
            out.append(token[child])
            score += prob
            node = child
        return Proposal(out, match, score)
