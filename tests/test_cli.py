"""The command line, run as a user would: `python -m selfspec ...` in a subprocess, on a
tiny model saved to a temporary directory (safetensors + a word-level tokenizer).

Every bad input must exit with status 2 and print exactly one line on stderr, never a
traceback. The exception is argparse's own parsing errors (an unknown choice, a value of the
wrong type): argparse prints its usage block first, then the one error line."""

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
    (["--strategy", "nope"], "argument --strategy: invalid choice: 'nope'"),
    (["--temperature", "hot"], "argument --temperature: invalid float value: 'hot'"),
])
def test_argparse_errors_exit_2(model_dir, flags, fragment):
    """argparse's own errors: its usage block, then exactly one error line (see the module doc)."""
    r = run_cli("generate", "hello", "--model", str(model_dir), *flags)
    assert r.returncode == 2 and "Traceback" not in r.stderr and r.stdout == ""
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert lines[0].startswith("usage: selfspec generate")
    errors = [line for line in lines if "error:" in line]
    assert errors == [lines[-1]] and lines[-1].startswith("selfspec generate: error:") and fragment in lines[-1], r.stderr
