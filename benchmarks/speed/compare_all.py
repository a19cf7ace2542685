"""The README comparison table in one run: selfspec's autoregressive decoding vs every
drafting strategy vs transformers' own `generate` and `generate(assistant_early_exit=E)`,
on the built-in prompt sets, with the ratios side by side.

    python benchmarks/speed/compare_all.py                       # default model, code/text/summarize
    python benchmarks/speed/compare_all.py --num-samples 3 --max-new-tokens 32 --datasets code
    python benchmarks/speed/compare_all.py --early-exit-profile sweep-results/best_profile.json

For every prompt all methods run back to back, their order rotating from prompt to prompt
so machine drift hits all of them alike. Greedy decoding throughout; the same prompt token
ids go to selfspec and to transformers. Times are wall time from token ids to the last new
token (prefill included, tokenization excluded) for both libraries. HF's early-exit
assistant gets num_assistant_tokens=K with the constant schedule and no confidence
threshold, i.e. the same K as selfspec's early-exit.

Writes --out (default compare-results.json, readable by `selfspec report`) after every
prompt; Ctrl-C keeps what finished. Prints a rich table and, with --markdown, a Markdown
table for the README.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

import selfspec
from selfspec.config import DraftConfig
from selfspec.errors import SelfSpecError
from selfspec.tools.common import (
    FORMAT,
    ProgressBar,
    Settings,
    aggregate_runs,
    environment,
    measured_generate,
    model_info,
    now,
    run_record,
    strategy_label,
    write_json,
)
from selfspec.tools.datasets import load_dataset
from selfspec.tools.memory import MemoryMonitor, process_peak_rss_mb
from selfspec.tools.sweep import skip_layers

AR = "selfspec autoregressive"
HF = "HF generate"


def hf_model(dtype: torch.dtype, device: str, source: str | None):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    path = source or selfspec.loading.default_model_dir()
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, local_files_only=True)  # a local directory; never a hub id
    return model.to(device).eval()


def hf_generate(model, ids: list[int], max_new_tokens: int, eos_ids, **kw) -> tuple[list[int], float]:
    x = torch.tensor([ids], device=model.device)
    mask = torch.ones_like(x)
    if model.device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(x, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False, temperature=None,
                             top_p=None, top_k=None, eos_token_id=list(eos_ids), pad_token_id=eos_ids[0], **kw)
    if model.device.type == "cuda":
        torch.cuda.synchronize()
    return out[0, len(ids):].tolist(), time.perf_counter() - t0


def hf_record(new_ids: list[int], seconds: float, eos_ids) -> dict:
    # count like selfspec does: up to and including the first EOS
    for i, t in enumerate(new_ids):
        if t in eos_ids:
            new_ids = new_ids[: i + 1]
            break
    n = len(new_ids)
    return {"new_tokens": n, "time_s": seconds, "tokens_per_second": n / seconds if seconds > 0 else 0.0,
            "time_to_first_token_s": None, "time_prefill_s": 0.0, "time_draft_s": 0.0, "time_verify_s": 0.0,
            "time_other_s": seconds, "drafted": 0, "accepted": 0, "verify_steps": 0,
            "per_position_drafted": [], "per_position_accepted": [], "token_ids": new_ids}


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gemma-3-270m", help="selfspec model (default: the built-in gemma-3-270m)")
    p.add_argument("--hf-model", default=None, help="HF directory for transformers (default: selfspec.loading.default_model_dir())")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None)
    p.add_argument("--device", default=None)
    p.add_argument("--datasets", default="code,text,summarize", help="comma list of built-in sets (or .jsonl paths)")
    p.add_argument("--num-samples", type=int, default=5)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--exit-layer", type=int, default=None, help="early-exit E (default: 2/3 of the depth)")
    p.add_argument("--num-speculations", type=int, default=4, help="K for every drafting method (default: 4)")
    p.add_argument("--skip-ratio", type=float, default=0.25, help="layer-skip: skip this share of the layers (see sweep)")
    p.add_argument("--early-exit-profile", default=None, help="use a saved profile for early-exit instead of --exit-layer")
    p.add_argument("--layer-skip-profile", default=None, help="use a saved profile for layer-skip instead of --skip-ratio")
    p.add_argument("--methods", default=None, help="comma list to run a subset, matched by prefix (e.g. 'selfspec,HF generate')")
    p.add_argument("--no-hf", action="store_true", help="skip the transformers baselines")
    p.add_argument("--out", default="compare-results.json")
    p.add_argument("--markdown", action="store_true", help="also print a Markdown table")
    p.add_argument("--no-progress", action="store_true")
    return p.parse_args(argv)


def build_methods(args, m) -> dict:
    """name -> ("selfspec", DraftConfig) | ("hf", generate kwargs)."""
    L, K = m.spec.num_layers, args.num_speculations
    E = args.exit_layer or max(1, round(L * 2 / 3))
    ee = m.draft_config(profile=args.early_exit_profile) if args.early_exit_profile else DraftConfig("early-exit", exit_layer=E, num_speculations=K)
    if args.layer_skip_profile:
        ls = m.draft_config(profile=args.layer_skip_profile)
    else:
        layers = skip_layers(L, args.skip_ratio)
        ls = DraftConfig("layer-skip", skip_attn=layers, skip_mlp=layers, num_speculations=K)
    pl = DraftConfig("prompt-lookup", num_speculations=K)
    methods = {AR: ("selfspec", DraftConfig("autoregressive"))}
    for cfg in (ee, ls, pl):
        methods[f"selfspec {strategy_label(cfg)}"] = ("selfspec", cfg)
    if not args.no_hf:
        methods[HF] = ("hf", {})
        methods[f"HF generate(assistant_early_exit={ee.exit_layer}) K={ee.num_speculations}"] = (
            "hf", {"assistant_early_exit": ee.exit_layer, "num_assistant_tokens": ee.num_speculations,
                   "num_assistant_tokens_schedule": "constant", "assistant_confidence_threshold": 0.0})
    if args.methods:
        wanted = [w.strip() for w in args.methods.split(",") if w.strip()]
        methods = {k: v for k, v in methods.items() if k == AR or any(k.startswith(w) for w in wanted)}
    return methods


def aggregate(results: dict) -> dict:
    out = {}
    for ds, samples in results["samples"].items():
        if not samples:
            continue
        methods = list(samples[0]["runs"])
        base = aggregate_runs([s["runs"][AR] for s in samples])
        hf = aggregate_runs([s["runs"][HF] for s in samples]) if HF in methods else None
        out[ds] = {}
        for name in methods:
            runs = [s["runs"][name] for s in samples]
            a = aggregate_runs(runs)
            ratios = [r["tokens_per_second"] / s["runs"][AR]["tokens_per_second"] for r, s in zip(runs, samples) if s["runs"][AR]["tokens_per_second"]]
            out[ds][name] = {
                "runs": a["runs"],
                "new_tokens": a["new_tokens"],
                "time_s": a["time_s"],
                "tokens_per_second": a["tokens_per_second"],
                "speedup_vs_autoregressive": a["tokens_per_second"] / base["tokens_per_second"] if base["tokens_per_second"] else None,
                "speedup_vs_autoregressive_median": statistics.median(ratios) if ratios else None,
                "speedup_vs_hf_generate": a["tokens_per_second"] / hf["tokens_per_second"] if hf and hf["tokens_per_second"] else None,
                "acceptance_rate": a["acceptance_rate"] if a["drafted"] else None,
                "mean_accepted_length": a["mean_accepted_length"] if a["verify_steps"] else None,
                "identical_to_autoregressive": sum(1 for r, s in zip(runs, samples) if r["token_ids"] == s["runs"][AR]["token_ids"]),
            }
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        return run(args)
    except SelfSpecError as e:
        print(f"compare_all: error: {e}", file=sys.stderr)
        return 2


def run(args) -> int:
    names = [d.strip() for d in args.datasets.split(",") if d.strip()]
    sets = {n: load_dataset(n, args.num_samples, args.seed) for n in names}
    m = selfspec.load(args.model, dtype=args.dtype, device=args.device)
    methods = build_methods(args, m)
    for kind, cfg in methods.values():
        if kind == "selfspec":
            m.drafter(cfg)  # validate every configuration first
    hf = hf_model(m.runtime.dtype, str(m.runtime.device), args.hf_model) if any(k == "hf" for k, _ in methods.values()) else None
    settings = Settings(max_new_tokens=args.max_new_tokens, temperature=0.0, seed=args.seed)
    eos = tuple(m.eos_token_ids)
    results = {
        "format": FORMAT,
        "kind": "compare",
        "created": now(),
        "args": vars(args),
        "model": model_info(m),
        "hf_model": str(args.hf_model or selfspec.loading.default_model_dir()) if hf is not None else None,
        "methods": {k: (cfg.to_dict() if kind == "selfspec" else {"transformers.generate": cfg}) for k, (kind, cfg) in methods.items()},
        "settings": {**settings.to_dict(), "warmup": args.warmup, "order": "rotating per prompt", "decoding": "greedy"},
        "dataset": {"name": "+".join(names), "hash": "+".join(sets[n].hash for n in names), "sets": {n: sets[n].info() for n in names}},
        "num_samples": args.num_samples,
        "environment": environment(),
        "interrupted": False,
        "samples": {n: [] for n in names},
        "aggregate": {},
    }
    memory = MemoryMonitor(str(m.runtime.device))
    results["memory_method"] = memory.method

    def one(name, prompt, ids):
        kind, cfg = methods[name]
        memory.start(name)
        try:
            if kind == "selfspec":
                return run_record(measured_generate(m, prompt, cfg, settings, args.seed), None, keep_text=False)
            new, secs = hf_generate(hf, ids, args.max_new_tokens, eos, **cfg)
            return hf_record(new, secs, eos)
        finally:
            memory.stop(name)

    def save():
        results["aggregate"] = aggregate(results)
        results["peak_memory_mb"] = dict(memory.peaks)
        results["process_peak_rss_mb"] = process_peak_rss_mb()
        write_json(args.out, results)

    order = list(methods)
    total = sum(len(s.samples) for s in sets.values()) * len(order)
    try:
        # warm up on the longest prompt: one-time costs of the largest cache size land here
        first = max((s for ds in sets.values() for s in ds.samples), key=lambda s: len(s.prompt))
        for _ in range(args.warmup):
            for name in order:
                one(name, first.prompt, m.encode(first.prompt))
        with ProgressBar(total, "compare", not args.no_progress) as bar:
            for n in names:
                for i, sample in enumerate(sets[n].samples):
                    ids = m.encode(sample.prompt)
                    rot = order[i % len(order):] + order[: i % len(order)]
                    runs = {}
                    for name in rot:
                        runs[name] = one(name, sample.prompt, ids)
                        bar.update(1, description=f"compare {n}")
                    results["samples"][n].append({"id": sample.id, "source": sample.source, "order": rot, "runs": {k: runs[k] for k in order}})
                    save()
                    a = results["aggregate"][n]
                    bar.update(0, status=" | ".join(f"{k.split(' ')[1] if k.startswith('selfspec') else k[:14]} x{v['speedup_vs_autoregressive']:.2f}" for k, v in a.items() if k != AR))
    except KeyboardInterrupt:
        results["interrupted"] = True
    finally:
        memory.close()
    save()
    print_table(results, args.markdown)
    print(f"wrote {args.out}", file=sys.stderr)
    return 130 if results["interrupted"] else 0


def print_table(results: dict, markdown: bool) -> None:
    from rich.console import Console
    from rich.table import Table

    agg = results["aggregate"]
    sets = list(agg)
    methods = list(results["methods"])
    m = results["model"]
    env = results["environment"]
    t = Table(title=f"{m['name']} ({m['dtype']}, {m['device']}, {env.get('gpu') or env.get('cpu')}, {env.get('torch_threads')} threads), "
                    f"greedy, {results['settings']['max_new_tokens']} new tokens, {results['num_samples']} prompts per set"
                    + (" [interrupted]" if results["interrupted"] else ""))
    t.add_column("method")
    for s in sets:
        t.add_column(f"{s}: tok/s", justify="right")
        t.add_column("x AR", justify="right")
        t.add_column("x HF", justify="right")
        t.add_column("acc", justify="right")
    md = ["| method | " + " | ".join(f"{s} tok/s | x AR | x HF | acceptance" for s in sets) + " |",
          "|---|" + "---:|" * (4 * len(sets))]
    for name in methods:
        cells = []
        for s in sets:
            a = agg[s].get(name)
            if a is None:
                cells += ["-"] * 4
                continue
            f = lambda x, fmt="{:.2f}": "-" if x is None else fmt.format(x)  # noqa: E731
            cells += [f(a["tokens_per_second"], "{:.1f}"), f(a["speedup_vs_autoregressive"]), f(a["speedup_vs_hf_generate"]),
                      f(a["acceptance_rate"], "{:.0%}")]
        t.add_row(name, *cells)
        md.append(f"| {name} | " + " | ".join(cells) + " |")
    Console().print(t)
    if markdown:
        print("\n".join(md))


if __name__ == "__main__":
    sys.exit(main())
