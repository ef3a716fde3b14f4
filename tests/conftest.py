"""Shared fixtures: tiny models and tokenizers built in-process (no network)."""

from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # unit tests never reach a hub

from specdec_core import prepare_process

prepare_process()  # as the product's entry points do, before torch loads

from tiny import perturbed, tiny_model, tiny_tokenizer  # noqa: E402 (torch loads after prepare_process)


@pytest.fixture(scope="session")
def tokenizer():
    return tiny_tokenizer()


@pytest.fixture(scope="session")
def target(tokenizer):
    return tiny_model(len(tokenizer), seed=0)


@pytest.fixture(scope="session")
def tiny_folder(tmp_path_factory, tokenizer, target) -> Path:
    """An HF folder (config, safetensors, tokenizer) holding the tiny target."""
    folder = tmp_path_factory.mktemp("tiny-target")
    target.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def sibling_folder(tmp_path_factory, tokenizer, target) -> Path:
    """Another model of the same vocabulary (a perturbed copy of the target): a draft."""
    folder = tmp_path_factory.mktemp("sibling")
    perturbed(target, 0.05).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(autouse=True)
def _collect_on_the_main_thread():
    """The app collects garbage on the UI thread only (specdec_app.gc_guard); tests that never spin
    the event loop collect here, between tests, so memory does not pile up."""
    yield
    if not gc.isenabled():
        from specdec_app.gc_guard import collect_due

        collect_due()


@pytest.fixture(autouse=True, scope="session")
def _check_the_cache_after_every_forward():
    """Every forward asserts that the KV cache holds exactly the tokens it believes it holds."""
    from specdec_core.kernels.cpu import runner as kvcache

    kvcache.CHECK_INVARIANT = True
    yield


@pytest.fixture(autouse=True, scope="session")
def _self_checks_finish_whatever_the_load():
    """The suite shares its cores with other processes: a self-check cut short by its time
    budget would make a test's label depend on the machine's load. Tests about the budget
    pass their own (tests/test_selfcheck.py)."""
    from specdec_core.engine import selfcheck

    saved = selfcheck.BUDGET_S
    selfcheck.BUDGET_S = 600.0
    yield
    selfcheck.BUDGET_S = saved
