"""Compiled kernels we can trust: a private folder, a recorded sha256, one compile at a time.

A compiled library is code that runs inside specdec, so `native.py` loads one only
when nobody but the user could have written it. The rules:

- The kernels folder, and every folder above it that specdec creates itself, is made
  0700. A kernels folder not owned by the user, or writable by group or others, is
  refused: anyone who can write it could have put code there, so nothing in it is
  loaded until the user deletes it (specdec then makes a private one).
- A compiled library not owned by the user is refused too: in a private folder only
  the user or root could have put it there, and which of the two it was is the user's
  to judge, so it is named and left alone.
- A library that is the user's but cannot be trusted as it is (writable by group or
  others, no recorded hash, bytes that do not match the hash recorded when it was
  compiled) is deleted and compiled again, with one line saying why. That is safe
  because its bytes are never loaded and the folder is ours to write; it costs one
  compile, and a wrong mode usually comes from a copy tool or an umask, not an attack.
- The sha256 of each library is recorded beside it when it is compiled
  (`native-<key>.so.sha256`, written before the library is renamed into place) and
  checked right before it is loaded. `specdec fetch --verify` checks the same three
  things for every library in the folder.
- Compiles are serialized by `fcntl.flock` on `compile.lock` in the kernels folder: a
  second process waits for the first and then finds its library. Only the lock's
  holder writes temporaries, so it also deletes those a killed compile left. A
  compiler gets `COMPILE_TIMEOUT_S`; a hung one is killed with its children.
"""

from __future__ import annotations

import hashlib
import logging
import os
import signal
import stat
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

COMPILE_TIMEOUT_S = 60.0  # a compile takes seconds; a minute means the compiler hangs
# How long a process waits for another's compile: its compiler's limit, and a margin for
# the hashing and renaming around it.
LOCK_MARGIN_S = 30.0
LOCK_NAME = "compile.lock"
RECORD_SUFFIX = ".sha256"
_FOREIGN_WRITABLE = stat.S_IWGRP | stat.S_IWOTH

log = logging.getLogger(__name__)


class KernelFileError(RuntimeError):
    """A kernel file or folder that is not loaded; the message names it, says why and what to do."""


# --- the folder ---------------------------------------------------------------------------


def private_folder(folder: Path) -> Path:
    """`folder`, made (with the missing folders above it) 0700, or refused if others could write it."""
    missing = []
    parent = folder
    while not parent.exists() and parent != parent.parent:
        missing.append(parent)
        parent = parent.parent
    for path in reversed(missing):
        try:
            path.mkdir(mode=0o700)
        except FileExistsError:
            continue  # another process made it in the meantime; checked below like any other
        os.chmod(path, 0o700)  # whatever the umask left
    refusal = folder_problem(folder)
    if refusal:
        raise KernelFileError(refusal)
    return folder


def folder_problem(folder: Path) -> str | None:
    """Why nothing in the kernels folder may be loaded (not a folder, not the user's, writable by
    others), or None."""
    info = folder.stat()
    if not stat.S_ISDIR(info.st_mode):
        return f"{folder} is not a folder; move it away and specdec makes the kernels folder there"
    fix = f"delete it (rm -r {folder}) and specdec compiles the kernels again into a private folder"
    if info.st_uid != os.geteuid():
        return f"the kernels folder {folder} is owned by uid {info.st_uid}, not by you (uid {os.geteuid()}): {fix}"
    if info.st_mode & _FOREIGN_WRITABLE:
        return (
            f"the kernels folder {folder} is writable by group or others (mode {stat.S_IMODE(info.st_mode):o}),"
            f" so anyone could have put code in it: {fix}"
        )
    return None


# --- one library ----------------------------------------------------------------------------


def record_path(library: Path) -> Path:
    return library.with_name(library.name + RECORD_SUFFIX)


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def install(partial: Path, library: Path) -> None:
    """Put a freshly compiled `partial` in place as `library`, its sha256 recorded first.

    The record is written (atomically) before the rename, so a library in place never
    lacks its record; a kill between the two leaves a stale record, which the next check
    finds wrong and repairs.
    """
    os.chmod(partial, 0o700)
    record = record_path(library)
    tmp = record.with_name(f"{record.name}.{os.getpid()}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w", encoding="ascii") as file:
            file.write(sha256_of(partial) + "\n")
        os.replace(tmp, record)
    finally:
        tmp.unlink(missing_ok=True)
    os.replace(partial, library)


def discard(library: Path) -> None:
    """Delete a library and its record."""
    library.unlink(missing_ok=True)
    record_path(library).unlink(missing_ok=True)


def problem(library: Path) -> str | None:
    """Why the user's own `library` must not be loaded (then it may be deleted), or None when it
    may; raises KernelFileError for one that is not the user's to delete. The library must exist."""
    info = os.lstat(library)
    if not stat.S_ISREG(info.st_mode):
        raise KernelFileError(f"{library} is not a regular file, so specdec will not load it: delete it")
    if info.st_uid != os.geteuid():
        raise KernelFileError(
            f"the compiled kernel {library} is owned by uid {info.st_uid}, not by you (uid {os.geteuid()}),"
            " so specdec will not load it: delete it and the kernels are compiled again"
        )
    if info.st_mode & _FOREIGN_WRITABLE:
        return f"is writable by group or others (mode {stat.S_IMODE(info.st_mode):o})"
    recorded = _recorded_sha256(library)
    if recorded is None:
        return "has no recorded sha256"
    if sha256_of(library) != recorded:
        return "failed its sha256 check"
    return None


def usable(library: Path) -> bool:
    """Whether `library` is there and may be loaded; one that may not is deleted, with one line."""
    if not library.exists():
        return False
    reason = problem(library)
    if reason is None:
        return True
    log.warning("the compiled kernel %s %s: deleted it, compiling it again", library, reason)
    discard(library)
    return False


def _recorded_sha256(library: Path) -> str | None:
    """The sha256 recorded when `library` was compiled, if the record is the user's alone."""
    record = record_path(library)
    try:
        info = os.lstat(record)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & _FOREIGN_WRITABLE:
            return None
        return record.read_text(encoding="ascii").strip() or None
    except (OSError, UnicodeDecodeError):
        return None


# --- compiling ------------------------------------------------------------------------------


@contextmanager
def compile_lock(folder: Path) -> Iterator[None]:
    """Hold the kernels folder's compile lock: wait for another process's compile to end."""
    import fcntl  # POSIX only, like the kernels (their CPU flags are read on Linux)

    lock = folder / LOCK_NAME
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        deadline = time.monotonic() + COMPILE_TIMEOUT_S + LOCK_MARGIN_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise KernelFileError(
                        f"another specdec process has held {lock} for over"
                        f" {COMPILE_TIMEOUT_S + LOCK_MARGIN_S:.0f} s while compiling the kernels;"
                        " try again when it has finished"
                    ) from None
                time.sleep(0.05)  # a poll, so that the wait has a limit
        for leftover in folder.glob("*.tmp"):  # only the holder writes these: a killed compile's
            leftover.unlink(missing_ok=True)
        yield
    finally:
        os.close(fd)  # releases the lock


def run_compiler(argv: list[str]) -> subprocess.CompletedProcess[str]:
    """Run a compiler, killed with the processes it started (cc1, as) past COMPILE_TIMEOUT_S.

    Raises KernelFileError on the timeout, OSError when the compiler cannot be started.
    """
    with subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    ) as process:
        try:
            out, err = process.communicate(timeout=COMPILE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            _kill_group(process)
            raise KernelFileError(
                f"the C compiler ({argv[0]}) ran for over {COMPILE_TIMEOUT_S:g} s on the kernels and was stopped"
            ) from None
        except BaseException:  # an interrupt: the compiler is in its own session, so stop it here
            _kill_group(process)
            raise
    return subprocess.CompletedProcess(argv, process.returncode, out, err)


def _kill_group(process: subprocess.Popen[str]) -> None:
    with suppress(ProcessLookupError):  # it ended on its own meanwhile
        os.killpg(process.pid, signal.SIGKILL)
    process.communicate()
