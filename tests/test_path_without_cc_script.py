"""scripts/path-without-cc, which `make test-isas` runs the kernel tests under: every program
of PATH but the C compilers, so native.py finds none."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "path-without-cc"
COMPILERS = (
    "cc",
    "gcc",
    "clang",
    "c99",
    "gcc-12",
    "clang-15",
    "x86_64-linux-gnu-gcc",
    "x86_64-linux-gnu-gcc-12",
)
OTHERS = ("ls", "gcc-ar", "x86_64-linux-gnu-gcc-nm-12", "ccache", "git")


def _programs(folder: Path, names: tuple[str, ...]) -> None:
    folder.mkdir()
    for name in names:
        program = folder / name
        program.write_text(f"#!/bin/sh\necho {folder.name}\n")
        program.chmod(0o755)


def test_every_program_but_the_c_compilers_is_on_the_new_path(tmp_path) -> None:
    _programs(tmp_path / "first", ("git", *COMPILERS[:4]))
    _programs(tmp_path / "second", (*COMPILERS, *OTHERS))
    (tmp_path / "second" / "notes.txt").write_text("not a program")
    done = subprocess.run(
        [sys.executable, str(SCRIPT), str(tmp_path / "no-cc")],
        capture_output=True, text=True, timeout=60,
        env={**os.environ, "PATH": os.pathsep.join([str(tmp_path / "first"), str(tmp_path / "second")])},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    path = done.stdout.strip()
    assert all(shutil.which(name, path=path) is None for name in COMPILERS)
    assert all(shutil.which(name, path=path) for name in OTHERS)
    assert shutil.which("notes.txt", path=path) is None
    first = subprocess.run(
        [shutil.which("git", path=path) or "git"], capture_output=True, text=True, check=True
    )
    assert first.stdout.strip() == "first"  # the first of a name wins, as on PATH
