"""Models from the Hugging Face hub, and the ones already in the local HF cache.

The hub is often unreachable (offline laptops, corporate firewalls, this project's
own CI). A user must learn that in seconds, not after a minute of retries, so every
network call here has a short timeout and a first, cheap metadata request decides
"reachable or not" before any download starts. Models already in the HF cache are
used without touching the network at all.
"""

from __future__ import annotations

import hashlib
import io
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path

from huggingface_hub import HfApi, scan_cache_dir, snapshot_download
from huggingface_hub import constants as hub_constants
from huggingface_hub.errors import (
    CacheNotFound,
    GatedRepoError,
    HfHubHTTPError,
    LocalEntryNotFoundError,
    OfflineModeIsEnabled,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from tqdm.auto import tqdm

try:  # huggingface_hub 2.x talks HTTP through httpx2, 1.x through httpx
    from httpx2 import TransportError
except ImportError:
    from httpx import TransportError  # type: ignore[no-redef]

from ..disk_cache import disk_full_error, hash_file, is_disk_full
from ..errors import Cancelled, FetchError
from ..progress import Progress, ProgressCallback, check_cancelled

HUB_TIMEOUT_S = 5.0
# What loading needs from a repo: configs, safetensors weights, tokenizer files, chat
# templates. Skipping the rest (.bin/.pth duplicates, GGUF, ONNX) can halve a download.
WANTED_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]
SKIPPED_FILES = ["original/*", "onnx/*", "*.gguf"]


@dataclass(frozen=True)
class CachedModel:
    """A hub model found in the local HF cache."""

    repo_id: str
    path: Path  # the snapshot folder (config.json lives here)
    size_bytes: int


def local_snapshot(repo_id: str, revision: str | None = None) -> Path | None:
    """The cached snapshot folder of `repo_id`, without any network access, if it is complete enough."""
    try:
        folder = snapshot_download(
            repo_id, revision=revision, local_files_only=True,
            allow_patterns=WANTED_FILES, ignore_patterns=SKIPPED_FILES,
        )  # fmt: skip
    except (LocalEntryNotFoundError, FileNotFoundError, OfflineModeIsEnabled):
        return None
    path = Path(folder)
    return path if (path / "config.json").is_file() else None


def download_snapshot(
    repo_id: str,
    *,
    revision: str | None = None,
    progress: ProgressCallback | None = None,
    cancel: threading.Event | None = None,
    timeout_s: float = HUB_TIMEOUT_S,
    endpoint: str | None = None,
) -> Path:
    """Return the local snapshot folder of `repo_id`, downloading it if it is not cached.

    Raises FetchError with one line when the hub cannot be reached, the repo does not
    exist, or it is gated.
    """
    cached = local_snapshot(repo_id, revision)
    if cached is not None:
        return cached
    check_cancelled(cancel)
    if hub_constants.HF_HUB_OFFLINE:
        raise FetchError(f"{repo_id} is not in the local HF cache and HF_HUB_OFFLINE is set")
    # One short metadata call first: an unreachable hub fails here in seconds.
    _check_repo(repo_id, revision, timeout_s, endpoint)
    stage = f"Downloading {repo_id}"
    try:
        folder = snapshot_download(
            repo_id, revision=revision, allow_patterns=WANTED_FILES, ignore_patterns=SKIPPED_FILES,
            etag_timeout=timeout_s, endpoint=endpoint,
            tqdm_class=_progress_bar_class(stage, progress, cancel),
        )  # fmt: skip
    except (TransportError, HfHubHTTPError) as error:
        raise FetchError(f"downloading {repo_id} from the model hub failed: {_first_line(error)}") from None
    except OSError as error:
        if is_disk_full(error):
            kept = "the files already downloaded are kept; run the same command to resume"
            raise disk_full_error(Path(hub_constants.HF_HUB_CACHE), None, kept) from None
        raise
    if not (Path(folder) / "config.json").is_file():
        raise FetchError(
            f"{repo_id} holds no config.json (a GGUF-only repository?): download one of its .gguf files "
            "and pass its path"
        )
    return Path(folder)


def cached_models() -> list[CachedModel]:
    """Every model repo in the local HF cache whose snapshot looks loadable (has config.json)."""
    try:
        info = scan_cache_dir(hub_constants.HF_HUB_CACHE)
    except CacheNotFound:
        return []
    found = []
    for repo in info.repos:
        if repo.repo_type != "model" or not repo.revisions:
            continue
        newest = max(repo.revisions, key=lambda revision: revision.last_modified)
        if (Path(newest.snapshot_path) / "config.json").is_file():
            found.append(CachedModel(repo.repo_id, Path(newest.snapshot_path), repo.size_on_disk))
    return sorted(found, key=lambda model: model.repo_id.lower())


def verify_snapshot(
    snapshot: Path, *, progress: ProgressCallback | None = None, cancel: threading.Event | None = None
) -> list[str] | None:
    """Re-hash a cached snapshot's files against the names of their blobs; None if it cannot tell.

    The HF cache stores each file once under `blobs/<etag>`: the sha256 of a large (LFS)
    file, the git blob sha1 of a small one, so the name is the expected hash. Damaged
    blobs are deleted, and with them the snapshot folder (links only), so that the next
    use downloads again, reusing every intact blob. Returns the damaged files' names.
    """
    files = sorted(p for p in snapshot.rglob("*") if p.is_symlink() or p.is_file())
    if not files or not all(p.is_symlink() for p in files):
        return None  # a cache without links (Windows without developer mode): nothing to compare
    damaged = []
    for link in files:
        check_cancelled(cancel)
        blob = link.resolve()
        if not blob.is_file() or _blob_hash(blob, progress, cancel) != blob.name:
            damaged.append(str(link.relative_to(snapshot)))
            blob.unlink(missing_ok=True)
    if damaged:
        shutil.rmtree(snapshot, ignore_errors=True)
    return damaged


def _blob_hash(blob: Path, progress: ProgressCallback | None, cancel: threading.Event | None) -> str:
    if len(blob.name) == 64:  # LFS: sha256 of the content
        return hash_file(blob, label=blob.name[:12], progress=progress, cancel=cancel)
    data = blob.read_bytes()  # a small file in git: sha1 of "blob <size>\0" + content
    return hashlib.sha1(b"blob %d\0" % len(data) + data, usedforsecurity=False).hexdigest()


def _check_repo(repo_id: str, revision: str | None, timeout_s: float, endpoint: str | None) -> None:
    try:
        HfApi(endpoint=endpoint).model_info(repo_id, revision=revision, timeout=timeout_s)
    except GatedRepoError:
        raise FetchError(
            f"{repo_id} is gated: accept its licence on its hub page, then log in with `hf auth login`"
        ) from None
    except RepositoryNotFoundError:
        raise FetchError(
            f"no model {repo_id} on the hub (or it is private: log in with `hf auth login`)"
        ) from None
    except RevisionNotFoundError:
        raise FetchError(f"{repo_id} has no revision {revision!r} on the hub") from None
    except (TransportError, OfflineModeIsEnabled) as error:
        raise FetchError(
            f"the model hub is unreachable ({_first_line(error) or type(error).__name__}); "
            "use a local folder or .gguf file, or a catalog model from the package index"
        ) from None
    except HfHubHTTPError as error:
        raise FetchError(f"the model hub refused {repo_id}: {_first_line(error)}") from None


def _progress_bar_class(
    stage: str, progress: ProgressCallback | None, cancel: threading.Event | None
) -> type:
    """A tqdm class for `snapshot_download` that reports its byte counts as `Progress`.

    huggingface_hub draws its aggregate "bytes written" bar with the class we pass; we
    draw nothing (output goes to a throwaway buffer) and forward the counts instead.
    Raising `Cancelled` from `update` stops the download threads at their next chunk.
    """

    class ProgressBridge(tqdm):
        def __init__(self, *args, **kwargs):
            kwargs["file"] = io.StringIO()
            kwargs.pop("disable", None)
            super().__init__(*args, **kwargs)

        def update(self, n=1):
            if cancel is not None and cancel.is_set():
                raise Cancelled("cancelled")
            result = super().update(n)
            if progress is not None and self.unit == "B":
                progress(Progress(stage, int(self.n), int(self.total or 0)))
            return result

    return ProgressBridge


def _first_line(error: BaseException) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else ""
