"""The GGUF conversion cache: keys, atomicity, listing, and one real tiny conversion."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from specdec_core.disk_cache import kernels_dir
from specdec_core.errors import Cancelled, ModelLoadError
from specdec_core.models import conversion_process, gguf_convert
from specdec_core.models.gguf_convert import (
    cache_dir,
    convert_gguf,
    converted_dir,
    file_sha256,
    remembered_sha256,
)
from specdec_core.models.refs import resolve_model_ref
from specdec_core.tools.cache_admin import clear_cache, list_cache


@pytest.fixture(autouse=True)
def isolated_cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


class CountingConverter:
    """Stands in for transformers: writes a config.json and counts its calls."""

    def __init__(self):
        self.calls: list[Path] = []

    def __call__(self, gguf_path: Path, out_dir: Path) -> None:
        self.calls.append(gguf_path)
        (out_dir / "config.json").write_text(json.dumps({"from": gguf_path.name}))


def write(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def test_cache_dir_follows_the_environment_variable(isolated_cache):
    assert cache_dir() == isolated_cache


def test_the_same_file_in_two_places_converts_once(tmp_path):
    converter = CountingConverter()
    first = convert_gguf(write(tmp_path / "a" / "m.gguf", b"GGUF same bytes"), converter=converter)
    second = convert_gguf(write(tmp_path / "b" / "copy.gguf", b"GGUF same bytes"), converter=converter)
    assert first == second
    assert len(converter.calls) == 1
    assert json.loads((first / "config.json").read_text()) == {"from": "m.gguf"}


def test_a_changed_file_converts_again_into_its_own_folder(tmp_path):
    converter = CountingConverter()
    path = write(tmp_path / "m.gguf", b"GGUF version 1")
    first = convert_gguf(path, converter=converter)
    write(path, b"GGUF version 2, longer")
    second = convert_gguf(path, converter=converter)
    assert first != second and len(converter.calls) == 2


def test_the_hash_is_remembered_until_size_or_mtime_change(tmp_path):
    path = write(tmp_path / "m.gguf", b"GGUF bytes")
    digest = file_sha256(path)
    assert remembered_sha256(path) == digest
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    assert remembered_sha256(path) is None


def test_a_failed_conversion_leaves_nothing_a_later_run_would_trust(tmp_path):
    def broken(gguf_path: Path, out_dir: Path) -> None:
        (out_dir / "config.json").write_text("{}")
        raise ModelLoadError("cannot convert m.gguf: unsupported architecture 'mamba9'")

    with pytest.raises(ModelLoadError, match="mamba9"):
        convert_gguf(write(tmp_path / "m.gguf", b"GGUF"), converter=broken)
    assert list(converted_dir().iterdir()) == []


def test_a_cancel_during_conversion_discards_the_result(tmp_path):
    cancel = threading.Event()

    def converter(gguf_path: Path, out_dir: Path) -> None:
        (out_dir / "config.json").write_text("{}")
        cancel.set()  # the user pressed cancel while transformers was busy

    with pytest.raises(Cancelled):
        convert_gguf(write(tmp_path / "m.gguf", b"GGUF"), converter=converter, cancel=cancel)
    assert list(converted_dir().iterdir()) == []


def test_a_folder_without_the_completion_marker_is_converted_again(tmp_path):
    path = write(tmp_path / "m.gguf", b"GGUF")
    stale = gguf_convert.converted_path(file_sha256(path))
    stale.mkdir(parents=True)
    (stale / "config.json").write_text("half written")
    converter = CountingConverter()
    assert convert_gguf(path, converter=converter) == stale
    assert len(converter.calls) == 1 and (stale / gguf_convert.MARKER).is_file()


def test_list_cache_shows_fetched_partial_and_converted_items_and_clear_removes_by_kind(tmp_path):
    fetched = write(gguf_convert.fetched_gguf_dir() / "some-model" / "m.gguf", b"GGUF fetched")
    write(gguf_convert.downloads_dir() / "other-model" / "part01.bin", b"chunk")
    folder = convert_gguf(fetched, converter=CountingConverter())
    kernel = write(kernels_dir() / "native-0123456789abcdef.so", b"ELF")
    kinds = {(item.kind, item.path) for item in list_cache()}
    assert kinds == {
        ("gguf", fetched),
        ("partial", gguf_convert.downloads_dir() / "other-model"),
        ("converted", folder),
        ("kernel", kernel),
    }
    removed = clear_cache({"partial"})
    assert [item.kind for item in removed] == ["partial"]
    assert {item.kind for item in list_cache()} == {"gguf", "converted", "kernel"}
    clear_cache()
    assert list_cache() == []


# --- one real conversion, of a tiny Llama GGUF written here with the gguf package -----

HIDDEN, LAYERS, FFN, HEADS, KV_HEADS = 32, 2, 64, 4, 2
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write_tiny_llama_gguf(
    path: Path, context_length: int = 128, never_ends: bool = False, arch: str = "llama",
    qtype: str = "Q8_0", hidden: int = HIDDEN, ffn: int = FFN, add_bos: bool = False,
    corpus: list[str] | None = None,
) -> Path:  # fmt: skip
    """A 2-layer Llama with a byte-level BPE vocabulary, weights quantized to Q8_0.

    `arch="qwen2"`: the same shapes as a Qwen2, whose q/k/v projections carry biases.
    `qtype`: the block type of the projections ("Q4_K" etc. need `hidden` and `ffn` in
    multiples of 256); types the gguf package cannot quantize get random valid blocks.

    `add_bos`: the header says the vocabulary puts a BOS (id 0) before a text, as a Llama's does.

    `never_ends`: the special tokens' (tied) embedding rows are zero, so their logit is 0
    and a greedy answer never picks one: it runs to its token limit (the served tests)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(LAYERS)
    writer.add_context_length(context_length)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(hidden // HEADS)
    tokens = add_tiny_tokenizer(writer, add_bos=add_bos, corpus=corpus)

    rng = np.random.default_rng(0)

    kind = gguf.GGMLQuantizationType[qtype]

    def add_q8(name: str, shape: tuple[int, int]) -> None:
        values = rng.normal(0, 0.3, shape).astype(np.float32)
        try:
            data = gguf.quants.quantize(values, kind)
        except NotImplementedError:  # the K-quants: valid blocks of random bits, small fp16 scales
            data = random_blocks(kind, shape, rng)
        writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=kind)

    kv = hidden * KV_HEADS // HEADS
    embedding = rng.normal(0, 0.3, (len(tokens), hidden)).astype(np.float32)
    if never_ends:
        embedding[[i for i, t in enumerate(tokens) if t.startswith("<|")]] = 0.0
    embedding_q8 = gguf.quants.quantize(embedding, gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor(
        "token_embd.weight", embedding_q8, raw_shape=embedding_q8.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0
    )
    writer.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    for block in range(LAYERS):
        writer.add_tensor(f"blk.{block}.attn_norm.weight", rng.uniform(0.5, 1.5, hidden).astype(np.float32))
        writer.add_tensor(f"blk.{block}.ffn_norm.weight", rng.uniform(0.5, 1.5, hidden).astype(np.float32))
        for name, shape in [("attn_q", (hidden, hidden)), ("attn_k", (kv, hidden)), ("attn_v", (kv, hidden)),
                            ("attn_output", (hidden, hidden)), ("ffn_gate", (ffn, hidden)),
                            ("ffn_up", (ffn, hidden)), ("ffn_down", (hidden, ffn))]:  # fmt: skip
            add_q8(f"blk.{block}.{name}.weight", shape)
            if arch == "qwen2" and name in ("attn_q", "attn_k", "attn_v"):
                writer.add_tensor(f"blk.{block}.{name}.bias", rng.normal(0, 0.1, shape[0]).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def add_tiny_tokenizer(
    writer: gguf.GGUFWriter, *, add_bos: bool = False, corpus: list[str] | None = None
) -> list[str]:
    """A byte-level BPE vocabulary of ~300 tokens trained on a few phrases (`corpus`), its special
    tokens and chat template in the header; returns the tokens (the vocabulary's size is its length)."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )  # fmt: skip
    backend.train_from_iterator(
        corpus or ["def is_prime(n): return n > 1", "hello world, speculative decoding"] * 5, trainer
    )
    model = json.loads(backend.to_str())["model"]
    tokens = sorted(model["vocab"], key=model["vocab"].get)
    merges = [" ".join(m) if isinstance(m, list) else m for m in model["merges"]]
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t.startswith("<|") else 1 for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(add_bos)
    writer.add_chat_template(CHAT_TEMPLATE)
    return tokens


def random_blocks(kind: gguf.GGMLQuantizationType, shape: tuple[int, int], rng: np.random.Generator) -> np.ndarray:
    """Random bits in `kind`'s blocks, each block's fp16 scales set small and finite."""
    block, size = gguf.GGML_QUANT_SIZES[kind]
    data = rng.integers(0, 256, (shape[0], shape[1] // block, size), dtype=np.uint8)
    scale = np.frombuffer(np.float16(2e-3).tobytes(), np.uint8)
    if kind == gguf.GGMLQuantizationType.Q6_K:
        data[..., size - 2 :] = scale  # d comes last
    else:  # Q4_K, Q5_K: d, then dmin
        data[..., 0:2] = scale
        data[..., 2:4] = scale
    return data.reshape(shape[0], -1)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    return write_tiny_llama_gguf(tmp_path_factory.mktemp("gguf") / "tiny-llama.Q8_0.gguf")


def test_a_real_gguf_converts_to_a_plain_folder_with_identical_weights_and_greedy_output(
    tiny_gguf, monkeypatch
):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = resolve_model_ref(str(tiny_gguf))
    assert folder.parent == converted_dir()
    config = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "float32"
    generation = json.loads((folder / "generation_config.json").read_text())
    assert set(generation) - {"transformers_version"} == {"bos_token_id", "eos_token_id", "pad_token_id"}
    assert generation["eos_token_id"] == [2, 0]  # the file's EOS <|im_end|>, then <|endoftext|>

    from_gguf = AutoModelForCausalLM.from_pretrained(
        str(tiny_gguf.parent), gguf_file=tiny_gguf.name, dtype=torch.float32
    )
    converted = AutoModelForCausalLM.from_pretrained(folder)
    gguf_weights, folder_weights = from_gguf.state_dict(), converted.state_dict()
    assert gguf_weights.keys() == folder_weights.keys()
    assert all(torch.equal(gguf_weights[name], folder_weights[name]) for name in gguf_weights)

    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert tokenizer.chat_template == CHAT_TEMPLATE
    assert (
        tokenizer.get_vocab()
        == AutoTokenizer.from_pretrained(str(tiny_gguf.parent), gguf_file=tiny_gguf.name).get_vocab()
    )
    prompt = tokenizer("def is_prime", return_tensors="pt").input_ids
    expected = from_gguf.generate(
        prompt, max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    actual = converted.generate(prompt, max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert torch.equal(expected, actual)

    # The second time the reference resolves from the cache (its files pass the fast check).
    def must_not_convert(*args, **kwargs):
        raise AssertionError("converted twice")

    monkeypatch.setattr(conversion_process, "convert_in_child", must_not_convert)
    assert resolve_model_ref(str(tiny_gguf)) == folder


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_the_metadata_folder_holds_what_transformers_reads_from_the_whole_file(tmp_path, arch):
    from transformers import AutoConfig, AutoTokenizer

    from specdec_core.models.gguf_to_hf import write_metadata

    path = write_tiny_llama_gguf(tmp_path / f"tiny-{arch}.gguf", arch=arch)
    theirs = tmp_path / "theirs"  # transformers' own reading of the file, saved
    AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name).save_pretrained(theirs)
    AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name).save_pretrained(theirs)
    ours = tmp_path / "ours"
    write_metadata(path, ours)

    def config(folder: Path) -> dict:
        values = json.loads((folder / "config.json").read_text())
        return {k: v for k, v in values.items() if k not in ("quantization_config", "transformers_version")}

    assert config(ours) == config(theirs) and config(ours)["model_type"] == arch
    mine, reference = AutoTokenizer.from_pretrained(ours), AutoTokenizer.from_pretrained(theirs)
    text = "def is_prime(n): return n > 1 <|im_start|>hello  world<|im_end|>\n\n x"
    assert type(mine) is type(reference)
    assert mine(text)["input_ids"] == reference(text)["input_ids"]
    assert mine.chat_template == reference.chat_template
    assert (mine.bos_token, mine.eos_token, mine.pad_token) == (
        reference.bos_token, reference.eos_token, reference.pad_token,
    )  # fmt: skip
