"""Text deltas are valid text even when a character is split across tokens."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from specdec_core.engine.detok import IncrementalDetokenizer


def deltas_for(tokenizer, text: str) -> tuple[list[int], list[str]]:
    ids = tokenizer(text)["input_ids"]
    detok = IncrementalDetokenizer(tokenizer)
    return ids, [detok.push(i) for i in ids]


def test_multibyte_characters_split_across_tokens_arrive_whole(tokenizer):
    text = "東京 🚀 café 😀🎉 ελληνικά"
    ids, deltas = deltas_for(tokenizer, text)
    assert len(ids) > len(text)  # byte-level: several tokens per character
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == text
    assert "" in deltas  # some tokens completed no character yet


@settings(max_examples=60, deadline=None)
@given(st.text(alphabet="ab 東京🚀é\nñ😀", min_size=1, max_size=30))
def test_deltas_concatenate_to_the_decoded_text(tokenizer, text):
    ids, deltas = deltas_for(tokenizer, text)
    assert "".join(deltas) == tokenizer.decode(ids)
    assert all("\ufffd" not in d for d in deltas)
