"""The conversion cache: a GGUF file becomes a plain HF folder once, then loads fast.

Loading a GGUF through transformers de-quantizes every tensor in Python and rebuilds
the tokenizer from the file's metadata, which takes minutes for a model of a few GB. The
result never changes for a given file, so the first load writes it out as a normal
folder (config.json, model.safetensors, tokenizer files, a minimal
generation_config.json) and every later load reads that folder in seconds. The cache's
layout and its hash records are in `disk_cache.py`.

Keying by content, not by path, means the same file found in two places (LM Studio's
folder and a download) converts once, and a changed file converts again. A folder
appears under `converted/` only by an atomic rename of a complete temporary folder,
with `specdec.json` written last, so a crash mid-conversion leaves nothing trusted.

What a converted folder promises, and how it is checked:
- the GGUF was hashed in full just before converting; `source_verified` is true only
  when that hash matched the one expected (a catalog model's pinned sha256);
- `specdec.json` holds every file's size, mtime and sha256, hashed after writing. Each
  use compares sizes and mtimes (a stat per file); a file that changed is re-hashed,
  and a folder with a damaged file is deleted and converted again, with a message.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import sys
import threading
from collections.abc import Callable
from pathlib import Path

from ..disk_cache import (  # re-exported: the cache's places are known by this module's name too
    CACHE_ENV,
    FileRecord,
    cache_dir,
    conversion_lock,
    converted_dir,
    damaged_files,
    disk_full_error,
    downloads_dir,
    fetched_gguf_dir,
    file_sha256,
    hash_file,
    hash_folder,
    is_disk_full,
    notice,
    remember_sha256,
    remembered_sha256,
    require_space,
    sweep_stale_temporaries,
)
from ..errors import FetchError, ModelLoadError
from ..progress import Progress, ProgressCallback, check_cancelled
from .fetch import exclusive
from .gguf_file import read_gguf
from .gguf_to_hf import convert_with_transformers, write_metadata

__all__ = ["CACHE_ENV", "cache_dir", "downloads_dir", "fetched_gguf_dir", "file_sha256", "remembered_sha256"]

MARKER = "specdec.json"  # written last into a converted folder: its presence means "complete"
# Bumped whenever what a conversion writes changes, so that older folders are redone.
# 2: the marker records every file's hash (folders of format 1 were never verified).
CONVERSION_FORMAT = 2

# Writes an HF folder for the GGUF at the first path into the (empty) second path.
Converter = Callable[[Path, Path], None]


class SourceMismatch(FetchError):
    """A GGUF file's sha256 is not the one its catalog entry pins."""


def converted_path(sha256: str) -> Path:
    # 64 bits of the hash are plenty to tell a user's GGUF files apart; the full hash is
    # in the folder's specdec.json.
    return converted_dir() / sha256[:16]


def read_marker(folder: Path) -> dict | None:
    """The completion marker of a folder written by this version's conversion, else None."""
    try:
        marker = json.loads((folder / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    ok = (
        isinstance(marker, dict)
        and marker.get("format") == CONVERSION_FORMAT
        and isinstance(marker.get("files"), dict)
    )
    return marker if ok else None


def is_converted(folder: Path) -> bool:
    """A complete folder written by this version's conversion (no file is read but the marker)."""
    return read_marker(folder) is not None


def usable_conversion(
    folder: Path, *, label: str, full: bool = False,
    progress: ProgressCallback | None = None, cancel: threading.Event | None = None,
) -> Path | None:  # fmt: skip
    """`folder` if it is a complete conversion whose files are intact, else None.

    A damaged folder is deleted (with a message) so that the caller converts again.
    """
    marker = read_marker(folder)
    if marker is None:
        return None
    records = {name: FileRecord.from_dict(data) for name, data in marker["files"].items()}
    damaged = damaged_files(
        folder, records, label=f"the converted {label}", full=full, progress=progress, cancel=cancel
    )
    if not damaged:
        return folder
    shutil.rmtree(folder, ignore_errors=True)
    notice(progress, f"{label}: the converted copy failed its sha256 check ({', '.join(damaged)}); "
                     "deleted it, converting again")  # fmt: skip
    return None


# --- conversion ---------------------------------------------------------------------


def find_converted(
    gguf_path: Path, sha256: str | None = None, *, label: str | None = None,
    progress: ProgressCallback | None = None, cancel: threading.Event | None = None,
) -> Path | None:  # fmt: skip
    """The intact converted folder of `gguf_path` if there is one, without hashing the file."""
    sha256 = sha256 or (remembered_sha256(gguf_path) if gguf_path.is_file() else None)
    if sha256 is None:
        return None
    label = label or gguf_path.name
    return usable_conversion(converted_path(sha256), label=label, progress=progress, cancel=cancel)


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

    `sha256` is the hash the file must have (a catalog model's): it is checked by a full
    re-hash before converting, and a mismatch raises `SourceMismatch`. `converter` runs
    in this process (tests); by default the conversion runs in a child process.
    """
    if not gguf_path.is_file():
        raise ModelLoadError(f"GGUF file not found: {gguf_path}")
    label = label or gguf_path.name
    sweep_stale_temporaries()
    ready = find_converted(gguf_path, sha256, label=label, progress=progress, cancel=cancel)
    if ready is not None:
        return ready
    # About to convert: the source must be what it claims, byte for byte, and well formed.
    actual = hash_file(gguf_path, label=label, progress=progress, cancel=cancel)
    remember_sha256(gguf_path, actual)
    if sha256 is not None and actual != sha256:
        raise SourceMismatch(f"{label}: {gguf_path.name} has sha256 {actual[:12]}…, expected {sha256[:12]}…")
    final = converted_path(actual)
    if usable_conversion(final, label=label, progress=progress, cancel=cancel) is not None:
        return final  # the same bytes were converted before under another name
    if converter is None:  # what transformers' reader needs (stand-in converters read nothing)
        needed = check_gguf_file(gguf_path)
        require_space(converted_dir(), needed, f"nothing of {gguf_path.name} was converted")
    converted_dir().mkdir(parents=True, exist_ok=True)
    with exclusive(conversion_lock(actual), f"another specdec is converting {label}", progress, cancel):
        if usable_conversion(final, label=label, progress=progress, cancel=cancel) is None:
            _convert_into(final, gguf_path, actual, sha256 is not None, label, progress, cancel, converter)
    return final


def metadata_path(sha256: str) -> Path:
    return converted_dir() / f"{sha256[:16]}-meta"


def metadata_folder(
    gguf_path: Path, *, label: str | None = None,
    progress: ProgressCallback | None = None, cancel: threading.Event | None = None,
) -> Path:  # fmt: skip
    """A folder with `gguf_path`'s config and tokenizer, for running its blocks as stored.

    The full conversion's folder when there is one; otherwise one written without the
    weights (`gguf_to_hf.write_metadata`: a few MB), kept in the cache like a conversion.
    """
    label = label or gguf_path.name
    read_gguf(gguf_path)  # a cut or damaged file is one line here, before anything is written
    sweep_stale_temporaries()
    sha256 = remembered_sha256(gguf_path)
    if sha256 is None:
        sha256 = hash_file(gguf_path, label=label, progress=progress, cancel=cancel)
        remember_sha256(gguf_path, sha256)
    for folder in (converted_path(sha256), metadata_path(sha256)):
        if usable_conversion(folder, label=label, progress=progress, cancel=cancel) is not None:
            return folder
    final = metadata_path(sha256)
    converted_dir().mkdir(parents=True, exist_ok=True)
    with exclusive(conversion_lock(sha256), f"another specdec is reading {label}", progress, cancel):
        if usable_conversion(final, label=label, progress=progress, cancel=cancel) is None:
            if progress is not None:
                progress(Progress(f"Reading {label}'s tokenizer (once)", 0, 0))
            _convert_into(final, gguf_path, sha256, False, label, progress, cancel, write_metadata)
    return final


def check_gguf_file(path: Path) -> int:
    """Raise one line if `path` is not a complete GGUF file (a cut download, a damaged header).

    transformers would otherwise fail deep inside its reader with `struct.error`,
    `ValueError` or `IndexError` and a traceback. Returns the bytes its conversion will
    write (every weight in fp32), to check the disk before minutes of work.
    """
    from gguf import GGUFReader

    size = path.stat().st_size
    with open(path, "rb") as file:
        head = file.read(4)
    if head != b"GGUF":
        raise ModelLoadError(f"{path.name} is not a GGUF file (it does not start with 'GGUF'; {size} bytes)")
    try:
        reader = GGUFReader(str(path))
        end = max((t.data_offset + t.n_bytes for t in reader.tensors), default=0)
    except (ValueError, IndexError, KeyError, OverflowError, struct.error):
        # The reader's own words (numpy reshape errors) mean nothing to a user.
        raise ModelLoadError(
            f"{path.name} is a damaged or truncated GGUF file ({size} bytes; its header or tensor table "
            "cannot be read): download it again"
        ) from None
    if end > size or not reader.tensors:
        raise ModelLoadError(
            f"{path.name} is a truncated GGUF file: {size} bytes, its tensors need {end}; download it again"
        )
    return sum(int(tensor.n_elements) for tensor in reader.tensors) * 4


def _convert_into(
    final: Path,
    gguf_path: Path,
    sha256: str,
    source_verified: bool,
    label: str,
    progress: ProgressCallback | None,
    cancel: threading.Event | None,
    converter: Converter | None,
) -> None:
    tmp = converted_dir() / f".tmp-{sha256[:16]}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        if converter is None and not getattr(sys, "frozen", False):
            from .conversion_process import convert_in_child

            convert_in_child(gguf_path, tmp, label=label, progress=progress, cancel=cancel)
        else:
            # A frozen bundle (PyInstaller) has no `python -m`: convert here; a cancel is
            # then honoured once transformers returns.
            (converter or convert_with_transformers)(gguf_path, tmp)
        check_cancelled(cancel)
        write_marker(
            tmp, source=str(gguf_path.resolve()), sha256=sha256, size=gguf_path.stat().st_size,
            source_verified=source_verified, label=label, progress=progress, cancel=cancel,
        )  # fmt: skip
        rename_into_place(tmp, final)
    except OSError as error:
        if is_disk_full(error):
            raise disk_full_error(
                converted_dir(), None, f"nothing of {gguf_path.name} was converted"
            ) from None
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def write_marker(
    folder: Path, *, source: str, sha256: str, size: int, source_verified: bool, label: str,
    progress: ProgressCallback | None = None, cancel: threading.Event | None = None,
) -> None:  # fmt: skip
    """Seal a finished conversion: hash every file in full and write `specdec.json` last."""
    files = hash_folder(folder, label=f"the converted {label}", progress=progress, cancel=cancel)
    marker = {
        "format": CONVERSION_FORMAT,
        "source": source,
        "sha256": sha256,
        "size": size,
        "source_verified": source_verified,
        "files": {name: record.as_dict() for name, record in files.items()},
    }
    (folder / MARKER).write_text(json.dumps(marker, indent=1), encoding="utf-8")


def rename_into_place(tmp: Path, final: Path) -> None:
    if final.exists():
        if is_converted(final):
            return  # another process finished the same conversion first; keep theirs
        shutil.rmtree(final)  # an incomplete folder, or one from an older version: not trusted
    os.replace(tmp, final)
