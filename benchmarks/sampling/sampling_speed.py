"""Sampling overhead and sampling tok/s, old path vs new, side by side in one run (issue 14).

    .venv/bin/python benchmarks/sampling/sampling_speed.py [--num-samples 4] [--max-new-tokens 128]
        [--sections rows,e2e,strategies] [--repeats 20] [--e2e-repeats 2]

Sections (default model, bfloat16, built-in prompt sets code + text):
  rows        per-row sampling overhead, everything after the logits (transform, distribution,
              one draw), on real logits of the model (262,144 entries): the previous
              implementation (a full sort for top-p, torch.multinomial: copied below as
              `old_*`) vs selfspec.sampling, for temperature 0.8 alone, top_k 40, top_p 0.95,
              and both; then one speculative step's sampling work at K = 4: the draft side (K
              draft rows from early exit at layer 12: distribution + draw each) and the
              acceptance (K+1 target rows), and the same acceptance for prompt lookup's
              point-mass drafts. Target: <= 1 ms per row.
  e2e         autoregressive greedy vs autoregressive sampling vs the default strategy (auto)
              sampling, temperature 0.8, top_p 0.95, interleaved per prompt.
              Target: AR sampling >= 0.9x AR greedy tok/s.
  strategies  speculative sampling per strategy (acceptance, tok/s, vs AR sampling).
Writes results/sampling_speed.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks/: common.py

from rich.console import Console
from rich.table import Table

import selfspec
from selfspec.config import SamplingConfig
from selfspec.sampling import PointMass, Rows, distribution, make_rng
from selfspec.tools.datasets import load_dataset
from selfspec.verification import speculative_accept

from common import machine

CONFIGS = {
    "temperature 0.8": SamplingConfig(temperature=0.8),
    "top_k 40": SamplingConfig(temperature=0.8, top_k=40),
    "top_p 0.95": SamplingConfig(temperature=0.8, top_p=0.95),
    "top_k 40 + top_p 0.95": SamplingConfig(temperature=0.8, top_k=40, top_p=0.95),
}
SAMPLING = dict(temperature=0.8, top_p=0.95)


# ---- the previous implementation (selfspec before issue 14), for comparison -----------------


def old_probs_from_logits(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    x = logits / cfg.temperature
    if cfg.top_k is not None and cfg.top_k < x.shape[-1]:
        kth = torch.topk(x, cfg.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if cfg.top_p is not None and cfg.top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        cum = sorted_x.softmax(-1).cumsum(-1)
        drop_sorted = (cum - sorted_x.softmax(-1)) >= cfg.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return x.softmax(-1)


def old_sample(probs: torch.Tensor, rng: torch.Generator) -> int:
    return int(torch.multinomial(probs, 1, generator=rng))


def old_speculative_accept(draft, draft_probs, target_probs, rng):
    if draft:
        idx = torch.arange(len(draft))
        tok = torch.tensor(draft)
        u = torch.rand(len(draft), generator=rng)
        ok = (u * draft_probs[idx, tok] < target_probs[idx, tok]).tolist()
    else:
        ok = []
    for i, accepted in enumerate(ok):
        if not accepted:
            r = (target_probs[i] - draft_probs[i]).clamp_min(0.0)
            total = r.sum()
            return i, old_sample(r / total if total > 0 else target_probs[i], rng)
    return len(draft), old_sample(target_probs[len(draft)], rng)


# ---- rows: per-row overhead ------------------------------------------------------------------


def real_rows(m, prompts_ids: list[list[int]], per_prompt: int, exit_layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Target logits [R, V] at the last `per_prompt` positions of each prompt, and the early-exit
    draft logits (layers < exit_layer + the model's head) at the same positions."""
    rt = m.runtime
    targets, drafts = [], []
    with torch.inference_mode():
        for ids in prompts_ids:
            t = torch.tensor(ids)
            targets.append(rt.forward(t, 0, rt.new_cache(len(ids) + 8))[-per_prompt:])
            h = rt.run_layers(rt.embed(t), 0, exit_layer, 0, rt.new_cache(len(ids) + 8))
            drafts.append(rt.logits(h[-per_prompt:]))
    return torch.cat(targets), torch.cat(drafts)


def per_call_ms(fn, args_list: list, repeats: int) -> float:
    """Mean over the arguments of the median over repeats of one call, in ms."""
    meds = []
    for a in args_list:
        fn(*a)  # warm-up
        ts = []
        for _ in range(repeats):
            t = time.perf_counter()
            fn(*a)
            ts.append(time.perf_counter() - t)
        meds.append(statistics.median(ts))
    return 1e3 * statistics.mean(meds)


def rows_section(m, prompts_ids, repeats: int, console: Console) -> dict:
    targets, drafts = real_rows(m, prompts_ids[:4], per_prompt=5, exit_layer=12)
    rng = make_rng(0)
    rows = [(r,) for r in targets]
    out = {}
    t = Table(title=f"sampling overhead per row on {targets.shape[1]:,} logits (ms, after the logits; mean of per-row medians)")
    for c in ("transform", "old: sort + multinomial", "new", "speedup"):
        t.add_column(c)
    for name, cfg in CONFIGS.items():
        old = per_call_ms(lambda r: old_sample(old_probs_from_logits(r, cfg), rng), rows, max(3, repeats // 4))
        new = per_call_ms(lambda r: distribution(r, cfg).draw(rng), rows, repeats)
        out[name] = {"old_ms": old, "new_ms": new}
        t.add_row(name, f"{old:.2f}", f"{new:.3f}", f"{old / new:.0f}x")
    console.print(t)

    # One speculative step's sampling work, K = 4, early-exit drafts (layer 12) and prompt lookup.
    K = 4
    cfg = SamplingConfig(**SAMPLING)
    steps = [(targets[i : i + K + 1], drafts[i : i + K]) for i in range(0, len(targets) - K, K + 1)]

    def old_draft(tg, dr):
        q = old_probs_from_logits(dr, cfg)
        return [old_sample(q[j], rng) for j in range(K)], q

    def new_draft(tg, dr):
        qs = [distribution(dr[j], cfg) for j in range(K)]
        return [q.draw(rng) for q in qs], qs

    def old_accept(tg, dr):
        toks, q = old_draft(tg, dr)
        return old_speculative_accept(toks, q, old_probs_from_logits(tg, cfg), rng)

    def new_accept(tg, dr):
        toks, qs = new_draft(tg, dr)
        return speculative_accept(toks, qs, Rows(tg, cfg), rng)

    lookup = [int(x) for x in targets[:K].argmax(-1)]  # copied drafts: usually the target's top token

    def old_lookup(tg, dr):
        q = torch.nn.functional.one_hot(torch.tensor(lookup), tg.shape[1]).float()
        return old_speculative_accept(lookup, q, old_probs_from_logits(tg, cfg), rng)

    def new_lookup(tg, dr):
        return speculative_accept(lookup, [PointMass(x) for x in lookup], Rows(tg, cfg), rng)

    t = Table(title=f"one speculative step's sampling work, K = {K}, temperature 0.8 + top_p 0.95 (ms)")
    for c in ("work", "old", "new", "speedup"):
        t.add_column(c)
    for name, (fo, fn) in {"draft side: K draft rows (EE layer 12)": (old_draft, new_draft),
                           "draft + acceptance (K+1 target rows, lazily)": (old_accept, new_accept),
                           "prompt lookup: acceptance of K copied tokens": (old_lookup, new_lookup)}.items():
        old = per_call_ms(fo, steps, max(3, repeats // 4))
        new = per_call_ms(fn, steps, repeats)
        out[name] = {"old_ms": old, "new_ms": new}
        t.add_row(name, f"{old:.2f}", f"{new:.3f}", f"{old / new:.0f}x")
    console.print(t)
    return out


# ---- end to end --------------------------------------------------------------------------------


def run_methods(m, prompts_ids, methods: dict[str, dict], max_new: int, repeats: int = 1) -> dict:
    """Every method on every prompt, interleaved, after one warm-up each; each (prompt, method)
    run `repeats` times (same seed: the same tokens) and timed by its fastest run, which is
    what a busy shared machine distorts least. -> per-method totals."""
    for kw in methods.values():
        m.generate(prompts_ids[0], max_new_tokens=8, **kw)
    tot = {k: dict(time_s=0.0, new_tokens=0, accepted=0, drafted=0, verify_steps=0) for k in methods}
    for i, ids in enumerate(prompts_ids):
        for name, kw in methods.items():
            runs = [m.generate(ids, max_new_tokens=max_new, seed=i, **kw) for _ in range(repeats)]
            r = runs[0]
            s = tot[name]
            s["time_s"] += min(x.stats.time_s for x in runs)
            s["new_tokens"] += r.stats.new_tokens
            s["accepted"] += r.stats.accepted
            s["drafted"] += r.stats.drafted
            s["verify_steps"] += r.stats.verify_steps
    for s in tot.values():
        s["tokens_per_second"] = s["new_tokens"] / s["time_s"]
        s["acceptance_rate"] = s["accepted"] / s["drafted"] if s["drafted"] else 0.0
        s["mean_accepted_length"] = (s["accepted"] + s["verify_steps"]) / s["verify_steps"]
    return tot


def e2e_section(m, prompts_ids, max_new: int, repeats: int, console: Console) -> dict:
    methods = {
        "AR greedy": dict(strategy="autoregressive"),
        "AR sampling": dict(strategy="autoregressive", **SAMPLING),
        "auto sampling (default)": dict(**SAMPLING),
        "auto greedy (default)": dict(),
    }
    res = run_methods(m, prompts_ids, methods, max_new, repeats)
    base = res["AR greedy"]["tokens_per_second"]
    t = Table(title=f"end to end, {len(prompts_ids)} prompts x {max_new} new tokens, temperature 0.8 / top_p 0.95 (sums over prompts)")
    for c in ("method", "tok/s", "vs AR greedy", "vs AR sampling", "acceptance", "tokens/step"):
        t.add_column(c)
    for name, s in res.items():
        s["vs_ar_greedy"] = s["tokens_per_second"] / base
        s["vs_ar_sampling"] = s["tokens_per_second"] / res["AR sampling"]["tokens_per_second"]
        t.add_row(name, f"{s['tokens_per_second']:.1f}", f"{s['vs_ar_greedy']:.2f}x", f"{s['vs_ar_sampling']:.2f}x",
                  f"{s['acceptance_rate']:.0%}" if s["drafted"] else "-", f"{s['mean_accepted_length']:.2f}")
    console.print(t)
    return res


STRATEGIES = {
    "autoregressive": dict(strategy="autoregressive"),
    "auto (default)": dict(),
    "prompt-lookup K=2": dict(strategy="prompt-lookup", num_speculations=2),
    "early-exit E=15 K=3, 16k draft vocab": dict(strategy="early-exit", exit_layer=15, num_speculations=3, draft_vocab=16384),
    "early-exit E=15 K=3 + lookup": dict(strategy="early-exit", exit_layer=15, num_speculations=3, draft_vocab=16384,
                                         lookup_first=True),
    "layer-skip MLP 8,10,13 K=3": dict(strategy="layer-skip", skip_mlp="8,10,13", num_speculations=3),
    "quantized int8, 16k head, K=5": dict(strategy="quantized", draft_bits=8, draft_vocab=16384, num_speculations=5),
    "quantized int4, 16k head, K=4": dict(strategy="quantized", draft_bits=4, draft_vocab=16384, num_speculations=4),
}


def strategies_section(m, prompts_ids, max_new: int, repeats: int, console: Console) -> dict:
    res = {}
    for mode, samp in (("sampling", SAMPLING), ("greedy", {})):
        methods = {name: {**kw, **samp} for name, kw in STRATEGIES.items()}
        r = run_methods(m, prompts_ids, methods, max_new, repeats)
        base = r["autoregressive"]["tokens_per_second"]
        for s in r.values():
            s["speedup"] = s["tokens_per_second"] / base
        res[mode] = r
    t = Table(title=f"speculative sampling (temperature 0.8, top_p 0.95) vs greedy, per strategy, {len(prompts_ids)} prompts x {max_new}")
    for c in ("strategy", "sampling: accept", "tok/step", "tok/s", "vs AR", "greedy: accept", "tok/s", "vs AR"):
        t.add_column(c)
    for name in STRATEGIES:
        s, g = res["sampling"][name], res["greedy"][name]
        t.add_row(name, f"{s['acceptance_rate']:.0%}" if s["drafted"] else "-", f"{s['mean_accepted_length']:.2f}",
                  f"{s['tokens_per_second']:.1f}", f"{s['speedup']:.2f}x",
                  f"{g['acceptance_rate']:.0%}" if g["drafted"] else "-", f"{g['tokens_per_second']:.1f}", f"{g['speedup']:.2f}x")
    console.print(t)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-samples", type=int, default=4, help="prompts per built-in set (code, text)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--sections", default="rows,e2e")
    ap.add_argument("--repeats", type=int, default=20, help="timings per row (rows section)")
    ap.add_argument("--e2e-repeats", type=int, default=2, help="runs per prompt and method, the fastest counts")
    ap.add_argument("--out", default="results/sampling_speed.json")
    args = ap.parse_args()
    console = Console(width=150)
    m = selfspec.load("gemma-3-270m", dtype=args.dtype)
    prompts = [s.prompt for name in ("code", "text") for s in load_dataset(name, args.num_samples, 0).samples]
    ids = [m.encode(p) for p in prompts]
    console.print(f"machine: {machine()}; {len(ids)} prompts (code + text)")
    result = {"machine": machine(), "dtype": args.dtype, "max_new_tokens": args.max_new_tokens, "prompts": len(ids),
              "date": time.strftime("%Y-%m-%d %H:%M")}
    sections = set(args.sections.split(","))
    if "rows" in sections:
        result["rows"] = rows_section(m, ids, args.repeats, console)
    if "e2e" in sections:
        result["e2e"] = e2e_section(m, ids, args.max_new_tokens, args.e2e_repeats, console)
    if "strategies" in sections:
        result["strategies"] = strategies_section(m, ids, args.max_new_tokens, args.e2e_repeats, console)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    console.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
