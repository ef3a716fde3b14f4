"""Bad input never gets in: every case is one line, exit code 2 (1 for a bug), nothing run that should not be."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tiny import tiny_model

from specdec_core.engine.speculative import GenerationParams
from specdec_core.errors import ChatTemplateError, ModelLoadError, OutOfMemory
from specdec_core.models import loading
from specdec_core.models.chat import Message, encode_chat
from specdec_core.session import ChatSession, LoadSpec
from specdec_core.tools import cli


def run_cli(capsys, *args: str, code: int = 2) -> str:
    """`specdec generate ...` in-process; the last stderr line, which must be the one error line."""
    assert cli.main(["generate", "--device", "cpu", "--precision", "fp32", *args]) == code
    err = capsys.readouterr().err.strip().splitlines()[-1]  # earlier lines: load progress
    assert err.startswith("specdec: error: ") and "Traceback" not in err
    return err


def copy_of(folder: Path, tmp_path: Path, name: str) -> Path:
    dest = tmp_path / name
    shutil.copytree(folder, dest)
    return dest


# -- models must be what they claim ------------------------------------------------------------


def test_a_base_model_is_not_loaded_with_a_fresh_head(capsys, tmp_path, tokenizer):
    from transformers import BertConfig, BertModel

    folder = tmp_path / "bert"
    config = BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=1,
                        num_attention_heads=2, intermediate_size=64)  # fmt: skip
    BertModel(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    err = run_cli(capsys, "--target", str(folder), "--prompt", "hi")
    assert "not a causal language model (BertModel)" in err


def test_a_checkpoint_without_its_head_and_norm_is_refused_naming_the_keys(tmp_path, tiny_folder):
    from safetensors.torch import load_file, save_file

    folder = copy_of(tiny_folder, tmp_path, "headless")
    weights = load_file(folder / "model.safetensors")
    del weights["lm_head.weight"], weights["model.norm.weight"]
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"missing weights: lm_head.weight, model.norm.weight"):
        loading.load_model(str(folder), device="cpu", precision="fp32")


def test_tied_embeddings_are_not_missing_weights(tmp_path, tokenizer):
    from transformers import Qwen2ForCausalLM

    config = tiny_model(len(tokenizer)).config
    config.tie_word_embeddings = True
    folder = tmp_path / "tied"
    Qwen2ForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    loaded = loading.load_model(str(folder), device="cpu", precision="fp32")
    assert loaded.model.lm_head.weight is loaded.model.get_input_embeddings().weight


@pytest.mark.parametrize("damage", ["truncated", "header"])
def test_damaged_weights_are_one_line(capsys, tmp_path, tiny_folder, damage):
    folder = copy_of(tiny_folder, tmp_path, damage)
    weights = folder / "model.safetensors"
    data = bytearray(weights.read_bytes())
    if damage == "truncated":
        data = data[: len(data) // 2]
    else:
        data[12:24] = b"\xff" * 12
    weights.write_bytes(bytes(data))
    assert "damaged or incomplete" in run_cli(capsys, "--target", str(folder), "--prompt", "hi")


def test_custom_code_never_runs_without_our_flag(capsys, tmp_path, tiny_folder):
    folder = copy_of(tiny_folder, tmp_path, "custom")
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="mystery_lm", architectures=["MysteryForCausalLM"],
                  auto_map={"AutoConfig": "configuration_mystery.MysteryConfig",
                            "AutoModelForCausalLM": "modeling_mystery.MysteryForCausalLM"})  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config))
    marker = tmp_path / "custom-code-ran"
    (folder / "configuration_mystery.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    err = run_cli(capsys, "--target", str(folder), "--prompt", "hi")
    assert "--trust-remote-code" in err and "mystery_lm" in err
    assert not marker.exists()


def test_an_unknown_model_type_is_one_line(capsys, tmp_path, tiny_folder):
    folder = copy_of(tiny_folder, tmp_path, "unknown")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "nonesuch"}))
    assert "unknown model type 'nonesuch'" in run_cli(capsys, "--target", str(folder), "--prompt", "hi")


def test_a_malformed_hub_id_is_one_line(capsys):
    assert "not a model folder" in run_cli(capsys, "--target", "a/..", "--prompt", "hi")


def test_an_mmap_failure_is_one_line(monkeypatch, tiny_folder):
    from transformers import AutoModelForCausalLM

    def no_address_space(*args, **kwargs):
        raise RuntimeError(
            "unable to mmap 1803550 bytes from file <model.safetensors>: Cannot allocate memory (12)"
        )

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", no_address_space)
    with pytest.raises(ModelLoadError, match=r"cannot map the weights into memory .* \(ulimit -v\)"):
        loading.load_model(str(tiny_folder), device="cpu", precision="fp32")


def test_out_of_memory_while_loading_is_one_line(monkeypatch, tiny_folder):
    from transformers import AutoModelForCausalLM

    def too_big(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", too_big)
    with pytest.raises(OutOfMemory, match="try --precision bf16"):
        ChatSession().load(LoadSpec(str(tiny_folder), device="cpu", precision="fp32"))


# -- prompts and templates ---------------------------------------------------------------------


def test_a_hostile_chat_template_is_one_line(capsys, tmp_path, tiny_folder):
    folder = copy_of(tiny_folder, tmp_path, "hostile")
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    config_path.write_text(json.dumps(config))
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    err = run_cli(capsys, "--target", str(folder), "--prompt", "hi", "--draft", "none", "--no-calibrate")
    assert "chat template failed" in err and "SecurityError" in err


def test_a_looping_chat_template_is_stopped_in_time(tokenizer):
    import copy

    looping = copy.deepcopy(tokenizer)
    looping.chat_template = "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}"
    with pytest.raises(ChatTemplateError, match=r"ran longer than 0\.2 s"):
        encode_chat(looping, [Message("user", "hi")], time_limit_s=0.2)


def test_an_empty_raw_prompt_is_one_line(capsys, tiny_folder):
    err = run_cli(capsys, "--target", str(tiny_folder), "--prompt", "", "--raw")
    assert "--prompt is empty" in err


def test_invalid_utf8_in_the_prompt_is_one_line(tiny_folder):
    """Real argv bytes: only a fresh process gets them the way a terminal passes them."""
    script = Path(sys.executable).parent / "specdec"
    cmd = [str(script), "generate", "--target", str(tiny_folder), "--prompt", b"caf\xff"]
    out = subprocess.run(cmd, capture_output=True, timeout=300)
    err = out.stderr.decode().strip().splitlines()
    assert out.returncode == 2 and len(err) == 1
    assert "--prompt is not valid UTF-8 text (byte 0xff at character 3)" in err[0]


# -- sampling parameters are checked before anything loads -------------------------------------


@pytest.mark.parametrize(
    ("flag", "value", "allowed"),
    [
        ("--temperature", "nan", "a number ≥ 0"),
        ("--temperature", "-1", "a number ≥ 0"),
        ("--top-p", "0", "a number in (0, 1]"),
        ("--top-p", "2", "a number in (0, 1]"),
        ("--top-k", "-3", "a whole number ≥ 0"),
        ("--max-new-tokens", "0", "a whole number ≥ 1"),
        ("--max-new-tokens", "-5", "a whole number ≥ 1"),
    ],
)
def test_parameters_out_of_range_fail_before_loading(capsys, tmp_path, flag, value, allowed):
    # The target does not exist: the parameter's line proves nothing was loaded first.
    err = run_cli(capsys, "--target", str(tmp_path / "nowhere"), "--prompt", "hi", flag, value)
    assert err.startswith(f"specdec: error: {flag} must be {allowed}")


# -- context: refused when too long, stopped at the last position ------------------------------


def test_gpt2_style_models_stop_at_their_last_position(tmp_path, tokenizer):
    from transformers import GPT2Config, GPT2LMHeadModel

    folder = tmp_path / "gpt2"
    config = GPT2Config(vocab_size=len(tokenizer), n_positions=32, n_embd=32, n_layer=1, n_head=2)
    torch.manual_seed(0)
    GPT2LMHeadModel(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    session = ChatSession()
    session.load(LoadSpec(str(folder), draft="ngram", device="cpu", precision="fp32"))
    events = list(session.answer([Message("user", "hi")], params=GenerationParams(max_new_tokens=100)))
    stats = events[-1].stats
    # Seeded: this model does not stop by itself before its 32 positions are full.
    assert stats.stop_reason == "context_full"
    assert stats.prompt_tokens + stats.new_tokens == 32


# -- start-up, internal errors, versions -------------------------------------------------------


def test_ctrl_c_during_start_up_is_one_line(capsys, monkeypatch):
    def interrupted():
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "build_parser", interrupted)
    assert cli.main(["generate"]) == 130
    assert capsys.readouterr().err == "specdec: interrupted\n"


def test_the_command_starts_without_importing_torch():
    """Everything heavy is imported inside main's handlers, where Ctrl-C is one line."""
    code = "import sys, specdec_core.tools.cli; print(sorted({'torch', 'transformers'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "[]", out.stderr


def test_a_bug_is_one_line_with_exit_code_1(capsys, monkeypatch, tiny_folder):
    def broken(self, *args, **kwargs):
        raise AssertionError("an invariant broke")

    monkeypatch.setattr(ChatSession, "calibrate", broken)
    err = run_cli(capsys, "--target", str(tiny_folder), "--prompt", "hi", code=1)
    assert "internal error: AssertionError: an invariant broke" in err


def test_an_old_transformers_is_refused_in_one_line_before_anything_loads(monkeypatch, capsys):
    from importlib import metadata

    from specdec_core.models import requirements

    monkeypatch.setattr(metadata, "version", lambda name: "5.0.0")
    with pytest.raises(ImportError) as err:
        requirements.check_requirements()
    assert "transformers>=5.24.0,<6.0.0 but 5.0.0 is installed" in str(err.value)
    assert "\n" not in str(err.value)
    run_cli(capsys, "--prompt", "hi", code=1)  # the command refuses before reading any argument


# -- CUDA sizing (by reading: the GPU is faked) ------------------------------------------------


def test_parameters_are_counted_alike_for_bf16_and_fp32_checkpoints(tmp_path, target):
    import copy

    target.save_pretrained(tmp_path / "fp32")
    copy.deepcopy(target).to(torch.bfloat16).save_pretrained(tmp_path / "bf16")  # the fixture stays fp32
    expected = sum(p.numel() for p in target.parameters())
    assert loading.checkpoint_parameters(tmp_path / "fp32") == expected
    assert loading.checkpoint_parameters(tmp_path / "bf16") == expected


@pytest.mark.parametrize(
    ("free_gib", "offload", "expected"),
    [(3.0, False, "bf16"), (1.5, False, "nf4"), (0.5, False, None), (0.5, True, "bf16")],
)
def test_auto_precision_on_cuda_fits_the_weights_in_free_memory(monkeypatch, free_gib, offload, expected):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (int(free_gib * 2**30), 80 * 2**30))
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    one_billion = 10**9  # 1.86 GiB at bf16, 0.52 GiB at nf4
    if expected is None:
        with pytest.raises(OutOfMemory, match="--offload"):
            loading.resolve_precision("auto", "cuda", one_billion, offload=offload)
    else:
        assert loading.resolve_precision("auto", "cuda", one_billion, offload=offload) == expected


def test_offload_lets_accelerate_place_the_layers():
    assert loading.placement("cuda", "bf16", offload=True)["device_map"] == "auto"
    assert loading.placement("cuda", "bf16", offload=False)["device_map"] == {"": 0}


def test_a_reader_that_goes_away_ends_the_command_quietly(capsys, monkeypatch, tiny_folder):
    """`specdec generate ... | head -c 1`: no traceback, no error line, exit 141 like cat."""

    class ClosedPipe:
        def write(self, text: str) -> int:
            raise BrokenPipeError(32, "Broken pipe")

        def flush(self) -> None:
            raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(sys, "stdout", ClosedPipe())
    args = ["generate", "--target", str(tiny_folder), "--prompt", "hi", "--draft", "none", "--no-calibrate"]
    assert cli.main([*args, "--device", "cpu", "--precision", "fp32"]) == 141
    assert "error" not in capsys.readouterr().err


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_loaded_model_runs_its_own_layers_not_hub_kernels(tiny_folder, precision):
    # Kernelizing needs the network and replaces the layers the exactness hooks are made for.
    model = loading.load_model(str(tiny_folder), device="cpu", precision=precision).model
    assert model.use_kernels is False
    assert loading.placement("cuda", "nf4", offload=False)["use_kernels"] is False
