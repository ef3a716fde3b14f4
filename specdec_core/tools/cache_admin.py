"""What the model cache holds, and keeping it honest: list, clear, verify (`specdec fetch
--list-cache / --clear / --verify`). The layout is described in `disk_cache.py`.
"""

from __future__ import annotations

import shutil
import threading
from dataclasses import dataclass
from pathlib import Path

from ..disk_cache import cache_dir, converted_dir, downloads_dir, fetched_gguf_dir, kernels_dir, verify_file
from ..kernels.cpu import kernel_files
from ..models import hub
from ..models.catalog import HubSource, PackageIndexSource, load_catalog
from ..models.gguf_convert import is_converted, read_marker, usable_conversion
from ..models.requant_probe import probes_dir
from ..progress import ProgressCallback

# --- listing and clearing -----------------------------------------------------------


@dataclass(frozen=True)
class CacheItem:
    kind: str  # "gguf" (fetched file), "converted" (HF folder), "partial" (unfinished fetch/conversion),
    # "kernel" (the compiled C kernels, rebuilt on next use)
    path: Path
    size_bytes: int
    description: str  # the GGUF a folder was converted from, the model a fetch is for


def list_cache() -> list[CacheItem]:
    items = []
    for path in sorted(fetched_gguf_dir().glob("*/*.gguf")):
        items.append(CacheItem("gguf", path, path.stat().st_size, path.parent.name))
    for path in sorted(p for p in downloads_dir().glob("*") if p.is_dir()):
        items.append(CacheItem("partial", path, _tree_size(path), f"unfinished download of {path.name}"))
    for path in sorted(converted_dir().glob("*")):
        if path.name.startswith(".tmp-") or not is_converted(path):
            items.append(CacheItem("partial", path, _tree_size(path), "unfinished conversion"))
            continue
        marker = read_marker(path) or {}
        checked = " (source verified against the catalog)" if marker.get("source_verified") else ""
        source = Path(str(marker.get("source", "?"))).name
        items.append(CacheItem("converted", path, _tree_size(path), f"from {source}{checked}"))
    for path in sorted(probes_dir().glob("*.json")):
        items.append(CacheItem("probe", path, path.stat().st_size, "a re-quantization's measured KL"))
    for path in sorted(kernels_dir().glob("*.so")):
        items.append(CacheItem("kernel", path, path.stat().st_size, "CPU kernels, compiled here"))
    return items


@dataclass(frozen=True)
class VerifiedItem:
    item: CacheItem
    ok: bool
    detail: str  # "ok", what was damaged and deleted, or why it was not checked


def verify_cache(
    names: set[str] | None = None, *, progress: ProgressCallback | None = None,
    cancel: threading.Event | None = None,
) -> list[VerifiedItem]:  # fmt: skip
    """Re-hash every cached file in full (or those of the models `names`), the HF cache's
    model snapshots included; delete damaged ones.

    This is the check for what the fast one cannot see: a file changed in place with its
    size and mtime kept (bit rot, a careless tool).
    """
    results = []
    for item in list_cache():
        entry_name = item.path.parent.name if item.kind == "gguf" else item.path.name
        entry = load_catalog().get(entry_name)
        source = entry.source if entry is not None and isinstance(entry.source, PackageIndexSource) else None
        if names is not None and not _belongs_to(item, names):
            continue
        if item.kind == "converted":
            label = Path(str((read_marker(item.path) or {}).get("source", item.path.name))).name
            ok = usable_conversion(item.path, label=label, full=True, progress=progress, cancel=cancel)
            results.append(VerifiedItem(item, ok is not None, "ok" if ok else "damaged: deleted"))
        elif item.kind == "gguf" and source is not None:
            results.append(_verify_one(item, item.path, source.sha256, progress, cancel))
        elif item.kind == "partial" and source is not None and item.path.parent == downloads_dir():
            for index, part in enumerate(source.parts, start=1):
                chunk = item.path / f"part{index:02d}.bin"
                if chunk.is_file():
                    results.append(_verify_one(item, chunk, part.sha256, progress, cancel))
        elif item.kind == "kernel":
            results.append(_verify_kernel(item))
    return results + _verify_kernels_folder(names) + _verify_hub_cache(names, progress, cancel)


def _verify_kernel(item: CacheItem) -> VerifiedItem:
    """A compiled kernel against its recorded sha256, owner and mode (kernel_files.py); the
    user's own bad one is deleted, one that is not the user's is named and left alone."""
    try:
        reason = kernel_files.problem(item.path)
    except kernel_files.KernelFileError as exc:
        return VerifiedItem(item, False, str(exc))
    if reason is None:
        return VerifiedItem(item, True, "ok")
    kernel_files.discard(item.path)
    return VerifiedItem(item, False, f"{reason}: deleted; compiled again when next used")


def _verify_kernels_folder(names: set[str] | None) -> list[VerifiedItem]:
    """The kernels folder itself, when the whole cache is verified: the user's and private."""
    folder = kernels_dir()
    problem = kernel_files.folder_problem(folder) if names is None and folder.exists() else None
    if problem is None:
        return []
    return [VerifiedItem(CacheItem("kernel", folder, _tree_size(folder), "the kernels folder"), False, problem)]


def _verify_hub_cache(
    names: set[str] | None, progress: ProgressCallback | None, cancel: threading.Event | None
) -> list[VerifiedItem]:
    """The HF cache's model snapshots (all, or those `names` designate by catalog name or hub id)."""
    wanted = None
    if names is not None:
        catalog_repos = {
            e.source.repo_id
            for e in load_catalog().models
            if e.name in names and isinstance(e.source, HubSource)
        }
        wanted = {repo.lower() for repo in names | catalog_repos}
    results = []
    for model in hub.cached_models():
        if wanted is not None and model.repo_id.lower() not in wanted:
            continue
        item = CacheItem("hub", model.path, model.size_bytes, model.repo_id)
        damaged = hub.verify_snapshot(model.path, progress=progress, cancel=cancel)
        if damaged is None:
            results.append(
                VerifiedItem(item, True, "not checked: the HF cache holds copies, not hash-named blobs")
            )
        elif damaged:
            results.append(
                VerifiedItem(
                    item, False, f"damaged: {', '.join(damaged)} deleted; the next use downloads them"
                )
            )
        else:
            results.append(VerifiedItem(item, True, "ok"))
    return results


def _verify_one(
    item: CacheItem,
    path: Path,
    expected: str,
    progress: ProgressCallback | None,
    cancel: threading.Event | None,
) -> VerifiedItem:
    if verify_file(path, expected, full=True, progress=progress, cancel=cancel):
        return VerifiedItem(item, True, "ok")
    path.unlink()
    return VerifiedItem(item, False, f"{path.name} failed its sha256 check: deleted")


def _belongs_to(item: CacheItem, names: set[str]) -> bool:
    shas = {
        e.source.sha256[:16] for e in load_catalog().models if e.name in names and hasattr(e.source, "sha256")
    }
    return item.path.name in shas or item.path.name in names or item.path.parent.name in names


def clear_cache(kinds: set[str] | None = None) -> list[CacheItem]:
    """Delete cache items of the given kinds (all when None); return what was deleted."""
    removed = []
    for item in list_cache():
        if kinds is None or item.kind in kinds:
            if item.path.is_dir():
                shutil.rmtree(item.path)
            elif item.kind == "kernel":
                kernel_files.discard(item.path)  # with its recorded sha256
            else:
                item.path.unlink()
            removed.append(item)
    if kinds is None:
        (cache_dir() / "hashes.json").unlink(missing_ok=True)
    return removed


def _tree_size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
