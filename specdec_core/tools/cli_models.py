"""`specdec models` and `specdec fetch`: what models there are, which drafts fit, getting them.

- `specdec models [--json]` lists the catalog and the models already on this machine
  (converted GGUFs, the local HF cache) with roles, size and whether they are present.
- `specdec models --compatible-with REF [--json]` gives every known model a verdict as a
  draft for REF, with the reason, plus the model-free `ngram` drafter: `compat.rate_draft`,
  the verdict the app and the session show too.
- `specdec fetch NAME...` downloads and converts catalog models (progress on stderr);
  `--list-cache`, `--clear` and `--verify` (a full re-hash) manage the cache.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass

from ..engine.drafters import NGRAM
from ..errors import SpecdecError
from ..models import gguf_convert, hub
from ..models.catalog import (
    DEFAULT_DRAFT,
    DEFAULT_TARGET,
    HubSource,
    ModelEntry,
    PackageIndexSource,
    load_catalog,
)
from ..models.compat import rate_draft
from ..models.gguf_convert import sweep_stale_temporaries
from ..models.loading import tokenizer_folder
from ..models.refs import entry_state, fetch_catalog_gguf, local_folder, resolve_model_ref
from ..progress import TerminalProgress, human_bytes
from . import cache_admin


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
    fetch.add_argument(
        "--convert", action="store_true",
        help="also write the GGUF's weights as an fp32 HF folder (what a CUDA load reads; the CPU reads the file)",
    )  # fmt: skip
    fetch.add_argument("--list-cache", action="store_true", help="list what the cache holds")
    fetch.add_argument(
        "--clear", nargs="?", const="all", choices=["all", "gguf", "converted", "partial", "kernel", "probe"],
        help="delete cache items (all, or one kind)",
    )  # fmt: skip
    fetch.add_argument(
        "--verify", action="store_true",
        help="re-hash every cached file (or those of NAME...) in full, delete damaged ones; NAMEs are then fetched again",
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
        verdicts = draft_verdicts(args.compatible_with)
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
    compatible: bool
    reason: str
    state: str  # as in ModelRow; "builtin" for ngram
    basis: str  # what decided: "tokenizers", "catalog" or "builtin" (compat.Compatibility.basis)


def draft_verdicts(target_ref: str) -> list[DraftVerdict]:
    """Every known model rated as a draft for `target_ref` (compat.rate_draft), plus ngram.

    Nothing is downloaded or converted: models not on disk are judged from the catalog.
    """
    target = load_catalog().get(target_ref)
    target_name = target.name if target is not None else target_ref
    target_folder = local_folder(target_ref)
    verdict = rate_draft(target_ref, NGRAM)
    verdicts = [DraftVerdict(NGRAM, verdict.compatible, verdict.reason, "builtin", verdict.basis)]
    for row in list_models():
        if row.name == target_name or (target_folder is not None and local_folder(row.name) == target_folder):
            continue
        ref = row.location if row.source == "hf-cache" else row.name
        verdict = rate_draft(target_ref, ref)
        verdicts.append(DraftVerdict(row.name, verdict.compatible, verdict.reason, row.state, verdict.basis))
    return verdicts


def _print_verdicts(target_ref: str, verdicts: list[DraftVerdict]) -> None:
    print(f"drafts for {target_ref}:")
    table = [["DRAFT", "COMPATIBLE", "STATE", "REASON"]]
    for v in verdicts:
        table.append([v.name, "yes" if v.compatible else "no", v.state, v.reason])
    _print_table(table)


# --- fetch and the cache ------------------------------------------------------------------


def run_fetch(args: argparse.Namespace) -> int:
    if args.clear:
        removed = cache_admin.clear_cache(None if args.clear == "all" else {args.clear})
        freed = sum(item.size_bytes for item in removed)
        print(f"removed {len(removed)} item(s), {human_bytes(freed)} freed from {gguf_convert.cache_dir()}")
        return 0
    if args.list_cache:
        _list_cache(args.json)
        return 0
    stale = sweep_stale_temporaries()
    if stale:
        print(f"specdec: removed {len(stale)} leftover(s) of an interrupted run", file=sys.stderr)
    progress = TerminalProgress()
    intact = _verify(args.names, progress) if args.verify else True
    if args.verify and not args.names:
        return 0 if intact else 1
    if not args.names:
        raise SpecdecError(
            "name a model to fetch (`specdec models` lists them), or use --list-cache / --clear / --verify"
        )
    try:
        for name in args.names:
            start = time.perf_counter()
            entry = load_catalog().get(name)
            if args.no_convert and entry is not None and isinstance(entry.source, PackageIndexSource):
                path = fetch_catalog_gguf(entry, progress=progress)
            elif args.convert:
                path = resolve_model_ref(name, progress=progress)
            else:  # a GGUF's tokenizer and config; on the CPU its weights load from the file itself
                path = tokenizer_folder(name, progress=progress)
            progress.close()
            print(f"specdec: {name} ready in {time.perf_counter() - start:.1f} s", file=sys.stderr)
            print(f"{name}\t{path}")
    except KeyboardInterrupt:
        print("\nspecdec: fetch interrupted; run the same command again to resume", file=sys.stderr)
        return 130
    return 0


def _verify(names: list[str], progress: TerminalProgress) -> bool:
    """Re-hash the cache (or the named models' files) in full; True when nothing was damaged."""
    results = cache_admin.verify_cache(set(names) if names else None, progress=progress)
    progress.close()
    for result in results:
        print(f"{'ok' if result.ok else 'DAMAGED'}\t{result.item.path}\t{result.detail}")
    damaged = sum(not r.ok for r in results)
    if damaged:
        again = "fetching them again" if names else "they are made again when next used"
        # A kernel that is not the user's is named, not deleted: each line says what was done.
        print(f"specdec: {damaged} damaged item(s), each line says what was done; {again}", file=sys.stderr)
    else:
        print(f"specdec: {len(results)} item(s) verified, all intact", file=sys.stderr)
    return damaged == 0


def _list_cache(as_json: bool) -> None:
    items = cache_admin.list_cache()
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
