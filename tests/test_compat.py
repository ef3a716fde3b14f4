"""Draft/target compatibility verdicts, on tiny tokenizers trained inside the tests."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from test_gguf_convert import write_tiny_llama_gguf
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from specdec_core.models.catalog import DEFAULT_DRAFT, DEFAULT_TARGET, SMALL_MODEL
from specdec_core.models.chat import stop_tokens
from specdec_core.models.compat import (
    VOCAB_MAX_SIZE_DIFFERENCE,
    Compatibility,
    check_draft_compatibility,
    check_folders,
    compare_vocabularies,
    gguf_drafts_near,
    rate_draft,
)

SENTENCES = [
    "def is_prime(n): return n > 1 and all(n % d for d in range(2, n))",
    "The quick brown fox jumps over the lazy dog.",
    "Speculative decoding drafts tokens and the target verifies them.",
]
def header_tokens(path: Path) -> list[str]:
    from specdec_core.models.gguf_file import read_arrays, read_gguf

    return read_arrays(read_gguf(path), ["tokenizer.ggml.tokens"])["tokenizer.ggml.tokens"]


SPECIALS = ["<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def train_tokenizer(
    sentences: list[str], vocab_size: int = 120, specials: list[str] = SPECIALS, eos: str = "<|im_end|>"
):
    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False)
    backend.train_from_iterator(sentences, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=eos, unk_token="<unk>")


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(SENTENCES)


def test_identical_tokenizers_are_compatible_with_a_reason_naming_the_size(tokenizer):
    verdict = check_draft_compatibility(tokenizer, tokenizer)
    assert verdict == Compatibility(True, f"compatible: same {len(tokenizer.get_vocab())}-token vocabulary")


def test_embedding_rows_differing_beyond_tolerance_are_refused_with_both_sizes(tokenizer):
    verdict = check_draft_compatibility(
        tokenizer, tokenizer, target_vocab_size=151936, draft_vocab_size=49152
    )
    assert verdict == Compatibility(False, "vocab 49152 vs 151936")


def test_embedding_padding_within_llama_cpp_tolerance_is_accepted(tokenizer):
    # Qwen2.5 0.5B pads its embedding to 151936 rows, 7B to 152064: 128 apart.
    verdict = check_draft_compatibility(
        tokenizer, tokenizer, target_vocab_size=152064, draft_vocab_size=152064 - VOCAB_MAX_SIZE_DIFFERENCE
    )
    assert verdict.compatible


def test_tokenizers_trained_on_different_text_are_refused_naming_the_first_differing_id(tokenizer):
    other = train_tokenizer(["completely different words here, zebra yak xylophone quartz"] * 3)
    verdict = check_draft_compatibility(tokenizer, other)
    assert not verdict.compatible
    assert verdict.reason.startswith("token ")
    assert "in the draft but" in verdict.reason and "in the target" in verdict.reason


def test_one_swapped_token_is_reported_with_both_spellings():
    target = {f"t{i}": i for i in range(40)}
    draft = dict(target)
    del draft["t17"]
    draft["foo"] = 17
    verdict = compare_vocabularies(target, draft)
    assert verdict == Compatibility(False, "token 17 is 'foo' in the draft but 't17' in the target")


def test_first_ids_may_differ_like_llama_cpp_allows():
    target = {f"t{i}": i for i in range(40)}
    draft = dict(target)
    del draft["t1"]
    draft["<s>"] = 1
    verdict = compare_vocabularies(target, draft)
    assert verdict.compatible
    assert "35 shared tokens" in verdict.reason


def test_draft_with_a_few_extra_tokens_is_compatible_when_shared_ids_agree():
    target = {f"t{i}": i for i in range(40)}
    draft = {**target, "extra1": 40, "extra2": 41}
    verdict = compare_vocabularies(target, draft)
    assert verdict.compatible
    assert "vocab 42 vs 40" in verdict.reason


def test_end_of_turn_token_with_another_id_is_refused_even_below_the_checked_range():
    target = {f"t{i}": i for i in range(40)} | {"<|im_end|>": 2}
    del target["t2"]
    draft = {f"t{i}": i for i in range(40)} | {"<|im_end|>": 3}
    del draft["t3"]
    verdict = compare_vocabularies(target, draft, target_stops=["<|im_end|>"], draft_stops=["<|im_end|>"])
    assert verdict == Compatibility(
        False, "stop token '<|im_end|>' is id 3 in the draft but id 2 in the target"
    )


def test_target_stop_token_missing_from_the_draft_is_refused(tokenizer):
    draft = train_tokenizer(
        SENTENCES, specials=["<unk>", "<|endoftext|>", "<|im_start|>", "<|eot|>"], eos="<|eot|>"
    )
    verdict = check_draft_compatibility(tokenizer, draft)
    assert not verdict.compatible
    assert "'<|im_end|>' is id 3 in the target but missing in the draft" in verdict.reason


def test_comparing_two_150k_token_vocabularies_takes_well_under_a_second():
    target = {f"tok{i}": i for i in range(151_665)}
    draft = dict(target)
    draft["tok150000"], draft["tok150001"] = 150001, 150000
    start = time.perf_counter()
    verdict = compare_vocabularies(target, draft)
    assert time.perf_counter() - start < 0.5
    assert (
        verdict.reason
        == "token 150000 is 'tok150001' in the draft but 'tok150000' in the target (1 more ids differ)"
    )


def write_folder(path: Path, tokenizer, vocab_size: int) -> Path:
    tokenizer.save_pretrained(path)
    (path / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": vocab_size}))
    return path


def test_check_folders_reads_tokenizers_and_config_sizes(tmp_path, tokenizer):
    target = write_folder(tmp_path / "target", tokenizer, 151936)
    same = write_folder(tmp_path / "same", tokenizer, 151936)
    small = write_folder(tmp_path / "small", tokenizer, 49152)
    assert check_folders(target, same).compatible
    assert check_folders(target, small) == Compatibility(False, "vocab 49152 vs 151936")


class VocabOnly:
    def __init__(self, vocab: dict[str, int], added: dict[str, int], eos: str):
        self.vocab, self.added, self.eos_token = vocab, added, eos

    def get_vocab(self) -> dict[str, int]:
        return self.vocab

    def get_added_vocab(self) -> dict[str, int]:
        return self.added


def test_only_added_tokens_count_as_end_of_turn_markers():
    # In Qwen's byte-level vocabulary "</s>" is an ordinary merge a model may write mid-answer.
    tokenizer = VocabOnly(
        {"</s>": 7, "<|endoftext|>": 8, "<|im_end|>": 9}, {"<|endoftext|>": 8, "<|im_end|>": 9}, "<|im_end|>"
    )
    assert stop_tokens(tokenizer) == ["<|im_end|>", "<|endoftext|>"]


# --- rate_draft: the one verdict of the CLI, the session and the app -------------------


@pytest.fixture
def empty_caches(tmp_path, monkeypatch):
    from huggingface_hub import constants as hub_constants

    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path / "specdec-cache"))
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path / "hf-hub"))


def test_rate_draft_reads_the_real_tokenizers_of_two_local_folders(tmp_path, tokenizer, empty_caches):
    target = write_folder(tmp_path / "target", tokenizer, 200)
    same = write_folder(tmp_path / "same", tokenizer, 200)
    other = write_folder(tmp_path / "other", train_tokenizer(["zebra yak xylophone quartz jumps"] * 3), 200)
    assert rate_draft(str(target), str(same)) == Compatibility(
        True, f"compatible: same {len(tokenizer.get_vocab())}-token vocabulary", "tokenizers"
    )
    refused = rate_draft(str(target), str(other))
    assert not refused.compatible and refused.basis == "tokenizers"
    assert refused.reason.startswith("token ") and "in the draft but" in refused.reason


def test_rate_draft_refuses_catalog_models_of_another_tokenizer_family_and_names_one_that_fits(empty_caches):
    verdict = rate_draft(DEFAULT_TARGET, "qwen3-0.6b")  # same size, ids nearly agree: still another family
    assert verdict == Compatibility(
        False,
        f"qwen3 tokenizer, the target uses qwen2.5: pick a qwen2.5 draft such as {DEFAULT_DRAFT}",
        "catalog",
    )
    assert rate_draft(DEFAULT_TARGET, SMALL_MODEL).reason.startswith("smollm2 tokenizer")


def test_a_catalog_model_named_by_its_folder_gets_the_verdict_of_its_name(tmp_path, tokenizer, empty_caches):
    from huggingface_hub import constants as hub_constants

    def cached(repo_id: str) -> str:  # a snapshot in the HF cache's layout
        snapshot = (
            Path(hub_constants.HF_HUB_CACHE) / f"models--{repo_id.replace('/', '--')}" / "snapshots" / "abc"
        )
        return str(write_folder(snapshot, tokenizer, 151936))

    qwen25, qwen3 = cached("Qwen/Qwen2.5-7B-Instruct"), cached("Qwen/Qwen3-0.6B")
    # Same tokenizer files on disk, but the catalog says these families never pair.
    assert rate_draft(qwen25, qwen3) == rate_draft("qwen2.5-7b-instruct", "qwen3-0.6b")
    assert not rate_draft(qwen25, qwen3).compatible


def test_rate_draft_accepts_a_same_family_catalog_draft_before_download_pending_the_real_check(empty_caches):
    verdict = rate_draft("qwen2.5-coder-7b-instruct", DEFAULT_DRAFT)  # 152064 vs 151936 rows: within 128
    assert verdict.compatible and verdict.basis == "catalog"
    assert "checked again once both are downloaded" in verdict.reason


def test_model_free_drafts_fit_every_target_and_absent_models_say_how_to_get_them(empty_caches, tmp_path):
    assert rate_draft("acme/absent", "ngram") == Compatibility(
        True, "model-free prompt lookup: works with every target", "builtin"
    )
    assert rate_draft(DEFAULT_TARGET, "none").compatible
    verdict = rate_draft(DEFAULT_TARGET, "acme/absent-draft")
    assert verdict == Compatibility(
        False,
        "acme/absent-draft is not on this machine: `specdec fetch acme/absent-draft`; "
        f"{DEFAULT_TARGET} is not downloaded yet: `specdec fetch {DEFAULT_TARGET}` to compare tokenizers",
        "catalog",
    )  # fmt: skip
    damaged = tmp_path / "m.gguf"
    damaged.write_bytes(b"GGUF")
    draft = write_folder(tmp_path / "draft", train_tokenizer(SENTENCES), 200)
    verdict = rate_draft(str(damaged), str(draft))
    assert not verdict.compatible and verdict.reason.startswith("cannot read a tokenizer: m.gguf is a damaged")
    assert "\n" not in verdict.reason


def test_two_gguf_files_are_judged_from_their_headers_without_a_conversion(tmp_path, empty_caches):
    target = write_tiny_llama_gguf(tmp_path / "big" / "target.Q8_0.gguf", hidden=128, ffn=256)
    draft = write_tiny_llama_gguf(tmp_path / "small" / "draft.Q8_0.gguf")
    verdict = rate_draft(str(target), str(draft))
    assert verdict == Compatibility(True, f"compatible: same {len(header_tokens(target))}-token vocabulary")
    converted = tmp_path / "specdec-cache" / "converted"
    assert not converted.exists() or not any(converted.iterdir())


def test_a_gguf_of_another_vocabulary_is_refused_from_its_header(tmp_path, empty_caches):
    target = write_tiny_llama_gguf(tmp_path / "target.gguf")
    other = write_tiny_llama_gguf(tmp_path / "other.gguf", corpus=["an entirely different corpus of words"] * 5)
    verdict = rate_draft(str(target), str(other))
    assert not verdict.compatible and verdict.basis == "tokenizers", verdict


def test_the_draft_menu_offers_the_smaller_ggufs_beside_a_gguf_target(tmp_path):
    models = tmp_path / "models"
    target = write_tiny_llama_gguf(models / "acme" / "big" / "big.Q8_0.gguf", hidden=128, ffn=256)
    same_folder = write_tiny_llama_gguf(models / "acme" / "big" / "big-draft.Q8_0.gguf")
    next_door = write_tiny_llama_gguf(models / "acme" / "small" / "small.Q8_0.gguf")
    write_tiny_llama_gguf(models / "acme" / "huge" / "huge.Q8_0.gguf", hidden=256, ffn=512)  # larger: no draft
    for name in ("mmproj-small.gguf", "small-00002-of-00002.gguf"):  # a vision projector, a later shard
        (models / "acme" / "small" / name).write_bytes(same_folder.read_bytes())
    assert sorted(gguf_drafts_near(str(target))) == sorted([str(same_folder), str(next_door)])
    assert gguf_drafts_near("qwen2.5-coder-1.5b-instruct") == []  # only a GGUF file has neighbours
