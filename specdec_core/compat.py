"""Can this draft model propose tokens for that target? A verdict with a human reason.

Speculative decoding hands the draft's token *ids* to the target, so the two models
must agree on what every id means. The rules follow llama.cpp's speculative example
(`common/speculative.cpp`), which is what people already rely on for GGUF pairs:

1. The vocabulary sizes (embedding rows, from the models' configs, and tokenizer
   sizes) may differ by at most `VOCAB_MAX_SIZE_DIFFERENCE` (llama.cpp's
   SPEC_VOCAB_MAX_SIZE_DIFFERENCE = 128). Families pad their embedding matrix
   differently per size: Qwen2.5 0.5B has 151936 rows, Qwen2.5 7B 152064.
2. Every id both tokenizers know, from `VOCAB_CHECK_START_TOKEN_ID` (llama.cpp's
   SPEC_VOCAB_CHECK_START_TOKEN_ID = 5) up, must be the same token in both. The
   first few ids are special tokens that sibling models sometimes define
   differently; rule 3 checks the ones that matter.
3. The stop tokens (EOS and the chat end-of-turn tokens such as `<|im_end|>`) of
   either model must have the same id in the other, whatever their id, so that the
   draft's "I am done" means the same to the target.

The engine must still only let the draft propose ids below the target's vocabulary
size; within the tolerance those extra ids are padding rows no trained model emits.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

VOCAB_MAX_SIZE_DIFFERENCE = 128
VOCAB_CHECK_START_TOKEN_ID = 5

# End-of-turn tokens of the chat templates people use; a model's stop tokens are its
# EOS plus whichever of these its vocabulary holds.
END_OF_TURN_TOKENS = (
    "<|im_end|>",  # ChatML: Qwen, SmolLM, many fine-tunes
    "<|endoftext|>",
    "<|eot_id|>",  # Llama 3
    "<|eom_id|>",
    "<end_of_turn>",  # Gemma
    "<|end|>",  # Phi-3
)


class TokenizerLike(Protocol):
    """What the checks need from a (Hugging Face) tokenizer."""

    eos_token: Any

    def get_vocab(self) -> dict[str, int]: ...


@dataclass(frozen=True)
class Compatibility:
    compatible: bool
    reason: str  # one line a user can read: "vocab 49152 vs 151936"


def check_draft_compatibility(
    target_tokenizer: TokenizerLike,
    draft_tokenizer: TokenizerLike,
    *,
    target_vocab_size: int | None = None,
    draft_vocab_size: int | None = None,
) -> Compatibility:
    """Decide whether `draft_tokenizer`'s ids mean the same tokens as `target_tokenizer`'s.

    `*_vocab_size` are the models' embedding rows (`config.vocab_size`), which may exceed
    the tokenizer's length; pass them when the models are known.
    """
    target_vocab = target_tokenizer.get_vocab()
    draft_vocab = draft_tokenizer.get_vocab()
    target_stops = stop_tokens(target_tokenizer, target_vocab)
    draft_stops = stop_tokens(draft_tokenizer, draft_vocab)
    return compare_vocabularies(
        target_vocab,
        draft_vocab,
        target_stops=target_stops,
        draft_stops=draft_stops,
        target_vocab_size=target_vocab_size,
        draft_vocab_size=draft_vocab_size,
    )


def compare_vocabularies(
    target_vocab: Mapping[str, int],
    draft_vocab: Mapping[str, int],
    *,
    target_stops: Iterable[str] = (),
    draft_stops: Iterable[str] = (),
    target_vocab_size: int | None = None,
    draft_vocab_size: int | None = None,
) -> Compatibility:
    """The rules of this module on plain token->id maps (what `get_vocab()` returns)."""
    target_tokens = _token_count(target_vocab)
    draft_tokens = _token_count(draft_vocab)

    size_verdict = _check_sizes(target_vocab_size, draft_vocab_size, target_tokens, draft_tokens)
    if size_verdict is not None:
        return size_verdict

    stop_verdict = _check_stop_tokens(target_vocab, draft_vocab, target_stops, draft_stops)
    if stop_verdict is not None:
        return stop_verdict

    if target_vocab == draft_vocab:  # the common case (siblings), decided in C at dict speed
        return Compatibility(True, f"compatible: same {len(target_vocab)}-token vocabulary")

    mismatch = _check_shared_ids(target_vocab, draft_vocab)
    if mismatch is not None:
        return mismatch
    shared = min(target_tokens, draft_tokens)
    return Compatibility(
        True,
        f"compatible: the {shared - VOCAB_CHECK_START_TOKEN_ID} shared tokens from id "
        f"{VOCAB_CHECK_START_TOKEN_ID} up agree (vocab {draft_tokens} vs {target_tokens})",
    )


def check_folders(target_dir: str | Path, draft_dir: str | Path) -> Compatibility:
    """`check_draft_compatibility` for two HF folders: reads their tokenizers and configs."""
    from transformers import AutoTokenizer  # heavy import, only when folders are compared

    target_tokenizer = AutoTokenizer.from_pretrained(str(target_dir))
    draft_tokenizer = AutoTokenizer.from_pretrained(str(draft_dir))
    return check_draft_compatibility(
        target_tokenizer,
        draft_tokenizer,
        target_vocab_size=config_vocab_size(target_dir),
        draft_vocab_size=config_vocab_size(draft_dir),
    )


def config_vocab_size(folder: str | Path) -> int | None:
    """The model's embedding rows from its config.json (text config for multimodal models)."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        return None
    config = json.loads(path.read_text(encoding="utf-8"))
    size = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
    return int(size) if size else None


def _token_count(vocab: Mapping[str, int]) -> int:
    # Ids can have holes; what matters for logits is the highest id + 1.
    return max(vocab.values(), default=-1) + 1


def _check_sizes(
    target_vocab_size: int | None, draft_vocab_size: int | None, target_tokens: int, draft_tokens: int
) -> Compatibility | None:
    pairs = [(draft_tokens, target_tokens)]
    if target_vocab_size is not None and draft_vocab_size is not None:
        pairs.insert(0, (draft_vocab_size, target_vocab_size))
    for draft_size, target_size in pairs:
        if abs(draft_size - target_size) > VOCAB_MAX_SIZE_DIFFERENCE:
            return Compatibility(False, f"vocab {draft_size} vs {target_size}")
    return None


def stop_tokens(tokenizer: TokenizerLike, vocab: Mapping[str, int] | None = None) -> list[str]:
    """The tokenizer's EOS and the end-of-turn tokens it defines as added (special) tokens.

    Only added tokens count: in Qwen's byte-level vocabulary "</s>" is an ordinary
    merge (id 128247) that a model may well write in the middle of an answer.
    """
    vocab = tokenizer.get_vocab() if vocab is None else vocab
    get_added = getattr(tokenizer, "get_added_vocab", None)
    special = get_added() if callable(get_added) else vocab
    stops = [token for token in END_OF_TURN_TOKENS if token in special]
    eos = getattr(tokenizer, "eos_token", None)
    if isinstance(eos, str) and eos in vocab and eos not in stops:
        stops.insert(0, eos)
    return stops


def _check_stop_tokens(
    target_vocab: Mapping[str, int],
    draft_vocab: Mapping[str, int],
    target_stops: Iterable[str],
    draft_stops: Iterable[str],
) -> Compatibility | None:
    for token in dict.fromkeys([*target_stops, *draft_stops]):  # ordered, without repeats
        target_id = target_vocab.get(token)
        draft_id = draft_vocab.get(token)
        if target_id == draft_id:
            continue
        if target_id is None:
            return Compatibility(
                False, f"stop token {token!r} is id {draft_id} in the draft but missing in the target"
            )
        if draft_id is None:
            return Compatibility(
                False, f"stop token {token!r} is id {target_id} in the target but missing in the draft"
            )
        return Compatibility(
            False, f"stop token {token!r} is id {draft_id} in the draft but id {target_id} in the target"
        )
    return None


def _check_shared_ids(
    target_vocab: Mapping[str, int], draft_vocab: Mapping[str, int]
) -> Compatibility | None:
    """First id (from VOCAB_CHECK_START_TOKEN_ID up, below both sizes) meaning different tokens."""
    limit = min(_token_count(target_vocab), _token_count(draft_vocab))
    target_by_id = {i: t for t, i in target_vocab.items() if VOCAB_CHECK_START_TOKEN_ID <= i < limit}
    draft_by_id = {i: t for t, i in draft_vocab.items() if VOCAB_CHECK_START_TOKEN_ID <= i < limit}
    if target_by_id == draft_by_id:
        return None
    differing = sorted(
        i for i in target_by_id.keys() | draft_by_id.keys() if target_by_id.get(i) != draft_by_id.get(i)
    )
    first = differing[0]
    more = f" ({len(differing) - 1} more ids differ)" if len(differing) > 1 else ""
    return Compatibility(
        False,
        f"token {first} is {_show(draft_by_id.get(first))} in the draft but {_show(target_by_id.get(first))} "
        f"in the target{more}",
    )


def _show(token: str | None) -> str:
    return "missing" if token is None else repr(token)
