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

`rate_draft(target_ref, draft_ref)` is the one verdict every front end shows (the
CLI's `models --compatible-with`, the session, the app's draft menu). It decides, in
this order, without loading weights or downloading anything:

a. "ngram"/"none" fit every target (no second vocabulary).
b. Two catalog models of different tokenizer families (`vocab` keys) never pair. The
   key is the catalog's record of which tokenizers agree; siblings that differ only
   by added tokens (Qwen3's `<think>` on Qwen2.5's ids) get different keys on
   purpose: those tokens are untrained padding rows in the other model, so a draft
   that uses them is always rejected and only costs time.
c. When both models are on disk, their real tokenizers decide (rules 1-3 above): an HF
   folder's tokenizer, or a GGUF's vocabulary read from its header (no conversion).
d. Otherwise the catalog decides: embedding rows beyond the tolerance refuse; the
   same family accepts, to be confirmed by (c) once both are downloaded.
e. A model that is neither in the catalog nor on disk cannot be judged: refused, with
   the command that fetches it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Protocol

from ..engine.drafters import NGRAM, NONE
from ..errors import SpecdecError
from .catalog import ModelEntry, load_catalog
from .chat import END_OF_TURN_TOKENS, stop_tokens
from .gguf_file import GGUFFile, read_arrays, read_gguf

VOCAB_MAX_SIZE_DIFFERENCE = 128
VOCAB_CHECK_START_TOKEN_ID = 5
_TOKENS, _TOKEN_TYPES = "tokenizer.ggml.tokens", "tokenizer.ggml.token_type"

class TokenizerLike(Protocol):
    """What the checks need from a (Hugging Face) tokenizer."""

    eos_token: Any

    def get_vocab(self) -> dict[str, int]: ...


# Draft specs that are not models: nothing to compare.
_MODEL_FREE_REASONS = {
    NGRAM: "model-free prompt lookup: works with every target",
    NONE: "no draft: the target alone",
}


@dataclass(frozen=True)
class Compatibility:
    compatible: bool
    reason: str  # one line a user can read: "vocab 49152 vs 151936"
    # What decided it: "tokenizers" (both read from disk), "catalog" (metadata only, checked
    # again once both are downloaded), or "builtin" (a model-free draft).
    basis: str = "tokenizers"


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

    target_tokenizer = AutoTokenizer.from_pretrained(str(target_dir), trust_remote_code=False)
    draft_tokenizer = AutoTokenizer.from_pretrained(str(draft_dir), trust_remote_code=False)
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


# --- the one verdict for a pair of model references -----------------------------------


@dataclass(frozen=True)
class _TokenizerFacts:
    vocab: dict[str, int]
    stops: tuple[str, ...]
    vocab_size: int | None  # embedding rows: config.json, or a GGUF's token_embd


def rate_draft(target_ref: str, draft_ref: str) -> Compatibility:
    """Whether `draft_ref` can draft for `target_ref`, with a reason a user can act on.

    See the module docstring (a-e) for the rule. Reads tokenizer files only; never downloads.
    """
    from .refs import local_folder  # refs -> gguf_convert -> compat: imported when used

    if draft_ref in _MODEL_FREE_REASONS:
        return Compatibility(True, _MODEL_FREE_REASONS[draft_ref], "builtin")
    target_folder, draft_folder = local_folder(target_ref), local_folder(draft_ref)
    target_gguf, draft_gguf = _gguf_at_hand(target_ref), _gguf_at_hand(draft_ref)
    # A catalog model named by its folder (what a loader passes) is still that catalog model.
    target_entry, draft_entry = (
        catalog_entry_of(target_ref, target_folder),
        catalog_entry_of(draft_ref, draft_folder),
    )
    if target_entry is not None and draft_entry is not None and target_entry.vocab != draft_entry.vocab:
        return Compatibility(
            False,
            f"{draft_entry.vocab} tokenizer, the target uses {target_entry.vocab}: "
            f"pick a {target_entry.vocab} draft{_suggestion(target_entry)}",
            "catalog",
        )
    target_at, draft_at = target_gguf or target_folder, draft_gguf or draft_folder
    if target_at is not None and draft_at is not None:
        return _rate_local(target_at, draft_at)
    target_rows = _rows(target_at, target_entry)
    draft_rows = _rows(draft_at, draft_entry)
    if target_rows and draft_rows and abs(target_rows - draft_rows) > VOCAB_MAX_SIZE_DIFFERENCE:
        return Compatibility(False, f"vocab {draft_rows} vs {target_rows}", "catalog")
    if target_entry is not None and draft_entry is not None:
        return Compatibility(
            True, f"same {draft_entry.vocab} tokenizer family (catalog; checked again once both are downloaded)",
            "catalog",
        )  # fmt: skip
    known = next((entry for entry in (draft_entry, target_entry) if entry is not None), None)
    if known is not None and target_rows and draft_rows:
        return Compatibility(
            True, f"vocab {draft_rows} vs {target_rows} (checked against {known.name}'s tokenizer once it is downloaded)",
            "catalog",
        )  # fmt: skip
    absent = [ref for ref, at in ((draft_ref, draft_at), (target_ref, target_at)) if at is None]
    why = "; ".join(f"{ref} {_why_absent(ref)}" for ref in absent)
    return Compatibility(False, f"{why} to compare tokenizers", "catalog")


def _why_absent(ref: str) -> str:
    """Why `ref`'s tokenizer is not at hand, and the command that brings it."""
    if Path(ref).expanduser().exists():
        return f"is not converted yet: `specdec fetch {ref}` converts it once"
    if load_catalog().get(ref) is not None:
        return f"is not downloaded yet: `specdec fetch {ref}`"
    return f"is not on this machine: `specdec fetch {ref}`"


def catalog_entry_of(ref: str, folder: Path | None) -> ModelEntry | None:
    """The catalog model `ref` names, or whose local copy `folder` is (a converted GGUF of
    a pinned sha256, or a hub snapshot in the HF cache)."""
    entry = load_catalog().get(ref)
    if entry is not None or folder is None:
        return entry
    try:
        converted_from = json.loads((folder / "specdec.json").read_text(encoding="utf-8")).get("sha256")
    except (OSError, ValueError, AttributeError):
        converted_from = None
    repos = [
        part[len("models--") :].replace("--", "/").lower()
        for part in folder.parts
        if part.startswith("models--")
    ]
    for entry in load_catalog().models:
        pinned = getattr(entry.source, "sha256", None)
        if (converted_from is not None and pinned == converted_from) or (
            getattr(entry.source, "repo_id", "").lower() in repos
        ):
            return entry
    return None


def _gguf_at_hand(ref: str) -> Path | None:
    """The GGUF file `ref` names, when it is on this machine (never downloaded here)."""
    from .refs import gguf_file_of

    return gguf_file_of(ref, fetch=False)


def _rate_local(target_at: Path, draft_at: Path) -> Compatibility:
    """Two models on this machine, each an HF folder or a GGUF file (whose header holds its
    vocabulary: no conversion is needed to judge it)."""
    try:
        target, draft = _facts(target_at), _facts(draft_at)
    except (OSError, ValueError, KeyError, TypeError, SpecdecError) as error:
        return Compatibility(False, f"cannot read a tokenizer: {str(error).strip().splitlines()[0]}")
    return compare_vocabularies(
        target.vocab, draft.vocab, target_stops=target.stops, draft_stops=draft.stops,
        target_vocab_size=target.vocab_size, draft_vocab_size=draft.vocab_size,
    )  # fmt: skip


def _facts(at: Path) -> _TokenizerFacts:
    files = [at] if at.is_file() else [at / name for name in ("tokenizer.json", "tokenizer_config.json", "config.json")]
    stamp = tuple(f.stat().st_mtime_ns if f.is_file() else 0 for f in files)
    return _facts_cached(str(at.resolve()), stamp)


@lru_cache(maxsize=32)
def _facts_cached(folder: str, _stamp: tuple[int, ...]) -> _TokenizerFacts:
    # Rating a menu of drafts reads each tokenizer once per process (150k-token vocabularies
    # take about a second); a changed file changes `_stamp` and is read again.
    if Path(folder).is_file():
        return _gguf_facts(Path(folder))
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=False)
    vocab = tokenizer.get_vocab()
    return _TokenizerFacts(vocab, tuple(stop_tokens(tokenizer, vocab)), config_vocab_size(folder))


# llama.cpp's token types (llama_token_type): the ones a tokenizer adds beside its merges.
_CONTROL, _USER_DEFINED = 3, 4


def _gguf_facts(path: Path) -> _TokenizerFacts:
    """A GGUF's vocabulary, stop tokens and embedding rows, from its header alone."""
    file = read_gguf(path)
    arrays = read_arrays(file, (_TOKENS, _TOKEN_TYPES))
    tokens = arrays.get(_TOKENS)
    if not tokens:
        raise ValueError(f"{path.name} holds no vocabulary ({_TOKENS})")
    vocab = {token: index for index, token in reversed(list(enumerate(tokens)))}
    types = arrays.get(_TOKEN_TYPES) or []
    added = {tokens[i] for i, kind in enumerate(types) if kind in (_CONTROL, _USER_DEFINED)}
    stops = [token for token in END_OF_TURN_TOKENS if token in added]
    eos = file.fields.get("tokenizer.ggml.eos_token_id")
    if isinstance(eos, int) and 0 <= eos < len(tokens) and tokens[eos] not in stops:
        stops.insert(0, tokens[eos])
    return _TokenizerFacts(vocab, tuple(stops), _gguf_rows(file))


def _gguf_rows(file: GGUFFile) -> int | None:
    embedding = file.tensors.get("token_embd.weight")
    return int(embedding.dims[-1]) if embedding is not None and embedding.dims else None


def _rows(at: Path | None, entry: ModelEntry | None) -> int | None:
    if at is not None and at.is_file():
        return _gguf_rows(read_gguf(at))
    if at is not None:
        return config_vocab_size(at)
    return entry.vocab_size if entry is not None else None


def _suggestion(target: ModelEntry) -> str:
    same_family = [
        e.name
        for e in load_catalog().models
        if e.vocab == target.vocab and "draft" in e.roles and e != target
    ]
    drafts = [*target.recommended_drafts, *same_family]
    return f" such as {drafts[0]}" if drafts else ""


# Bounds on the scan for a GGUF target's neighbours: it runs on a front end's thread.
_NEARBY_FOLDERS, _NEARBY_FILES = 64, 12
_SHARD = re.compile(r"-(\d{5})-of-\d{5}\.gguf$", re.IGNORECASE)


def gguf_drafts_near(target_ref: str) -> list[str]:
    """The GGUF files beside a GGUF target that are smaller than it: in its folder and the
    folders next to it (LM Studio keeps models/<publisher>/<repo>/<file>.gguf). A draft
    menu offers them beside the catalog's drafts and `rate_draft` decides from their headers;
    choosing one converts nothing. Vision projectors and later shards of split files are left out."""
    target = Path(target_ref).expanduser()
    if target.suffix.lower() != ".gguf" or not target.is_file():
        return []
    size = target.stat().st_size
    found: list[tuple[int, str]] = []
    for folder in _neighbour_folders(target.parent):
        for path in _ggufs_in(folder):
            try:
                other = path.stat().st_size
            except OSError:
                continue
            if other < size and path.resolve() != target.resolve():
                found.append((other, str(path)))
    return [path for _, path in sorted(set(found))[:_NEARBY_FILES]]


def _neighbour_folders(folder: Path) -> list[Path]:
    try:
        return [folder, *sorted(p for p in folder.parent.iterdir() if p.is_dir() and p != folder)[:_NEARBY_FOLDERS]]
    except OSError:
        return [folder]


def _ggufs_in(folder: Path) -> list[Path]:
    try:
        paths = [p for p in folder.iterdir() if p.suffix.lower() == ".gguf" and p.is_file()]
    except OSError:
        return []
    return [p for p in paths if "mmproj" not in p.name.lower() and _first_shard(p.name)]


def _first_shard(name: str) -> bool:
    match = _SHARD.search(name)
    return match is None or int(match.group(1)) == 1
