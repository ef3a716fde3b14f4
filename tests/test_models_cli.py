"""`specdec models` and `specdec fetch`, run through their argparse handlers, offline."""

from __future__ import annotations

import argparse
import io
import json
import shutil
from pathlib import Path

import pytest
from huggingface_hub import constants as hub_constants

from specdec_core.errors import SpecdecError
from specdec_core.models import gguf_convert, refs
from specdec_core.models.catalog import DEFAULT_DRAFT, DEFAULT_TARGET, SMALL_MODEL, load_catalog
from specdec_core.progress import Progress, TerminalProgress
from specdec_core.tools import cli_models
from specdec_core.tools.cli_models import register


@pytest.fixture(autouse=True)
def fresh_machine(tmp_path, monkeypatch):
    """An empty specdec cache and an empty HF cache."""
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path / "specdec-cache"))
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path / "hf-hub"))


def run(capsys, *argv: str) -> tuple[int, str]:
    code, out, _err = run_both(capsys, *argv)
    return code, out


def run_both(capsys, *argv: str) -> tuple[int, str, str]:
    parser = argparse.ArgumentParser(prog="specdec")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    code = args.func(args)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def run_json(capsys, *argv: str) -> dict:
    code, out = run(capsys, *argv, "--json")
    assert code == 0
    return json.loads(out)


def cache_hub_folder(cache: Path, repo_id: str, source: Path) -> Path:
    """Put a copy of an HF folder into the HF cache layout under `repo_id`."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    for file in source.iterdir():
        shutil.copy(file, snapshot / file.name)
    return snapshot


def mark_converted(entry_name: str, source: Path, vocab_size: int) -> Path:
    """Make a catalog GGUF model look fetched and converted, with `source`'s tokenizer."""
    folder = gguf_convert.converted_path(load_catalog().require(entry_name).source.sha256)
    shutil.copytree(source, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "vocab_size": vocab_size}))
    gguf_convert.write_marker(
        folder, source="test", sha256="x", size=0, source_verified=False, label=entry_name
    )
    return folder


def test_models_on_a_fresh_machine_lists_the_catalog_with_the_default_pair_missing(capsys):
    doc = run_json(capsys, "models")
    by_name = {m["name"]: m for m in doc["models"]}
    assert list(by_name) == load_catalog().names()
    assert by_name[DEFAULT_TARGET]["default"] == "target" and by_name[DEFAULT_DRAFT]["default"] == "draft"
    assert by_name[DEFAULT_TARGET]["source"] == "package-index"
    assert by_name[DEFAULT_TARGET]["size_bytes"] == 1_117_320_768
    assert not any(m["present"] for m in doc["models"])
    assert doc["cache_dir"].endswith("specdec-cache")


def test_models_lists_converted_and_hf_cache_models_as_present(capsys, tiny_folder):
    mark_converted(SMALL_MODEL, tiny_folder, 49152)
    snapshot = cache_hub_folder(Path(hub_constants.HF_HUB_CACHE), "acme/tiny-chat", tiny_folder)
    by_name = {m["name"]: m for m in run_json(capsys, "models")["models"]}
    assert by_name[SMALL_MODEL]["state"] == "ready"
    assert by_name["acme/tiny-chat"] | {"size_bytes": 0} == by_name["acme/tiny-chat"] | {
        "source": "hf-cache", "location": str(snapshot), "present": True, "size_bytes": 0,
    }  # fmt: skip


def test_models_table_marks_the_default_pair_and_names_the_cache(capsys):
    code, out = run(capsys, "models")
    assert code == 0
    assert f"{DEFAULT_TARGET} (target)" in out and f"{DEFAULT_DRAFT} (draft)" in out
    assert "specdec-cache" in out


def test_drafts_for_a_local_folder_are_checked_for_real_and_ngram_always_fits(capsys, tiny_folder):
    cache_hub_folder(Path(hub_constants.HF_HUB_CACHE), "acme/tiny-copy", tiny_folder)
    mark_converted(SMALL_MODEL, tiny_folder, 49152)
    doc = run_json(capsys, "models", "--compatible-with", str(tiny_folder))
    verdicts = {d["name"]: d for d in doc["drafts"]}
    assert verdicts["ngram"]["compatible"] is True
    assert verdicts["acme/tiny-copy"]["compatible"] is True
    assert verdicts["acme/tiny-copy"]["reason"].startswith("compatible: same ")
    tiny_rows = json.loads((tiny_folder / "config.json").read_text())["vocab_size"]
    assert verdicts[SMALL_MODEL] == {
        "name": SMALL_MODEL, "compatible": False, "reason": f"vocab 49152 vs {tiny_rows}", "state": "ready",
        "basis": "tokenizers",
    }  # fmt: skip
    # Not downloaded: judged from the catalog's vocabulary size, without a download.
    assert verdicts[DEFAULT_DRAFT]["compatible"] is False
    assert verdicts[DEFAULT_DRAFT]["reason"] == f"vocab 151936 vs {tiny_rows}"


def test_drafts_for_a_catalog_target_not_yet_fetched_come_from_the_catalog_without_downloading(
    capsys, monkeypatch
):
    def no_download(*args, **kwargs):
        raise AssertionError("a listing must not download models")

    monkeypatch.setattr(refs, "fetch_package_index_file", no_download)
    verdicts = {
        d["name"]: d for d in run_json(capsys, "models", "--compatible-with", DEFAULT_TARGET)["drafts"]
    }
    assert DEFAULT_TARGET not in verdicts
    assert verdicts[DEFAULT_DRAFT]["compatible"] is True
    assert verdicts[DEFAULT_DRAFT]["basis"] == "catalog"
    assert verdicts[SMALL_MODEL] | {"state": ""} == {
        "name": SMALL_MODEL, "compatible": False, "state": "", "basis": "catalog",
        "reason": f"smollm2 tokenizer, the target uses qwen2.5: pick a qwen2.5 draft such as {DEFAULT_DRAFT}",
    }  # fmt: skip
    # Another family of the same size is refused too: the same verdict as the app's draft menu.
    assert verdicts["qwen3-0.6b"]["compatible"] is False
    assert verdicts["qwen3-0.6b"]["reason"].startswith("qwen3 tokenizer, the target uses qwen2.5")


def test_fetch_prints_each_model_and_its_folder_and_draws_progress_on_stderr(capsys, monkeypatch, tmp_path):
    def fake_resolve(ref, *, progress=None, cancel=None):
        progress(Progress(f"Downloading {ref} (part 1/2)", 50, 100))
        progress(Progress(f"Downloading {ref} (part 2/2)", 100, 100))
        return tmp_path / ref

    monkeypatch.setattr(cli_models, "tokenizer_folder", fake_resolve)
    code, out, err = run_both(capsys, "fetch", SMALL_MODEL, DEFAULT_DRAFT)
    assert code == 0
    assert out.splitlines() == [
        f"{SMALL_MODEL}\t{tmp_path / SMALL_MODEL}",
        f"{DEFAULT_DRAFT}\t{tmp_path / DEFAULT_DRAFT}",
    ]
    assert f"Downloading {SMALL_MODEL}: 100 B" in err.splitlines()  # capsys is no terminal: a line per bar
    assert f"specdec: {DEFAULT_DRAFT} ready in" in err


def test_fetch_without_a_name_says_what_to_do(capsys):
    with pytest.raises(SpecdecError, match="name a model to fetch"):
        run(capsys, "fetch")


def test_list_cache_shows_items_and_clear_empties_the_cache(capsys, tiny_folder):
    folder = mark_converted(SMALL_MODEL, tiny_folder, 49152)
    items = run_json(capsys, "fetch", "--list-cache")["items"]
    assert [(i["kind"], i["path"]) for i in items] == [("converted", str(folder))]
    code, out = run(capsys, "fetch", "--clear")
    assert code == 0 and out.startswith("removed 1 item(s)")
    assert run_json(capsys, "fetch", "--list-cache")["items"] == []


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_redraws_one_line_for_all_parts_of_a_download():
    stream = FakeTerminal()
    bar = TerminalProgress(stream, min_interval_s=0)
    bar(Progress("Downloading m (part 1/2)", 0, 200))
    bar(Progress("Downloading m (part 1/2)", 100, 200))
    bar(Progress("Downloading m (part 2/2)", 200, 200))
    bar(Progress("Verifying m", 200, 200))
    lines = stream.getvalue().split("\n")
    assert len(lines) == 2  # one line per bar: the download, then the verification
    assert lines[0].count("\r") == 3 and "100%" in lines[0].split("\r")[-1]
    assert lines[1].startswith("\rVerifying m [")


def test_progress_without_a_terminal_prints_a_line_per_stage_only():
    stream = io.StringIO()
    bar = TerminalProgress(stream)
    for done in range(0, 101, 10):
        bar(Progress("Downloading m (part 1/1)", done, 100))
    bar(Progress("Converting m (first use only, about a minute)", 0, 0))
    assert stream.getvalue().splitlines() == [
        "Downloading m: 100 B",
        "Converting m (first use only, about a minute)…",
    ]


def test_progress_bar_counts_other_units_without_a_byte_rate_and_shows_the_detail():
    stream = FakeTerminal()
    bar = TerminalProgress(stream, min_interval_s=0)
    bar(Progress("Benchmark", 3, 12, unit="runs"), detail="code-is-prime · ours 5.20 tok/s")
    bar.close()
    line = stream.getvalue().split("\r")[-1]
    assert line.startswith("Benchmark [######") and " 25% 3 runs/12 runs" in line
    assert "/s ETA" not in line and line.rstrip("\n").endswith("code-is-prime · ours 5.20 tok/s\x1b[K")
    assert stream.getvalue().endswith("\n")  # close() ends the bar's line


def test_a_notice_gets_its_own_line_and_ends_the_bar_it_interrupts():
    stream = FakeTerminal()
    bar = TerminalProgress(stream, min_interval_s=0)
    bar(Progress("Downloading m (part 1/2)", 100, 200))
    bar(
        Progress(
            "m: part 2/2 on disk failed its sha256 check; deleted it, downloading it again", 0, 0, notice=True
        )
    )
    bar(Progress("Downloading m (part 2/2)", 200, 200))
    lines = stream.getvalue().split("\n")
    assert (
        lines[1] == "specdec: m: part 2/2 on disk failed its sha256 check; deleted it, downloading it again"
    )
    assert lines[0].startswith("\rDownloading m (part 1/2) [") and lines[2].startswith("\rDownloading m (part 2/2) [")
