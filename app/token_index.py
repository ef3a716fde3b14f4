"""Which token each stretch of the transcript shows, for hovering and tooltips.

The transcript is written front to back and only ever cut at its end (the live
answer redraws its last blocks), so the stretches are kept in document order in
plain lists and found by bisection. Each stretch holds the `StoredToken` itself:
the live answer's tokens become the finished message's tokens as they are, so
finishing an answer re-indexes nothing.
"""

from __future__ import annotations

import bisect

from .conversations import StoredToken


class TokenIndex:
    def __init__(self) -> None:
        self._starts: list[int] = []
        self._ends: list[int] = []
        self._tokens: list[StoredToken] = []

    def __len__(self) -> int:
        return len(self._tokens)

    def add(self, start: int, end: int, token: StoredToken) -> None:
        """Characters [start, end) show `token`; stretches are added in document order."""
        if self._starts and start < self._ends[-1]:
            raise ValueError(f"stretch at {start} overlaps the last one (ends at {self._ends[-1]})")
        self._starts.append(start)
        self._ends.append(end)
        self._tokens.append(token)

    def cut(self, position: int) -> None:
        """Forget every stretch from `position` on (that part of the document was removed)."""
        keep = bisect.bisect_left(self._starts, position)
        del self._starts[keep:], self._ends[keep:], self._tokens[keep:]

    def clear(self) -> None:
        self.cut(0)

    def at(self, position: int) -> StoredToken | None:
        """The token shown at document `position`, or None (not a token: text, a gap, markup)."""
        i = bisect.bisect_right(self._starts, position) - 1
        if i >= 0 and position < self._ends[i]:
            return self._tokens[i]
        return None
