"""The standalone bundle (`make bundle`, packaging/specdec.spec) starts, answers through the real
window offscreen (`--smoke-test`), compiles the int4 kernels from the sources it carries, writes
nothing into its own folder (kernels go to the user cache), and runs the helpers the library
starts as `sys.executable -m MODULE` (the GGUF conversion, pip).

Slow: the first run builds the bundle (minutes); later runs rebuild it only when a source it
carries changed, as make decides.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_gguf_convert import write_tiny_llama_gguf

from specdec_core.kernels.cpu import native

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
BUNDLE = ROOT / "dist" / "specdec-chat"
BUILD_TIMEOUT_S = 1800
RUN_TIMEOUT_S = 600
PROMPT = "def add(a, b):"


@pytest.fixture(scope="module")
def bundle() -> Path:
    """The bundle as `make bundle` leaves it: built on first use, rebuilt when a source changed."""
    done = subprocess.run(
        ["make", "bundle"], cwd=ROOT, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S
    )
    assert done.returncode == 0, f"make bundle failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return BUNDLE


def _tree(folder: Path) -> dict[str, tuple[int, int]]:
    """Every file under `folder`: its size and modification time."""
    return {
        str(path.relative_to(folder)): (path.stat().st_size, path.stat().st_mtime_ns)
        for path in folder.rglob("*")
        if path.is_file()
    }


def _smoke(bundle: Path, cache: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "QT_QPA_PLATFORM": "offscreen", "SPECDEC_CACHE_DIR": str(cache), "HF_HUB_OFFLINE": "1"}
    env.pop("SPECDEC_DATA_DIR", None)  # the smoke run's own scratch folder
    command = [str(bundle / "specdec-chat"), *args, "--draft", "ngram", "--device", "cpu", "--smoke-test", PROMPT]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert done.returncode == 0, f"stdout:\n{done.stdout}\nstderr:\n{done.stderr[-3000:]}"
    assert done.stdout.startswith("smoke test ok: first tokens "), done.stdout
    return done


linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the bundle is built for Linux")


@linux_only
@pytest.mark.timeout(BUILD_TIMEOUT_S + RUN_TIMEOUT_S)
def test_the_bundle_answers_offscreen_and_compiles_its_kernels_into_the_user_cache(
    bundle: Path, tiny_folder: Path, tmp_path: Path
) -> None:
    # int4 where this machine can build the kernels (AVX2 or AVX-512 and a C compiler); elsewhere
    # int8, which still proves the bundle starts and answers.
    precision = "int4" if native.unavailable() is None else "int8"
    cache = tmp_path / "cache"
    before = _tree(bundle)
    done = _smoke(bundle, cache, "--target", str(tiny_folder), "--precision", precision)
    assert done.stdout.rstrip().endswith(f"(cpu · {precision}, draft n-gram)"), done.stdout
    if precision == "int4":
        assert list((cache / "kernels").glob("native-*.so")), "the kernels were not compiled into the cache"
    assert _tree(bundle) == before, "the bundle wrote into its own folder"


@linux_only
@pytest.mark.timeout(BUILD_TIMEOUT_S + RUN_TIMEOUT_S)
def test_the_bundle_converts_a_gguf_in_its_child_process_and_answers_from_it(bundle: Path, tmp_path: Path) -> None:
    gguf = write_tiny_llama_gguf(tmp_path / "tiny-llama.Q8_0.gguf")
    cache = tmp_path / "cache"
    _smoke(bundle, cache, "--target", str(gguf), "--precision", "fp32")
    assert list((cache / "converted").glob("*/config.json")), "nothing was converted into the cache"


@linux_only
@pytest.mark.timeout(BUILD_TIMEOUT_S + RUN_TIMEOUT_S)
def test_the_bundle_runs_pip_as_the_fetch_starts_it(bundle: Path) -> None:
    done = subprocess.run(
        [str(bundle / "specdec-chat"), "-m", "pip", "--version"],
        capture_output=True, text=True, timeout=RUN_TIMEOUT_S,
    )  # fmt: skip
    assert done.returncode == 0 and done.stdout.startswith("pip "), done.stdout + done.stderr
