"""`specdec bench` end to end on tiny models: every method runs, the JSON has the
promised schema, our methods reproduce the target's tokens, the files are written."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest
import torch

from specdec_core.errors import SpecdecError
from specdec_core.kernels.cpu.threads import ThreadGovernor, default_governor
from specdec_core.tools.bench import (
    METHODS,
    PEER_METHODS,
    BenchPrompt,
    Run,
    first_divergence,
    geomean,
    llama_server,
    load_prompts,
    measure_bandwidth,
    runner,
    start_peers,
)
from specdec_core.tools.bench.results import Result, prompt_results
from specdec_core.tools.bench.targets import TargetCheck, check_targets
from specdec_core.tools.cli import main
from tests.tiny import perturbed, tiny_model, tiny_tokenizer

PROMPTS = [
    {"id": "code", "category": "code-write", "prompt": "def add(a, b):\n    return a + b\n"},
    {
        "id": "follow-up",
        "category": "multi-turn",
        "system": "Be brief.",
        "history": [
            {"role": "user", "content": "for i in range(10):"},
            {"role": "assistant", "content": "print(i * i)"},
        ],
        "prompt": "The quick brown fox",
    },
]


@pytest.fixture(scope="module")
def pair_dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A tiny target and an exact copy as its draft, saved as HF folders.

    The copy makes every proposed token acceptable; k is pinned (a same-size draft is
    not worth drafting with, so adaptive k would rightly propose nothing).
    """
    root = tmp_path_factory.mktemp("bench-models")
    tok = tiny_tokenizer()
    target = tiny_model(len(tok), seed=0)
    target.generation_config.repetition_penalty = 1.3  # a shipped default bench must not apply
    draft = perturbed(target, scale=0.0)
    for name, model in (("target", target), ("draft", draft)):
        model.save_pretrained(root / name)
        tok.save_pretrained(root / name)
    return root / "target", root / "draft"


@pytest.fixture(scope="module")
def report(pair_dirs: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    target, draft = pair_dirs
    # One thread: tiny matmuls gain nothing from two, and on a busy machine an OpenMP
    # barrier waiting for a descheduled thread costs ~10 ms a call (measured).
    # Pinned through the process's governor: set on torch alone, the governor made during
    # the run would take one thread as the machine's most for every later test.
    threads = torch.get_num_threads()
    governor = default_governor()
    governor.pin(1)
    out = tmp_path_factory.mktemp("bench-out")
    prompts = out / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps(p) for p in PROMPTS) + "\n")
    code = main(
        [
            "bench",
            "--target",
            str(target),
            "--draft",
            str(draft),
            "--device",
            "cpu",
            "--precision",
            "fp32",
            "--prompts",
            str(prompts),
            "--max-new-tokens",
            "16",
            "--repeats",
            "2",
            "--draft-length",
            "3",
            "--warmup-tokens",
            "4",
            "--json",
            str(out / "bench.json"),
            "--markdown",
            str(out / "bench.md"),
            "--plot",
            str(out / "bench.png"),
        ]
    )
    governor.pin(None)
    torch.set_num_threads(threads)
    assert code == 0
    doc = json.loads((out / "bench.json").read_text())
    doc["_out"] = str(out)
    yield doc


def test_every_method_runs_on_every_prompt(report: dict) -> None:
    pairs = {(r["prompt_id"], r["method"]) for r in report["results"]}
    assert pairs == {(p["id"], m) for p in PROMPTS for m in METHODS}
    assert report["config"]["methods"] == list(METHODS)


def test_json_has_the_promised_schema(report: dict) -> None:
    assert set(report) >= {"config", "machine", "results", "summary"}
    for r in report["results"]:
        for key in (
            "prompt_id",
            "category",
            "method",
            "new_tokens",
            "seconds",
            "tokens_per_s",
            "speedup_vs_target",
            "identical_to_target",
            "first_divergence",
        ):
            assert key in r
        assert r["new_tokens"] > 0 and r["seconds"] > 0 and len(r["seconds_all"]) == 2
        if r["method"] == "target":
            assert r["speedup_vs_target"] == pytest.approx(1.0)
        if r["method"].startswith("ours-") and r["method"] != "ours-off":
            e = r["engine"]
            assert 0.0 <= e["acceptance_rate"] <= 1.0
            assert e["theoretical_speedup"] > 0 and "k_histogram" in e
    label = report["config"]["exactness"]["label"]  # the self-check ran once for the pair
    assert label in ("bitwise", "near-ties may differ")
    assert all(r["engine"]["exactness"] == label for r in report["results"] if r["engine"])
    summary = report["summary"]["methods"]
    assert set(summary) == set(METHODS)
    assert set(summary["ours-draft"]) == {"all", "code-write", "multi-turn"}
    assert {t["name"] for t in report["summary"]["targets"]} >= {"ours-draft vs hf-assisted"}


def test_our_methods_reproduce_the_target_exactly(report: dict) -> None:
    ours = [r for r in report["results"] if r["method"].startswith("ours-")]
    assert ours and all(r["identical_to_target"] for r in ours)
    assert report["summary"]["methods"]["ours-draft"]["all"]["identity_rate"] == 1.0


def test_an_exact_copy_draft_has_every_proposal_accepted(report: dict) -> None:
    draft = [r["engine"] for r in report["results"] if r["method"] == "ours-draft"]
    assert all(e["mean_k"] > 0 and e["acceptance_rate"] == 1.0 for e in draft)


def test_markdown_and_plot_are_written(report: dict) -> None:
    out = Path(report["_out"])
    text = (out / "bench.md").read_text()
    assert "| ours-draft |" in text and "Targets" in text and "follow-up" in text
    assert f"exactness self-check: {report['config']['exactness']['summary']}" in text
    assert (out / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_default_suite_covers_the_issue_categories() -> None:
    prompts = load_prompts()
    assert len(prompts) >= 16
    assert {p.category for p in prompts} >= {
        "code-write",
        "code-edit",
        "summarise",
        "prose",
        "factual-qa",
        "arithmetic",
        "multi-turn",
    }
    assert any(p.history for p in prompts)


def test_bad_prompt_line_names_the_line(tmp_path: Path) -> None:
    bad = tmp_path / "p.jsonl"
    bad.write_text('{"id": "a", "category": "x", "prompt": "hi"}\n{"id": "b"}\n')
    with pytest.raises(SpecdecError, match="line 2"):
        load_prompts(bad)


def test_the_method_order_rotates_so_each_runs_first_as_often(monkeypatch: pytest.MonkeyPatch) -> None:
    # Run always in one place (right after the peer's server, say), a method would carry
    # whatever that place does to the machine into every comparison.
    calls: list[str] = []

    class Recorded:
        def __init__(self, name: str) -> None:
            self.name = name

        def run(self, prompt_ids: list[int], max_new_tokens: int) -> Run:
            calls.append(self.name)
            return Run(token_ids=(1,) * max_new_tokens, seconds=1.0)

    monkeypatch.setattr(runner, "encode_prompt", lambda tokenizer, prompt: [1, 2, 3])
    methods = {name: Recorded(name) for name in ("target", "ours-draft", "ours-auto")}
    prompts = [BenchPrompt("a", "c", "hi"), BenchPrompt("b", "c", "ho")]
    runner.run_bench(methods, prompts, None, runner.BenchSettings(max_new_tokens=2, repeats=3))
    timed = calls[len(methods) :]  # after the warm-up
    firsts = timed[:: len(methods)]
    assert sorted(timed) == sorted(list(methods) * 6)
    assert {name: firsts.count(name) for name in methods} == {name: 2 for name in methods}


def test_first_divergence_and_geomean() -> None:
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 9, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2
    assert geomean([2.0, 0.5]) == pytest.approx(1.0)
    assert BenchPrompt("a", "c", "hi").messages[-1].content == "hi"


def test_a_saved_run_renders_again_without_models(report: dict, tmp_path: Path) -> None:
    out = tmp_path / "again.md"
    code = main(["bench", "--from-json", str(Path(report["_out"]) / "bench.json"), "--markdown", str(out)])
    assert code == 0
    assert out.read_text() == (Path(report["_out"]) / "bench.md").read_text()


def test_cost_curve_times_every_size(pair_dirs: tuple[Path, Path], tmp_path: Path) -> None:
    target, draft = pair_dirs
    out, text = tmp_path / "curve.json", tmp_path / "curve.md"
    args = ["bench", "--target", str(target), "--draft", str(draft), "--precision", "fp32"]
    assert main([*args, "--cost-curve", "--json", str(out), "--markdown", str(text)]) == 0
    doc = json.loads(out.read_text())
    assert set(doc["target_min"]) == {"1", "2", "3", "4", "5", "6", "8", "10", "12", "16"}
    assert doc["draft_min"] > 0
    assert doc["step_bytes"]["target"]["weights"] > 0 and doc["step_bytes"]["draft"]["kv_cache"] > 0
    assert doc["bandwidth_bytes_per_s"] > 0
    assert doc["bandwidth_one_thread_bytes_per_s"] > 0
    assert "one thread streams" in text.read_text()


def test_bandwidth_is_measured_at_the_thread_count_asked_for_and_the_count_restored() -> None:
    threads = torch.get_num_threads()
    seen = []
    real_sum = torch.Tensor.sum

    def spy(self, *args, **kwargs):
        seen.append(torch.get_num_threads())
        return real_sum(self, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.Tensor, "sum", spy)
        assert measure_bandwidth(gib=0.01, repeats=2, threads=1) > 0
    assert seen == [1, 1] and torch.get_num_threads() == threads


# -- the peer: llama.cpp's server, played by a fake one --------------------------------------

FAKE_SERVER = r"""
import json, os, sys
from http.server import BaseHTTPRequestHandler, HTTPServer

args = sys.argv[1:]
opt = lambda name: args[args.index(name) + 1] if name in args else None
with open(os.environ["FAKE_LLAMA_ARGS"], "a") as f:
    f.write(json.dumps(args) + "\n")
draft = opt("--spec-draft-model")


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def send(self, code, doc):
        body = json.dumps(doc).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        self.send(200 if self.path == "/health" else 404, {"status": "ok"})

    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert req["temperature"] == 0 and req["cache_prompt"] is False
        tokens = [(req["prompt"][-1] + i) % 7 for i in range(req["n_predict"])]
        if draft:
            tokens[2] = 99  # its speculation changes its own text at token 2
        timings = {"prompt_ms": 10.0, "predicted_ms": 30.0 if draft else 70.0}
        self.send(200, {"tokens": tokens, "content": "x", "timings": timings})


HTTPServer((opt("--host"), int(opt("--port"))), Handler).serve_forever()
"""


@pytest.fixture
def fake_llama_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    binary = tmp_path / "llama-server"
    binary.write_text(f"#!{sys.executable}\n{FAKE_SERVER}")
    binary.chmod(0o755)
    argv_log = tmp_path / "argv.jsonl"
    monkeypatch.setenv("FAKE_LLAMA_ARGS", str(argv_log))
    return binary, argv_log


def test_llama_server_runs_the_same_ggufs_at_our_threads_and_is_judged_by_its_own_text(
    fake_llama_server: tuple[Path, Path], tmp_path: Path
) -> None:
    binary, argv_log = fake_llama_server
    target_gguf, draft_gguf = tmp_path / "t.gguf", tmp_path / "d.gguf"
    target_gguf.write_bytes(b"GGUF"), draft_gguf.write_bytes(b"GGUF")
    with ExitStack() as stack:
        peers, skipped = start_peers(
            PEER_METHODS, str(target_gguf), str(draft_gguf), 3, stack, binary=binary, log_dir=tmp_path
        )
        assert skipped == {} and set(peers) == set(PEER_METHODS)
        runs = {name: [peers[name].run([5, 6, 7], 6)] for name in PEER_METHODS}
        servers = [p.server.process for p in peers.values()]
    assert all(process.poll() is not None for process in servers)  # stopped with the bench
    plain, spec = (json.loads(line) for line in argv_log.read_text().splitlines())
    if "--spec-draft-model" in plain:
        plain, spec = spec, plain
    for argv in (plain, spec):
        assert argv[argv.index("-m") + 1] == str(target_gguf)
        assert argv[argv.index("--host") + 1] == "127.0.0.1"
        assert argv[argv.index("-t") + 1] == "3" and argv[argv.index("-tb") + 1] == "3"
    assert spec[spec.index("--spec-draft-model") + 1] == str(draft_gguf)
    assert runs["llama-server"][0].seconds == pytest.approx(0.08)  # its own timings: prompt + decode

    runs["target"] = [Run(token_ids=(1, 2, 3, 4, 5, 6), seconds=0.12)]
    results = {r.method: r for r in prompt_results(BenchPrompt("p", "c", "hi"), 3, runs)}
    spec_result = results["llama-server-draft"]
    assert spec_result.reference == "llama-server"
    assert not spec_result.identical_to_target and spec_result.first_divergence == 2
    assert spec_result.speedup_vs_llama_server == pytest.approx(2.0)
    assert results["llama-server"].speedup_vs_target == pytest.approx(1.5)


def test_llama_server_is_skipped_with_the_reason_when_absent(
    report: dict, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # The tiny models are HF folders, not GGUF files: the bench ran without the peer.
    assert set(report["config"]["skipped_methods"]) == set(PEER_METHODS)
    assert all(reason for reason in report["config"]["skipped_methods"].values())
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path))  # no build for this CPU either
    monkeypatch.setattr(llama_server, "BINARY_NAMES", ("no-such-llama-server",))
    gguf = tmp_path / "t.gguf"
    gguf.write_bytes(b"GGUF")
    with ExitStack() as stack:
        peers, skipped = start_peers(["llama-server"], str(gguf), None, 2, stack)
    assert peers == {} and "no llama-server found" in skipped["llama-server"]


def test_a_server_built_for_another_cpu_is_skipped_with_the_signal_named(tmp_path: Path) -> None:
    # An AVX-512 build on an AVX2 CPU logs a line, then dies at its first unknown instruction.
    binary = tmp_path / "llama-server"
    script = "import os, signal\nprint('AMX is not ready')\nos.kill(os.getpid(), signal.SIGILL)\n"
    binary.write_text(f"#!{sys.executable}\n{script}")
    binary.chmod(0o755)
    gguf = tmp_path / "t.gguf"
    gguf.write_bytes(b"GGUF")
    with ExitStack() as stack:
        peers, skipped = start_peers(
            ["llama-server"], str(gguf), None, 2, stack, binary=binary, log_dir=tmp_path
        )
    assert peers == {}
    assert "killed by SIGILL" in skipped["llama-server"] and "this CPU lacks" in skipped["llama-server"]


def _result(prompt_id: str, category: str, method: str, tokens_per_s: float) -> Result:
    return Result(prompt_id, category, method, 10, 96, 96 / tokens_per_s, tokens_per_s, 1.0, None, True, None, [])


def _bar(name: str) -> TargetCheck:
    return next(c for c in check_targets(BAR_RESULTS) if c.name == name)


BAR_RESULTS = [
    _result(prompt_id, category, method, tps)
    for prompt_id, category, rates in [
        ("edit", "code-edit", {"target": 10.0, "ours-off": 20.0, "ours-auto": 30.0, "ours-ngram": 33.0}),
        ("sum", "summarise", {"target": 10.0, "ours-off": 20.0, "ours-auto": 19.0, "ours-ngram": 18.0}),
    ]
    for method, tps in rates.items()
]


def test_bars_against_our_own_plain_decoding_are_stricter_than_against_transformers() -> None:
    assert _bar("ours-auto worst prompt vs target").value == pytest.approx(1.9)
    worst_vs_off = _bar("ours-auto worst prompt vs ours-off")
    assert worst_vs_off.value == pytest.approx(0.95) and worst_vs_off.met
    assert _bar("ours-auto vs ours-off on code-edit").value == pytest.approx(1.5)
    assert _bar("ours-auto vs ours-off on code-edit").met is None  # reported, not judged


def test_a_bar_takes_the_better_of_its_references_per_prompt() -> None:
    best_source = _bar("ours-auto worst prompt vs best of ours-draft/ours-ngram")
    assert best_source.value == pytest.approx(30.0 / 33.0) and best_source.met is False


def test_a_bar_whose_methods_did_not_run_is_not_applicable() -> None:
    peer = _bar("ours-off vs llama-server plain")
    assert peer.value is None and peer.met is None


def test_the_peers_own_cpu_time_is_not_taken_for_a_neighbours_load(monkeypatch: pytest.MonkeyPatch) -> None:
    class CountingProbe:
        calls = 0

        def others_busy(self) -> float:
            self.calls += 1
            return 2.0  # both cores: the server answering while our engine waited

    class AnsweringServer:
        def complete(self, prompt_ids: list[int], max_new_tokens: int, decoding: object = None) -> dict:
            return {"tokens": [5, 6], "timings": {"prompt_ms": 10.0, "predicted_ms": 20.0}}

    probe = CountingProbe()
    governor = ThreadGovernor(max_threads=2, cores=2, probe=probe)
    monkeypatch.setattr(llama_server, "default_governor", lambda: governor)
    run = llama_server.LlamaServerMethod("llama-server", AnsweringServer()).run([1, 2], 2)  # type: ignore[arg-type]
    assert run.token_ids == (5, 6) and run.seconds == pytest.approx(0.03)
    assert probe.calls == 1  # the window restarted after the request: the next check starts clean


def test_the_machine_line_names_the_kernels_build_and_old_results_still_render() -> None:
    from specdec_core.tools.bench.render import machine_info, machine_line

    machine = machine_info()
    assert machine["cpu_kernels"] in (None, "avx2", "avx512-vnni", "scalar")
    machine["cpu_kernels"] = "avx2"
    assert "C kernels for avx2" in machine_line(machine)
    del machine["cpu_kernels"]  # a result file written before the key existed
    assert "C kernels" not in machine_line(machine)


@pytest.mark.parametrize(
    ("methods", "message"),
    [("ours-auto", "must include 'target'"), ("target,ours-fast", "unknown method(s) ours-fast")],
)
def test_a_bad_method_list_is_refused_before_any_model_loads(monkeypatch, capsys, methods, message):
    from specdec_core.models import loading

    def must_not_load(*args, **kwargs):
        raise AssertionError("a model was loaded before the methods were checked")

    monkeypatch.setattr(loading, "load_model", must_not_load)
    assert main(["bench", "--methods", methods, "--limit", "1"]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.skipif(not Path("/proc/cpuinfo").is_file(), reason="no /proc/cpuinfo")
def test_the_peer_by_default_is_llama_cpp_built_for_this_cpu_its_no_amx_build_first(tmp_path, monkeypatch):
    import hashlib
    import subprocess

    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path))
    script = Path(__file__).parent.parent / "scripts" / "build-llama-cpp"
    assert f"VERSION={llama_server.LLAMA_CPP_VERSION}\n" in script.read_text()
    # The script's own name for this CPU model's build folder.
    line = subprocess.run(["grep", "-m1", "model name", "/proc/cpuinfo"], capture_output=True, text=True).stdout
    if not line:
        pytest.skip("this CPU names no model in /proc/cpuinfo")
    cpu = hashlib.sha256((line.split(":", 1)[1]).encode()).hexdigest()[:12]
    root = tmp_path / "llama.cpp" / f"{llama_server.LLAMA_CPP_VERSION}-{cpu}" / "src" / "vendor" / "llama.cpp"
    assert llama_server.built_for_this_cpu() is None
    for build in ("build", "build-noamx"):
        binary = root / build / "bin" / "llama-server"
        binary.parent.mkdir(parents=True)
        binary.write_text("")
        assert llama_server.find_llama_server() == binary


def sampled_bench(pair_dirs: tuple[Path, Path], out: Path, seed: int) -> dict:
    target, draft = pair_dirs
    out.mkdir()
    prompts = out / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps(p) for p in PROMPTS) + "\n")
    governor = default_governor()
    governor.pin(1)
    try:
        code = main([
            "bench", "--target", str(target), "--draft", str(draft), "--device", "cpu", "--precision", "fp32",
            "--prompts", str(prompts), "--max-new-tokens", "12", "--draft-length", "3", "--warmup-tokens", "4",
            "--methods", "target,ours-off,ours-draft", "--temperature", "0.8", "--top-p", "0.9",
            "--seed", str(seed), "--json", str(out / "bench.json"), "--markdown", str(out / "bench.md"),
        ])  # fmt: skip
    finally:
        governor.pin(None)
    assert code == 0
    return json.loads((out / "bench.json").read_text())


def test_a_sampled_bench_draws_every_method_seeded_and_does_not_compare_texts(pair_dirs, tmp_path):
    first = sampled_bench(pair_dirs, tmp_path / "a", seed=5)
    again = sampled_bench(pair_dirs, tmp_path / "b", seed=5)
    assert first["config"]["decoding"] == {"temperature": 0.8, "top_k": 0, "top_p": 0.9, "seed": 5}
    assert all(r["sampled"] for r in first["results"])
    assert first["summary"]["methods"]["ours-draft"]["all"]["identity_rate"] is None
    assert "**no** (token" not in (tmp_path / "a" / "bench.md").read_text()  # no text is called different
    tokens = {(r["prompt_id"], r["method"]): r["new_tokens"] for r in first["results"]}
    assert tokens == {(r["prompt_id"], r["method"]): r["new_tokens"] for r in again["results"]}


def test_a_negative_temperature_is_refused_in_one_line(pair_dirs, capsys):
    target, _ = pair_dirs
    assert main(["bench", "--target", str(target), "--draft", "ngram", "--temperature", "-1"]) != 0
    err = capsys.readouterr().err.strip()
    assert err.startswith("specdec: error: --temperature") and "\n" not in err
