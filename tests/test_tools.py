"""End-to-end tests of bench / sweep / correctness / report (selfspec.tools) on a tiny random
Llama with an offline-built byte-level BPE tokenizer. A few prompts, a few tokens each."""

from __future__ import annotations

import csv
import json
import math
import sys
import types
from pathlib import Path

import pytest
import torch

import selfspec
from selfspec.cli import main
from selfspec.errors import SelfSpecError
from selfspec.model import SelfSpecModel
from selfspec.profiles import load_profile
from selfspec.tools import quality as quality_mod
from selfspec.tools.datasets import load_dataset

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    import textwrap as _tw

    out = tmp_path_factory.mktemp("tiny-llama")
    corpus = [Path(_tw.__file__).read_text(), Path(json.__file__).read_text()]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=384, special_tokens=["<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(fast), hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=4096, eos_token_id=fast.eos_token_id, bos_token_id=None,
                      pad_token_id=None, tie_word_embeddings=False)
    LlamaForCausalLM(cfg).save_pretrained(out, safe_serialization=True)
    fast.save_pretrained(out)
    return out


def _strict_json(p: Path) -> dict:
    def no_constants(name):
        raise AssertionError(f"{p} is not strict JSON: {name}")

    return json.loads(p.read_text(), parse_constant=no_constants)


def _model_args(d: Path) -> list[str]:
    return ["--model", str(d), "--dtype", "float32", "--device", "cpu"]


def _is_png(p: Path) -> bool:
    from PIL import Image

    if not p.is_file() or p.read_bytes()[:8] != PNG_MAGIC:
        return False
    with Image.open(p) as im:
        im.verify()
        return im.size[0] > 50 and im.size[1] > 50


# ---- data sets ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["code", "text", "summarize"])
def test_builtin_sets_are_deterministic(name):
    a, b = load_dataset(name, 4, seed=1), load_dataset(name, 4, seed=1)
    assert len(a) == 4 and a.hash == b.hash
    assert [s.prompt for s in a.samples] == [s.prompt for s in b.samples]
    assert load_dataset(name, 4, seed=2).hash != a.hash
    assert all(s.prompt.strip() and s.reference and s.source for s in a.samples)
    assert len({s.id for s in a.samples}) == 4
    if name == "code":
        import ast

        for s in a.samples:
            ast.parse(s.prompt + s.reference)  # signature + docstring + the real body is real code
            assert s.prompt.lstrip().startswith(("def ", "async def ", "@")) and s.task == "code"
    if name == "summarize":
        assert all(s.prompt.startswith("Article: ") and s.prompt.endswith("\nSummary:") for s in a.samples)


def test_template_and_n_shot():
    ds = load_dataset("summarize", 2, seed=0, n_shot=1, template="<s>{message}</s>")
    for s in ds.samples:
        assert s.prompt.startswith("<s>Article: ") and s.prompt.endswith("Summary:</s>")
        assert s.prompt.count("Summary:") == 2  # the shot's, then the question's
    with pytest.raises(SelfSpecError, match="message"):
        load_dataset("code", 2, template="no placeholder")


def test_jsonl_dataset(tmp_path):
    p = tmp_path / "p.jsonl"
    p.write_text("\n".join(json.dumps({"prompt": f"question {i}", "reference": f"answer {i}", "id": f"q{i}"}) for i in range(6)) + "\n")
    ds = load_dataset(str(p), 3, seed=0)
    assert len(ds) == 3 and all(s.id.startswith("q") for s in ds.samples)
    assert [int(s.id[1:]) for s in ds.samples] == sorted(int(s.id[1:]) for s in ds.samples)  # file order kept
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "no prompt field"}\n')
    with pytest.raises(SelfSpecError, match="bad.jsonl:1"):
        load_dataset(str(bad), 1)
    with pytest.raises(SelfSpecError, match="unknown dataset"):
        load_dataset("no-such-set", 1)


def test_hf_dataset_formats_and_errors(monkeypatch):
    rows = {
        "test": [{"article": f"Article text {i}.", "highlights": f"Highlight {i}.", "id": f"t{i}"} for i in range(5)],
        "train": [{"article": f"Train article {i}.", "highlights": f"Train\nhighlight {i}.", "id": f"tr{i}"} for i in range(5)],
    }

    class FakeSplit(list):
        column_names = ["article", "highlights", "id"]

    calls = []

    def fake_load(name, config=None, split=None):
        calls.append((name, config, split))
        if name == "offline/set":
            raise ConnectionError("Couldn't reach the Hugging Face Hub")
        return FakeSplit(rows[split])

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=fake_load))
    ds = load_dataset("hf:cnn_dailymail:test", 2, seed=0, n_shot=1)
    assert ("cnn_dailymail", "3.0.0", "test") in calls and ("cnn_dailymail", "3.0.0", "train") in calls
    for s in ds.samples:
        assert s.task == "summarize" and s.reference.startswith("Highlight")
        assert s.prompt.startswith("Article: Train article") and "\nSummary: Train highlight" in s.prompt
        assert s.prompt.endswith("\nSummary:")
    with pytest.raises(SelfSpecError, match="hub"):
        load_dataset("hf:offline/set:test", 1)
    with pytest.raises(SelfSpecError, match="hf:NAME"):
        load_dataset("hf:only-a-name", 1)
    monkeypatch.setitem(sys.modules, "datasets", None)  # not installed
    with pytest.raises(SelfSpecError, match="pip install datasets"):
        load_dataset("hf:xsum:test", 1)


def test_code_parse_check_and_ranges():
    prompt = 'def f(x):\n    """Add one."""\n'
    assert quality_mod.code_parses(prompt, "    return x + 1\n\nprint(f(2))\n", False)
    assert quality_mod.code_parses(prompt, "    y = x + 1\n    return (y +", True)  # budget cut: last line dropped
    assert not quality_mod.code_parses(prompt, "    return (x +", False)
    from selfspec.tools.sweep import parse_float_range, parse_int_range, skip_layers

    assert parse_int_range("4:16:2", "x") == [4, 6, 8, 10, 12, 14, 16]
    assert parse_int_range("1:8", "x") == list(range(1, 9))
    assert parse_int_range("3,1,2", "x") == [1, 2, 3]
    assert parse_float_range("0.1:0.3:0.1", "x") == [0.1, 0.2, 0.3]
    with pytest.raises(SelfSpecError):
        parse_int_range("a:b", "x")
    assert skip_layers(18, 0.25) == (1, 6, 11, 16) and skip_layers(4, 0.25) == (2,)


# ---- commands, end to end ----------------------------------------------------------------------


def _check_bench(d: dict, model_dir: Path):
    assert d["kind"] == "bench" and d["completed"] == d["requested"] and not d["interrupted"]
    m = selfspec.load(str(model_dir), dtype="float32", device="cpu")
    assert d["model"]["fingerprint"] == m.fingerprint and d["model"]["dtype"] == "float32"
    env = d["environment"]
    assert env["versions"]["torch"] and env["cpu"] and env["torch_threads"] >= 1 and "gpu" in env
    assert d["settings"]["seed"] == 0 and d["dataset"]["hash"]
    for s in d["samples"]:
        b, st = s["baseline"], s["strategy"]
        assert b["new_tokens"] == st["new_tokens"] > 0 and s["identical"]  # greedy is lossless
        assert math.isclose(s["speedup"], b["time_s"] / st["time_s"], rel_tol=1e-9)
        assert math.isclose(st["tokens_per_second"], st["new_tokens"] / st["time_s"], rel_tol=1e-9)
        if st["drafted"]:
            assert math.isclose(st["acceptance_rate"], st["accepted"] / st["drafted"])
        assert sum(st["per_position_accepted"]) == st["accepted"] and sum(st["per_position_drafted"]) == st["drafted"]
        assert b["drafted"] == 0 and b["verify_steps"] == b["new_tokens"] - 1
    a = d["aggregate"]
    b, st = a["baseline"], a["strategy"]
    t_b = sum(s["baseline"]["time_s"] for s in d["samples"])
    t_s = sum(s["strategy"]["time_s"] for s in d["samples"])
    assert math.isclose(a["speedup"], t_b / t_s, rel_tol=1e-9)  # same tokens: ratio of the recorded times
    ratios = sorted(s["speedup"] for s in d["samples"])
    assert a["speedup_min"] == ratios[0] and a["speedup_max"] == ratios[-1]
    assert st["drafted"] == sum(s["strategy"]["drafted"] for s in d["samples"])
    assert math.isclose(st["acceptance_rate"], st["accepted"] / st["drafted"]) if st["drafted"] else st["acceptance_rate"] == 0
    assert math.isclose(st["mean_accepted_length"], (st["accepted"] + st["verify_steps"]) / st["verify_steps"])
    assert math.isclose(sum(st["time_split_share"].values()), 1.0, rel_tol=1e-6)
    assert b["peak_memory_mb"] > 0 and st["peak_memory_mb"] > 0
    assert a["identical_outputs"] == a["samples"]
    return a


def test_bench_code_prompt_lookup(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "bench.json"
    rc = main(["bench", *_model_args(tiny_model_dir), "--strategy", "prompt-lookup", "--dataset", "code", "--num-samples", "2",
               "--max-new-tokens", "12", "--warmup", "1", "--out", str(out), "--no-progress"])
    assert rc == 0
    d = _strict_json(out)
    a = _check_bench(d, tiny_model_dir)
    assert d["strategy"]["strategy"] == "prompt-lookup" and d["settings"]["warmup"] == 1
    assert "rouge" in a["strategy"] and set(a["strategy"]["rouge"]) == {"rouge1", "rouge2", "rougeL"}
    assert 0.0 <= a["strategy"]["code_parse_rate"] <= 1.0
    assert all("code_parses" in s["strategy"] for s in d["samples"])
    assert [s["order"] for s in d["samples"]] == ["baseline/strategy", "strategy/baseline"]  # interleaved
    assert "speedup" in capsys.readouterr().out


def test_bench_jsonl_early_exit(tiny_model_dir, tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": p, "reference": r}) for p, r in [
        ("The quick brown fox", " jumps over the lazy dog."), ("import os\nimport sys\n", "import json\n"), ("Once upon a time", None)]))
    out = tmp_path / "bench-ee.json"
    rc = main(["bench", *_model_args(tiny_model_dir), "--strategy", "early-exit", "--exit-layer", "2", "--num-speculations", "3",
               "--dataset", str(data), "--num-samples", "3", "--max-new-tokens", "8", "--warmup", "0", "--out", str(out), "--no-progress"])
    assert rc == 0
    d = _strict_json(out)
    a = _check_bench(d, tiny_model_dir)
    assert d["strategy"]["exit_layer"] == 2 and d["strategy"]["num_speculations"] == 3
    assert a["strategy"]["rouge_samples"] == 2 and "code_parse_rate" not in a["strategy"]
    assert len(a["strategy"]["per_position_acceptance"]) == 3


def test_bench_ctrl_c_keeps_finished_prompts(tiny_model_dir, tmp_path, monkeypatch):
    real = SelfSpecModel.generate
    calls = {"n": 0}

    def flaky(self, *a, **kw):
        calls["n"] += 1
        if calls["n"] == 5:  # prompts 1 and 2 finished (4 calls), then Ctrl-C
            raise KeyboardInterrupt
        return real(self, *a, **kw)

    monkeypatch.setattr(SelfSpecModel, "generate", flaky)
    out = tmp_path / "partial.json"
    rc = main(["bench", *_model_args(tiny_model_dir), "--strategy", "prompt-lookup", "--dataset", "code", "--num-samples", "3",
               "--max-new-tokens", "6", "--warmup", "0", "--out", str(out), "--no-progress"])
    assert rc == 130
    d = _strict_json(out)
    assert d["interrupted"] and d["completed"] == 2 and d["requested"] == 3 and d["aggregate"]["samples"] == 2


def test_sweep_early_exit_and_report(tiny_model_dir, tmp_path):
    out = tmp_path / "sweep"
    rc = main(["sweep", *_model_args(tiny_model_dir), "--exit-layers", "1:3", "--num-speculations", "1:2", "--dataset", "code",
               "--num-samples", "2", "--max-new-tokens", "8", "--warmup", "0", "--out-dir", str(out), "--no-progress"])
    assert rc == 0
    d = _strict_json(out / "sweep.json")
    assert d["rows"] == [1, 2, 3] and d["num_speculations"] == [1, 2] and len(d["cells"]) == 6
    rows = list(csv.DictReader((out / "sweep.csv").open()))
    assert len(rows) == 6 and {r["exit_layer"] for r in rows} == {"1", "2", "3"}
    for c, r in zip(d["cells"], rows):
        s = c["summary"]
        assert s["samples"] == 2 and s["identical_outputs"] == 2
        base = [b for b in d["baseline"][str(c["row"])]]
        assert math.isclose(s["speedup"], sum(b["time_s"] for b in base) / sum(x["time_s"] for x in c["samples"]), rel_tol=1e-9)
        if s["drafted"]:
            assert math.isclose(s["acceptance_rate"], s["accepted"] / s["drafted"])
        assert math.isclose(float(r["speedup"]), s["speedup"], rel_tol=1e-9)
    best = max(d["cells"], key=lambda c: c["summary"]["speedup"])
    assert d["best"]["draft"] == best["draft"]
    assert _is_png(out / "sweep_heatmap.png") and _is_png(out / "sweep_acceptance.png")
    prof = load_profile(out / "best_profile.json")
    m = selfspec.load(str(tiny_model_dir), dtype="float32", device="cpu")
    assert prof.model_fingerprint == m.fingerprint and prof.draft.to_dict() == best["draft"]
    assert math.isclose(prof.metrics["speedup"], best["summary"]["speedup"])
    assert m.draft_config(profile=str(out / "best_profile.json")).exit_layer == best["draft"]["exit_layer"]

    # report over the sweep and a bench from the same model
    bench = tmp_path / "b.json"
    assert main(["bench", *_model_args(tiny_model_dir), "--profile", str(out / "best_profile.json"), "--dataset", "summarize",
                 "--num-samples", "2", "--max-new-tokens", "6", "--warmup", "0", "--out", str(bench), "--no-progress"]) == 0
    rep = tmp_path / "report"
    assert main(["report", str(bench), str(bench), str(out / "sweep.json"), "--out-dir", str(rep), "--labels", "a,b,c"]) == 0
    for name in ("bench_speedup.png", "bench_tokens_per_second.png", "bench_acceptance.png", "bench_time_split.png",
                 "sweep_heatmap.png", "sweep_acceptance.png"):
        assert _is_png(rep / name), name
    page = (rep / "index.html").read_text()
    assert "bench_speedup.png" in page and "sweep_heatmap.png" in page and "<table>" in page


def test_sweep_layer_skip(tiny_model_dir, tmp_path):
    out = tmp_path / "ls"
    rc = main(["sweep", *_model_args(tiny_model_dir), "--strategy", "layer-skip", "--skip-ratios", "0.25,0.5",
               "--num-speculations", "2", "--dataset", "text", "--num-samples", "2", "--max-new-tokens", "6", "--warmup", "0",
               "--out-dir", str(out), "--no-progress"])
    assert rc == 0
    d = _strict_json(out / "sweep.json")
    assert d["row_kind"] == "skip_ratio" and [c["draft"]["skip_attn"] for c in d["cells"]] == [[2], [1, 2]]
    assert _is_png(out / "sweep_heatmap.png")
    assert load_profile(out / "best_profile.json").draft.strategy == "layer-skip"


def test_sweep_quantized_rows_are_draft_bits(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "q"
    rc = main(["sweep", *_model_args(tiny_model_dir), "--strategy", "quantized", "--num-speculations", "2,3", "--head-bits", "8",
               "--dataset", "code", "--num-samples", "2", "--max-new-tokens", "6", "--warmup", "0", "--out-dir", str(out), "--no-progress"])
    assert rc == 0
    d = _strict_json(out / "sweep.json")
    assert d["row_kind"] == "draft_bits" and d["rows"] == [4, 8] and len(d["cells"]) == 4
    assert [(c["draft"]["draft_bits"], c["draft"]["head_bits"], c["draft"]["num_speculations"]) for c in d["cells"]] == [
        (4, 8, 2), (4, 8, 3), (8, 8, 2), (8, 8, 3)]
    assert all(c["summary"]["identical_outputs"] == 2 and c["summary"]["drafted"] > 0 for c in d["cells"])
    rows = list(csv.DictReader((out / "sweep.csv").open()))
    assert [r["draft_bits"] for r in rows] == ["4", "4", "8", "8"] and {r["exit_layer"] for r in rows} == {""}
    assert "draft bits" in capsys.readouterr().out
    assert _is_png(out / "sweep_heatmap.png")
    assert load_profile(out / "best_profile.json").draft.strategy == "quantized"
    for bad, msg in ((["--draft-bits", "8,3"], "bits must be among 8, 4"), (["--exit-layers", "2"], "sweeps --draft-bits"),
                     (["--skip-ratios", "0.5"], "sweeps --draft-bits")):
        assert main(["sweep", *_model_args(tiny_model_dir), "--strategy", "quantized", *bad, "--out-dir", str(tmp_path / "x")]) == 2
        assert msg in capsys.readouterr().err
    assert main(["sweep", *_model_args(tiny_model_dir), "--draft-bits", "8", "--out-dir", str(tmp_path / "x")]) == 2
    assert "are for --strategy quantized" in capsys.readouterr().err


def test_correctness_passes_and_detects_mismatch(tiny_model_dir, tmp_path, monkeypatch, capsys):
    out = tmp_path / "ok.json"
    args = ["correctness", *_model_args(tiny_model_dir), "--strategy", "early-exit", "--exit-layer", "2", "--dataset", "code",
            "--num-samples", "2", "--max-new-tokens", "10", "--no-progress"]
    assert main(args + ["--out", str(out)]) == 0
    d = _strict_json(out)
    assert d["kind"] == "correctness" and d["mismatches"] == 0 and d["completed"] == 2 and d["first_difference"] is None
    assert "0 of 2 prompts differ" in capsys.readouterr().out

    real = SelfSpecModel.generate

    def broken(self, prompt, **kw):  # a drafting bug: corrupt token 3 of speculative outputs
        r = real(self, prompt, **kw)
        if kw["draft"].speculative and len(r.token_ids) > 3:
            r.token_ids[3] = (r.token_ids[3] + 1) % self.spec.vocab_size
        return r

    monkeypatch.setattr(SelfSpecModel, "generate", broken)
    bad = tmp_path / "bad.json"
    assert main(args + ["--out", str(bad)]) == 1
    d = _strict_json(bad)
    assert d["mismatches"] == 2 and d["first_difference"] == 3 and len(d["mismatch_ids"]) == 2
    assert all(s["first_difference"] == 3 and s["baseline_around"] != s["strategy_around"] for s in d["samples"])
    assert "first differing position 3" in capsys.readouterr().out
    rep = tmp_path / "rep"
    assert main(["report", str(bad), "--out-dir", str(rep)]) == 0 and (rep / "index.html").exists()


def test_user_errors_are_one_line(tiny_model_dir, tmp_path, capsys):
    assert main(["bench", *_model_args(tiny_model_dir), "--dataset", "nope", "--out", str(tmp_path / "x.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown dataset" in err[0]
    assert main(["sweep", *_model_args(tiny_model_dir), "--exit-layers", "1:9", "--num-speculations", "2", "--num-samples", "1",
                 "--out-dir", str(tmp_path / "s"), "--no-progress"]) == 2
    assert "outside 1..3" in capsys.readouterr().err
    assert main(["report", str(tmp_path / "missing.json")]) == 2
    (tmp_path / "other.json").write_text('{"hello": 1}')
    assert main(["report", str(tmp_path / "other.json")]) == 2


# ---- the first hour: a terminal-sized report, file modes, results that lose (issue 19) ------------


@pytest.fixture(scope="module")
def results_files(tiny_model_dir, tmp_path_factory):
    """A bench and a sweep over eight K (a grid far wider than 80 columns)."""
    d = tmp_path_factory.mktemp("results")
    assert main(["bench", *_model_args(tiny_model_dir), "--strategy", "prompt-lookup", "--dataset", "code", "--num-samples", "2",
                 "--max-new-tokens", "6", "--warmup", "0", "--out", str(d / "bench.json"), "--no-progress"]) == 0
    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert main(["sweep", *_model_args(tiny_model_dir), "--exit-layers", "1:2", "--num-speculations", "1:8", "--dataset", "code",
                     "--num-samples", "1", "--max-new-tokens", "4", "--warmup", "0", "--out-dir", str(d / "sweep") + "/",
                     "--no-progress"]) == 0
    (d / "sweep-stderr.txt").write_text(err.getvalue())
    return d / "bench.json", d / "sweep" / "sweep.json"


def _render(paths, out_dir, width: int) -> str:
    import io

    from rich.console import Console

    from selfspec.tools.report import report

    console = Console(width=width, file=io.StringIO(), record=True)
    report([str(p) for p in paths], out_dir, console=console)
    return console.export_text()


@pytest.mark.parametrize("width", [80, 120])
def test_report_fits_the_terminal_without_breaking_words(results_files, tmp_path, width):
    from selfspec.tools.report import load_results, run_labels
    from selfspec.tools.tables import bench_rows, sweep_rows

    bench, sweep = results_files
    text = _render([bench, bench, sweep], tmp_path / "rep", width)
    # paths are never wrapped (an absolute one too long for the line goes on a line of its own)
    lines = [line for line in text.splitlines() if not line.startswith(("wrote", f"  {tmp_path}"))]
    assert max(len(line) for line in lines) <= width, "\n".join(lines)
    flat = " ".join(text.split())
    b = [load_results(bench)] * 2
    head, rows = bench_rows(b, run_labels(b, ["x", "y"]))
    note = f"not shown at {width} columns: "
    missing = flat.split(note, 1)[1].split(" (in index.html)")[0].split(", ") if note in flat else []
    assert set(missing) <= set(head)
    shown = [i for i, h in enumerate(head) if h not in missing]
    assert {"speedup", "spec tok/s", "acceptance"} <= {head[i] for i in shown}
    for i in shown[1:]:  # every shown cell word whole on one line (the run column holds "#1", "#2")
        assert all(w in text for w in head[i].split())
        for row in rows:
            for word in row[i].split():
                assert any(word in line for line in lines), (head[i], word)
    for row in sweep_rows(load_results(sweep))[1]:  # every sweep cell, whole
        for cell in row[1:]:
            assert any(cell in line for line in lines), cell
    assert "#1 prompt-lookup" in text  # the runs' labels above the table


def test_report_command_fits_columns_when_piped(results_files, tmp_path, monkeypatch, capsys):
    """`COLUMNS=80 selfspec report ...` into a pipe or a file (not a terminal: CI logs, | less):
    no line over 80 characters, paths included (relative to the working directory, or on a
    line of their own), where it used to render 160 columns wide."""
    from selfspec.tools.cli import console_width

    bench, sweep = results_files
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("COLUMNS", "80")
    assert main(["report", str(bench), str(bench), str(sweep), "--out-dir", "rep"]) == 0
    out = capsys.readouterr().out
    assert "speedup" in out and "wrote rep/index.html" in out
    assert max(len(line) for line in out.splitlines()) <= 80, out
    assert console_width(False, {}) == 160 and console_width(True, {}) is None  # no COLUMNS: the terminal's, or wide for files
    assert console_width(False, {"COLUMNS": "100"}) == 100 == console_width(True, {"COLUMNS": "100"})


def test_report_puts_a_long_path_on_its_own_line(tmp_path):
    import io

    from rich.console import Console

    from selfspec.tools.report import _wrote

    console = Console(width=40, file=io.StringIO(), record=True)
    long = tmp_path.parent / ("x" * 30) / "index.html"
    _wrote(console, long)
    _wrote(console, "short.png")
    lines = console.export_text().splitlines()
    assert lines == ["wrote", f"  {long}", "wrote short.png"]


def test_report_files_are_readable_by_others_and_explained(results_files, tmp_path):
    import os

    bench, sweep = results_files
    old = os.umask(0o022)
    try:
        _render([bench, sweep], tmp_path / "rep", 80)
    finally:
        os.umask(old)
    files = list((tmp_path / "rep").iterdir())
    assert {f.name for f in files} >= {"index.html", "bench_speedup.png", "sweep_heatmap.png"}
    for f in files:
        assert f.stat().st_mode & 0o777 == 0o644, (f.name, oct(f.stat().st_mode))
    page = (tmp_path / "rep" / "index.html").read_text()
    import html

    from selfspec.tools.plots import CHARTS
    from selfspec.tools.tables import BENCH_COLUMNS

    for explanation in list(BENCH_COLUMNS.values()) + [CHARTS["bench_speedup"], CHARTS["heatmap"]]:
        assert html.escape(explanation) in page, explanation
    assert "white-space:nowrap" in page and "<figcaption>" in page  # labels on one line, charts explained


def test_atomic_writes_get_the_usual_mode(tmp_path):
    import os

    from selfspec.profiles import atomic_write_text

    old = os.umask(0o022)
    try:
        atomic_write_text(tmp_path / "a.json", "{}")
        os.umask(0o077)
        atomic_write_text(tmp_path / "b.json", "{}")
    finally:
        os.umask(old)
    assert (tmp_path / "a.json").stat().st_mode & 0o777 == 0o644
    assert (tmp_path / "b.json").stat().st_mode & 0o777 == 0o600  # the user's umask decides, as for any new file
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary left behind


def test_sweep_prints_clean_paths(results_files):
    _, sweep = results_files
    err = (sweep.parent.parent / "sweep-stderr.txt").read_text()  # the fixture passed --out-dir ending with "/"
    assert f"wrote {sweep}, sweep.csv, sweep_heatmap.png" in err and "//" not in err


def test_a_sweep_whose_best_setting_loses_says_so_and_auto_never_adopts_it(tiny_model_dir, tmp_path, monkeypatch, capsys):
    from selfspec import profiles
    from selfspec.tools import sweep as sweep_mod

    real = sweep_mod.cell_summary

    def slower(cell, baseline_runs):  # every setting measured at 0.8x of plain decoding (timing is not under test here)
        s = real(cell, baseline_runs)
        if s["speedup"] is not None:
            s["speedup"] = 0.8 - 0.01 * cell["draft"]["num_speculations"]
        return s

    monkeypatch.setattr(sweep_mod, "cell_summary", slower)
    monkeypatch.setenv("SELFSPEC_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "sweep"
    assert main(["sweep", *_model_args(tiny_model_dir), "--exit-layers", "2", "--num-speculations", "1:2", "--dataset", "code",
                 "--num-samples", "1", "--max-new-tokens", "4", "--warmup", "0", "--out-dir", str(out), "--no-progress"]) == 0
    cap = capsys.readouterr()
    assert "SLOWER than autoregressive" in cap.err and "x0.79" in cap.err
    assert "WARNING" in " ".join(cap.out.split())  # the table's caption too
    d = _strict_json(out / "sweep.json")
    assert d["best"]["slower_than_autoregressive"] is True
    prof = load_profile(out / "best_profile.json")
    assert prof.metrics["slower_than_autoregressive"] is True and prof.metrics["speedup_vs_autoregressive"] == pytest.approx(0.79)
    assert profiles.loses(prof) and "SLOWER" in profiles.losing_note(prof)
    with pytest.raises(SelfSpecError, match="not installed.*SLOWER"):
        profiles.install_profile(prof)
    # even copied into the install directory by hand, auto passes it over
    profiles.user_profile_dir().mkdir(parents=True)
    (profiles.user_profile_dir() / f"{prof.model_fingerprint}.json").write_text((out / "best_profile.json").read_text())
    assert profiles.installed_profile(prof.model_fingerprint) is None
    m = selfspec.load(str(tiny_model_dir), dtype="float32", device="cpu")
    assert m.drafter(selfspec.DraftConfig("auto")).base is None  # calibration, not the losing profile
    # a winning profile is still installed and adopted
    win = profiles.Profile(prof.draft, prof.model_fingerprint, metrics={**prof.metrics, "slower_than_autoregressive": False,
                                                                       "speedup_vs_autoregressive": 1.2})
    profiles.install_profile(win)
    assert profiles.installed_profile(prof.model_fingerprint).draft == prof.draft


def test_old_profiles_are_judged_by_their_measured_speedup():
    from selfspec.profiles import Profile, loses

    d = selfspec.DraftConfig("prompt-lookup")
    assert loses(Profile(d, "f", metrics={"measured_speedup": 0.9}))
    assert loses(Profile(d, "f", metrics={"speedup": 0.83, "source": "selfspec sweep"}))
    assert not loses(Profile(d, "f", metrics={"measured_speedup": 1.34, "predicted_speedup": 1.44}))
    assert not loses(Profile(d, "f", metrics={"exit_agreement": 0.5}))  # training metrics: nothing measured
    assert not loses(Profile(d, "f"))
