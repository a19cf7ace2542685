"""The command line, run as a user would: `python -m selfspec ...` in a subprocess, on a
tiny model saved to a temporary directory (safetensors + a word-level tokenizer).

Every bad input must exit with status 2 and print exactly one line on stderr, never a
traceback, argparse's own parsing errors (an unknown choice, a value of the wrong type)
included."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import selfspec
from selfspec.config import DraftConfig
from selfspec.profiles import Profile, save_profile

from helpers import VOCAB, ar_generate, build_hf, word_tokenizer

ROOT = Path(__file__).resolve().parent.parent


def run_cli(*args, stdin: str | None = None, timeout: int = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", COLUMNS="200", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONWARNINGS="ignore")
    env.pop("SELFSPEC_DEBUG", None)
    return subprocess.run(
        [sys.executable, "-m", "selfspec", *args],
        input=stdin if stdin is not None else "",
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=timeout,
    )


def assert_user_error(r: subprocess.CompletedProcess, *fragments: str) -> str:
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2, f"exit {r.returncode}; stderr:\n{r.stderr}"
    assert "Traceback" not in r.stderr and "Traceback" not in r.stdout
    assert len(lines) == 1, f"expected one line on stderr, got:\n{r.stderr}"
    assert lines[0].startswith("selfspec: error:")
    for f in fragments:
        assert f.lower() in lines[0].lower(), lines[0]
    return lines[0]


def _save(d: Path, **config_kw) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    build_hf("llama", seed=0, **config_kw).save_pretrained(d)
    word_tokenizer(VOCAB).save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return _save(tmp_path_factory.mktemp("cli") / "tiny")


def gen(model_dir, prompt, *extra):
    return run_cli("generate", prompt, "--model", str(model_dir), "--dtype", "float32", "--device", "cpu", *extra)


def gen_ar(model_dir, prompt, *extra) -> dict:
    """The CLI's plain decoding, pinned and checked to be plain (the default strategy drafts)."""
    r = gen(model_dir, prompt, "--json", "--strategy", "autoregressive", *extra)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["strategy"]["strategy"] == "autoregressive"
    assert out["stats"]["drafted"] == 0 and out["stats"]["per_position_drafted"] == []
    return out


def test_generate_json(model_dir):
    r = gen(model_dir, "the cat sat on the", "--max-new-tokens", "12", "--json")
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr
    out = json.loads(r.stdout)
    assert isinstance(out["text"], str) and out["text"]
    assert len(out["token_ids"]) == 12 and all(isinstance(t, int) for t in out["token_ids"])
    assert out["prompt_tokens"] == 5
    assert out["finish_reason"] == "length"
    s = out["stats"]
    assert s["new_tokens"] == 12
    assert s["time_s"] > 0
    assert s["tokens_per_second"] == pytest.approx(12 / s["time_s"], rel=1e-6)
    assert out["strategy"]["strategy"] == "auto"  # the default
    # greedy: the same ids as plain decoding in the library, and the text is the decoded ids
    m = selfspec.load(str(model_dir), dtype="float32", device="cpu")
    ref = ar_generate(m, "the cat sat on the", max_new_tokens=12)
    assert out["token_ids"] == ref.token_ids
    assert out["text"] == ref.text == m.tokenizer.decode(ref.token_ids, skip_special_tokens=True)


def test_generate_speculative_json_equals_autoregressive(model_dir):
    ar = gen_ar(model_dir, "hello world", "--max-new-tokens", "16")
    r = gen(model_dir, "hello world", "--max-new-tokens", "16", "--json", "--strategy", "early-exit",
            "--exit-layer", "2", "--num-speculations", "3")
    assert r.returncode == 0, r.stderr
    ee = json.loads(r.stdout)
    assert ee["token_ids"] == ar["token_ids"]
    assert ee["strategy"]["strategy"] == "early-exit" and ee["strategy"]["exit_layer"] == 2
    assert ee["stats"]["verify_steps"] >= 1 and len(ee["stats"]["per_position_drafted"]) == 3


def test_seeded_sampling_is_one_text_on_the_cli(model_dir):
    """--coupling gumbel (the default): a seeded speculative text is the seeded autoregressive one;
    --coupling rejection is today's rule (reproducible by its seed, the draft's own text)."""
    opts = ["--max-new-tokens", "16", "--temperature", "1.0", "--top-p", "0.9", "--seed", "7"]
    ar = gen_ar(model_dir, "hello world", *opts)
    r = gen(model_dir, "hello world", *opts, "--json", "--strategy", "early-exit", "--exit-layer", "2")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["token_ids"] == ar["token_ids"]
    again = [gen(model_dir, "hello world", *opts, "--json", "--strategy", "early-exit", "--exit-layer", "2",
                 "--coupling", "rejection") for _ in range(2)]
    assert all(a.returncode == 0 for a in again)
    assert json.loads(again[0].stdout)["token_ids"] == json.loads(again[1].stdout)["token_ids"]
    assert_user_error(run_cli("generate", "hi", "--model", str(model_dir), "--coupling", "gumble"), "did you mean gumbel?")


def test_generate_plain_output(model_dir):
    r = gen(model_dir, "one two three", "--max-new-tokens", "6", "--stream-style", "none",
            "--strategy", "layer-skip", "--skip-mlp", "1,2")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip()
    assert "tokens" in r.stderr and "Traceback" not in r.stderr


def test_prompt_from_stdin(model_dir):
    r = run_cli("generate", "-", "--model", str(model_dir), "--dtype", "float32", "--max-new-tokens", "8", "--json",
                stdin="the cat sat on the")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    direct = json.loads(gen(model_dir, "the cat sat on the", "--max-new-tokens", "8", "--json").stdout)
    assert out["token_ids"] == direct["token_ids"]
    assert out["prompt_tokens"] == 5


def test_models_lists_default_and_architectures():
    r = run_cli("models")
    assert r.returncode == 0, r.stderr
    assert "gemma-3-270m" in r.stdout
    for arch in ("llama", "mistral", "qwen2", "qwen3", "gemma3_text"):
        assert arch in r.stdout


# ---- bad inputs: exit 2, one line, no traceback -------------------------------------------


def test_missing_model_path(tmp_path):
    r = gen(tmp_path / "does-not-exist", "hello")
    assert_user_error(r, "not found")


def test_directory_without_config(tmp_path):
    assert_user_error(gen(tmp_path, "hello"), "config.json")


def test_corrupt_model_dir(tmp_path, model_dir):
    d = tmp_path / "corrupt"
    d.mkdir()
    for f in model_dir.iterdir():
        data = f.read_bytes()
        (d / f.name).write_bytes(data[: len(data) // 2] if f.name == "model.safetensors" else data)
    assert_user_error(gen(d, "hello"), "corrupt")


def test_corrupt_safetensors_header(tmp_path, model_dir):
    d = tmp_path / "corrupt-header"
    d.mkdir()
    for f in model_dir.iterdir():
        (d / f.name).write_bytes(b"\x00" * 7 if f.name == "model.safetensors" else f.read_bytes())
    assert_user_error(gen(d, "hello"))


def test_unsupported_architecture(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    d = tmp_path / "gpt2"
    cfg = GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=2, n_positions=64, bos_token_id=0, eos_token_id=0)
    GPT2LMHeadModel(cfg).save_pretrained(d)
    line = assert_user_error(gen(d, "hello"), "unsupported", "gpt2")
    assert "llama" in line and "gemma3_text" in line


@pytest.mark.parametrize("prompt", ["", "  \n "])
def test_empty_prompt(model_dir, prompt):
    assert_user_error(gen(model_dir, prompt), "empty")


def test_empty_prompt_from_stdin(model_dir):
    r = run_cli("generate", "-", "--model", str(model_dir), stdin="")
    assert_user_error(r, "empty")


def test_prompt_longer_than_context(tmp_path):
    d = _save(tmp_path / "short-context", max_pos=16)
    prompt = " ".join(["cat"] * 20)
    assert_user_error(gen(d, prompt), "context")
    # a prompt that fits still works and stops at the context
    r = gen(d, "the cat sat", "--max-new-tokens", "100", "--json")
    assert r.returncode == 0, r.stderr
    assert len(json.loads(r.stdout)["token_ids"]) == 16 - 3


@pytest.mark.parametrize(
    "flags,fragment",
    [
        (["--max-new-tokens", "0"], "max_new_tokens"),
        (["--max-new-tokens", "-5"], "max_new_tokens"),
        (["--temperature", "-0.5"], "temperature"),
        (["--top-p", "1.5"], "top_p"),
        (["--strategy", "early-exit", "--exit-layer", "4"], "exit layer"),
        (["--strategy", "early-exit"], "exit layer"),
        (["--strategy", "layer-skip", "--skip-attn", "9"], "layer"),
        (["--strategy", "draft-model", "--draft-model", "/nonexistent/draft"], "not found"),
        (["--profile", "/nonexistent/profile.json"], "profile"),
        (["--chat"], "chat template"),
    ],
)
def test_bad_flags(model_dir, flags, fragment):
    assert_user_error(gen(model_dir, "hello world", *flags), fragment)


def test_profile_for_another_model(tmp_path, model_dir):
    path = tmp_path / "profile.json"
    save_profile(Profile(DraftConfig(strategy="early-exit", exit_layer=2), model_fingerprint="0123456789abcdef"), path)
    assert_user_error(gen(model_dir, "hello world", "--profile", str(path)), "another model")
    # the same profile with this model's fingerprint works
    fp = selfspec.load(str(model_dir), dtype="float32").fingerprint
    save_profile(Profile(DraftConfig(strategy="early-exit", exit_layer=2), model_fingerprint=fp), path)
    r = gen(model_dir, "hello world", "--profile", str(path), "--json", "--max-new-tokens", "5")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["strategy"]["strategy"] == "early-exit"


def test_not_a_profile(tmp_path, model_dir):
    path = tmp_path / "junk.json"
    path.write_text('{"hello": 1}')
    assert_user_error(gen(model_dir, "hello world", "--profile", str(path)), "profile")


@pytest.mark.parametrize("flags,fragment", [
    (["--strategy", "nope"], "unknown strategy 'nope'"),
    (["--temperature", "hot"], "argument --temperature: invalid float value: 'hot'"),
])
def test_argparse_errors_exit_2(model_dir, flags, fragment):
    """argparse's own errors are one line too (see the module doc), naming the flag."""
    r = run_cli("generate", "hello", "--model", str(model_dir), *flags)
    assert r.stdout == ""
    assert_user_error(r, fragment)


# ---- the first hour: sharper errors, honest help (issue 19) -------------------------------------


@pytest.mark.parametrize("command", ["generate", "bench", "correctness", "serve"])
def test_strategy_typo_is_one_line_with_a_suggestion(model_dir, command):
    args = [command] + (["hello"] if command == "generate" else []) + ["--model", str(model_dir), "--strategy", "erly-exit"]
    line = assert_user_error(run_cli(*args), "unknown strategy 'erly-exit'", "did you mean early-exit?")
    assert "usage:" not in line


def test_other_choices_and_training_choices_suggest_too(model_dir):
    assert_user_error(run_cli("generate", "hi", "--model", str(model_dir), "--stream-style", "speculatve"), "did you mean speculative?")
    assert_user_error(run_cli("sweep", "--model", str(model_dir), "--strategy", "layer-skp"), "did you mean layer-skip?")
    assert_user_error(run_cli("train", "--recipe", "layerskp"), "did you mean layerskip?")
    assert_user_error(run_cli("generate", "hi", "--model", str(model_dir), "--dtype", "bf16x"), "unknown dtype")
    assert_user_error(run_cli("generate", "--model", str(model_dir)), "required", "prompt")  # argparse's own errors: one line too


def test_exit_layer_is_checked_before_the_weights_load(tmp_path, model_dir):
    """The layer count comes from config.json: weights that would fail to load are never read."""
    d = tmp_path / "bad-weights"
    d.mkdir()
    for f in model_dir.iterdir():
        (d / f.name).write_bytes(b"\x00" * 7 if f.name == "model.safetensors" else f.read_bytes())
    assert_user_error(gen(d, "hello", "--strategy", "early-exit", "--exit-layer", "99"), "exit layer must be in 1..3", "got 99")
    assert_user_error(gen(d, "hello", "--strategy", "layer-skip", "--skip-mlp", "7"), "layers [7]")
    assert_user_error(gen(d, "hello", "--exit-layer", "2"), "exit_layer is not used by the auto strategy")
    r = run_cli("bench", "--model", str(d), "--strategy", "early-exit", "--exit-layer", "99", "--out", str(tmp_path / "b.json"))
    assert_user_error(r, "exit layer")
    r = run_cli("sweep", "--model", str(d), "--exit-layers", "2:40", "--out-dir", str(tmp_path / "s"))
    assert_user_error(r, "outside 1..3")


def test_exit_layer_of_the_default_model_is_checked_without_converting_it(tmp_path):
    env_cache = tmp_path / "cache"  # empty: converting the default model would take a minute
    env = dict(os.environ, SELFSPEC_CACHE=str(env_cache), OMP_NUM_THREADS="1")
    env.pop("SELFSPEC_DEBUG", None)
    r = subprocess.run([sys.executable, "-m", "selfspec", "generate", "hi", "--strategy", "early-exit", "--exit-layer", "99"],
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert_user_error(r, "exit layer must be in 1..17 for this 18-layer model")
    assert not (env_cache / "gemma-3-270m").exists()


def test_a_missing_dataset_file_is_not_an_unknown_dataset(model_dir, tmp_path):
    r = run_cli("bench", "--model", str(model_dir), "--dataset", str(tmp_path / "missing.jsonl"), "--out", str(tmp_path / "b.json"))
    line = assert_user_error(r, "dataset file not found", "missing.jsonl")
    assert "unknown dataset" not in line
    assert_user_error(run_cli("bench", "--model", str(model_dir), "--dataset", "cod"), "unknown dataset 'cod'", "did you mean code?")


def _help_texts() -> dict[str, str]:
    commands = ["generate", "bench", "sweep", "correctness", "report", "serve", "train", "search", "models"]
    return {c: run_cli(c, "--help").stdout for c in commands}


def test_help_shows_defaults_as_typed():
    import re

    for command, text in _help_texts().items():
        flat = " ".join(text.split())
        assert "(default: None)" not in flat, command
        assert "(default: ())" not in flat and "(default: [])" not in flat and "(default: (" not in flat, command
        assert not re.search(r"\(default: [^)]*\) \(default:", flat), command
        assert "(default: [" not in flat, command
    search = " ".join(_help_texts()["search"].split())
    assert "(default: 8192,16384,32768)" in search and "(default: early-exit,layer-skip,prompt-lookup,quantized)" in search


def test_speculative_stream_says_what_green_means(model_dir):
    r = gen(model_dir, "hello world", "--max-new-tokens", "6", "--strategy", "early-exit", "--exit-layer", "2",
            "--stream-style", "speculative")
    assert r.returncode == 0, r.stderr
    legend = [line for line in r.stderr.splitlines() if "green" in line]
    assert len(legend) == 1 and "accepted" in legend[0] and "bold" in legend[0]
    plain = gen(model_dir, "hello world", "--max-new-tokens", "6")
    assert "green" not in plain.stderr


def test_a_losing_profile_is_used_when_named_but_says_so(tmp_path, model_dir):
    fp = selfspec.load(str(model_dir), dtype="float32").fingerprint
    path = tmp_path / "slow.json"
    save_profile(Profile(DraftConfig(strategy="early-exit", exit_layer=2), fp,
                         metrics={"speedup": 0.83, "source": "selfspec sweep", "slower_than_autoregressive": True}), path)
    r = gen(model_dir, "hello world", "--profile", str(path), "--json", "--max-new-tokens", "4")
    assert r.returncode == 0, r.stderr
    warn = [line for line in r.stderr.splitlines() if "warning" in line]
    assert len(warn) == 1 and "SLOWER" in warn[0] and "0.83x" in warn[0]
