"""Incremental detokenization: the text each new token adds.

Byte-level BPE splits a multi-byte character over several tokens; decoding a
prefix then ends in U+FFFD. Like vLLM/TGI we decode a short window of recent
tokens and hold the delta back while it ends in an incomplete character, so
every delta is valid text and the deltas concatenate to `decode(all tokens)`.
"""

from __future__ import annotations

from typing import Any

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._ids: list[int] = []
        self._prefix_offset = 0  # window start: context so spaces/merges decode right
        self._read_offset = 0  # tokens already turned into emitted text

    def push(self, token_id: int) -> str:
        """Add a token; return the newly completed text (possibly "")."""
        self._ids.append(token_id)
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset :])
        if full_text.endswith(REPLACEMENT) or len(full_text) <= len(prefix_text):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return full_text[len(prefix_text) :]

    def flush(self) -> str:
        """Text held back at the end (an incomplete character stays as U+FFFD)."""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset :])
        self._prefix_offset = self._read_offset = len(self._ids)
        return full_text[len(prefix_text) :] if len(full_text) > len(prefix_text) else ""

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
