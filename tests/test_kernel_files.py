"""Compiled kernels are loaded only when nobody but the user could have written them: a
private folder, the user's own file, the sha256 recorded at compile time; one compile at a
time, and a compiler that hangs is stopped (kernel_files.py)."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from specdec_core.kernels.cpu import kernel_files, native
from specdec_core.kernels.cpu.native import KernelUnavailable
from specdec_core.tools.cli import main

FLAGS = ("-mavx2",)  # what the fake compilers are given; they ignore it
NOBODY = 65534


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch) -> Path:
    from huggingface_hub import constants as hub_constants

    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path / "hf-hub"))  # --verify reads it
    return tmp_path / "cache"


def _script(path: Path, body: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return path


@pytest.fixture
def fake_cc(tmp_path, monkeypatch) -> Path:
    """A compiler that logs each run to cc.log and writes a fixed 'library' to its -o."""
    log = tmp_path / "cc.log"
    compiler = _script(tmp_path / "bin" / "cc", f"""echo run >> {log}
while [ $# -gt 1 ]; do
  if [ "$1" = "-o" ]; then printf 'a compiled library' > "$2"; fi
  shift
done
""")
    monkeypatch.setenv("CC", str(compiler))
    return log


def _runs(log: Path) -> int:
    return len(log.read_text().splitlines()) if log.exists() else 0


def _flip_byte(path: Path, offset: int = 3) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def test_the_kernels_folder_and_the_folders_specdec_makes_above_it_are_private(tmp_path, monkeypatch, fake_cc):
    root = tmp_path / "made" / "by" / "specdec"
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(root))
    old_umask = os.umask(0o002)  # a umask that would leave folders group-writable
    try:
        built = native._build(FLAGS)
    finally:
        os.umask(old_umask)
    for folder in (tmp_path / "made", tmp_path / "made" / "by", root, built.parent):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700, folder
    assert stat.S_IMODE(built.stat().st_mode) & 0o077 == 0


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="needs root to give a file away")
def test_a_kernel_file_owned_by_someone_else_is_refused_and_left_alone(fake_cc):
    built = native._build(FLAGS)
    os.chown(built, NOBODY, NOBODY)
    with pytest.raises(KernelUnavailable, match=f"owned by uid {NOBODY}, not by you") as caught:
        native._build(FLAGS)
    message = str(caught.value)
    assert str(built) in message and "delete it" in message and "\n" not in message
    assert built.stat().st_uid == NOBODY and _runs(fake_cc) == 1


def test_a_group_writable_kernel_file_is_deleted_and_compiled_again(fake_cc, caplog):
    built = native._build(FLAGS)
    built.chmod(0o770)
    assert native._build(FLAGS) == built
    assert _runs(fake_cc) == 2
    assert stat.S_IMODE(built.stat().st_mode) & 0o022 == 0
    assert [r.getMessage() for r in caplog.records] == [
        f"the compiled kernel {built} is writable by group or others (mode 770): deleted it, compiling it again"
    ]


def test_a_group_writable_kernels_folder_is_refused(fake_cc):
    built = native._build(FLAGS)
    built.parent.chmod(0o770)
    with pytest.raises(KernelUnavailable, match="writable by group or others") as caught:
        native._build(FLAGS)
    message = str(caught.value)
    assert f"rm -r {built.parent}" in message and "\n" not in message
    assert _runs(fake_cc) == 1


def test_a_flipped_byte_in_a_compiled_kernel_is_never_loaded_and_it_is_compiled_again(
    fake_cc, monkeypatch, caplog
):
    built = native._build(FLAGS)
    _flip_byte(built)
    loaded = []
    monkeypatch.setattr(native.ctypes, "CDLL", lambda path: loaded.append(Path(path).read_bytes()))
    native._open(FLAGS)
    assert loaded == [b"a compiled library"] and _runs(fake_cc) == 2
    assert [r.getMessage() for r in caplog.records] == [
        f"the compiled kernel {built} failed its sha256 check: deleted it, compiling it again"
    ]


@pytest.mark.skipif(native.unavailable() is not None, reason=str(native.unavailable()))
def test_two_processes_compiling_at_once_compile_once_and_both_load(tmp_path, cache):
    log = tmp_path / "cc.log"
    real_cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    wrapper = _script(tmp_path / "bin" / "cc", f'echo run >> {log}\nexec {real_cc} "$@"\n')
    env = {**os.environ, "SPECDEC_CACHE_DIR": str(cache), "CC": str(wrapper)}
    load = "from specdec_core.kernels.cpu import native; print(hasattr(native.library(), 'int4_linear'))"
    processes = [
        subprocess.Popen([sys.executable, "-c", load], env=env, stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outputs = [process.communicate(timeout=300)[0] for process in processes]
    assert [process.returncode for process in processes] == [0, 0]
    assert outputs == ["True\n", "True\n"]
    assert _runs(log) == 1


def test_a_hung_compiler_is_stopped_quickly_with_one_line(tmp_path, monkeypatch, cache):
    monkeypatch.setenv("CC", str(_script(tmp_path / "bin" / "cc", "sleep 30\n")))
    monkeypatch.setattr(kernel_files, "COMPILE_TIMEOUT_S", 0.5)
    start = time.monotonic()
    with pytest.raises(KernelUnavailable, match=r"ran for over 0\.5 s on the kernels and was stopped") as caught:
        native._build(FLAGS)
    assert time.monotonic() - start < 10
    assert "\n" not in str(caught.value) and "--precision int8" in str(caught.value)
    assert not list(cache.rglob("*.so")) and not list(cache.rglob("*.tmp"))


def test_fetch_verify_reports_and_deletes_a_tampered_kernel(fake_cc, capsys):
    built = native._build(FLAGS)
    _flip_byte(built)
    assert main(["fetch", "--verify"]) == 1
    out = capsys.readouterr().out
    assert f"DAMAGED\t{built}\tfailed its sha256 check: deleted; compiled again when next used" in out
    assert not built.exists() and not kernel_files.record_path(built).exists()


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="needs root to give a file away")
def test_fetch_verify_names_a_kernel_owned_by_someone_else_and_leaves_it(fake_cc, capsys):
    built = native._build(FLAGS)
    os.chown(built, NOBODY, NOBODY)
    assert main(["fetch", "--verify"]) == 1
    assert f"DAMAGED\t{built}\tthe compiled kernel {built} is owned by uid {NOBODY}" in capsys.readouterr().out
    assert built.exists()
