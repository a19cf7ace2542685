"""The int8-screened exact greedy head (selfspec/greedy_head.py) against the full head, side by side.

    .venv/bin/python benchmarks/kernels/greedy_head.py [--num-samples 3] [--max-new-tokens 128] [--repeats 2]

Part 1, the head alone: final norm + LM head of the default model at 1..8 rows (real hidden
states from greedy continuations), full bf16 head vs argmax-only (int8 screen + exact
candidates), median of repeated calls, interleaved; candidates per row.
Part 2, generation: greedy on the built-in `code` and `text` sets, each prompt run with the
screen on and off, interleaved (the screen toggled on the same loaded model), for
autoregressive decoding, the default strategy (auto) and the quantized self-draft alone.
Outputs must be token-identical (checked). tok/s over all prompts, fastest of --repeats runs.
Writes results/greedy_head.json.
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
from selfspec.greedy_head import ScreenedHead, screened_head
from selfspec.tools.datasets import load_dataset

from common import machine

STRATEGIES = {"autoregressive": {}, "auto (default)": {"strategy": None},
              "quantized int8 K=5": {"strategy": "quantized", "draft_vocab": 16384, "num_speculations": 5}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-samples", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default="results/greedy_head.json")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    con = Console()
    m = selfspec.load("gemma-3-270m")
    rt = m.runtime
    sh = screened_head(rt)  # made at load (Runtime.warm_up); timed again here
    t0 = time.perf_counter()
    ScreenedHead.make(rt.head)
    made_s = time.perf_counter() - t0
    if sh is None:
        con.print("[red]the screened head does not apply here (no kernels, or SELFSPEC_EXACT_HEAD=1)[/red]")
        sys.exit(2)
    prompts = [s.prompt for name in ("code", "text") for s in load_dataset(name, args.num_samples).samples]

    # part 1: the head alone, on real hidden states
    xs = []
    with torch.inference_mode():
        for p in prompts:
            r = m.generate(p, max_new_tokens=32, strategy="autoregressive")
            ids = torch.tensor(m.encode(p, False) + r.token_ids)
            h = rt.run_layers(rt.embed(ids), 0, rt.num_layers, 0, rt.new_cache(len(ids) + 4))
            xs.append(h[-32:])
    H = torch.cat(xs)
    head_rows = []
    with torch.inference_mode(), rt.compute_scope():  # as in a generation
        for rows in (1, 2, 3, 4, 6, 8):
            full_t, scr_t = [], []
            c0, r0 = sh.candidates, sh.rows
            for i in range(0, H.shape[0] - rows, max(rows, 8)):
                h = H[i : i + rows]
                for which, ts in (("full", full_t), ("screen", scr_t)):
                    t = time.perf_counter()
                    out = rt.argmax(h) if which == "screen" else rt.logits(h).argmax(-1).tolist()
                    ts.append(time.perf_counter() - t)
                    if which == "full":
                        ref = out
                    elif out != ref:
                        raise SystemExit("the screened argmax differs from the full head's: a bug, please report it")
            head_rows.append({"rows": rows, "full_ms": 1e3 * statistics.median(full_t), "screened_ms": 1e3 * statistics.median(scr_t),
                              "candidates_per_row": (sh.candidates - c0) / max(sh.rows - r0, 1)})

    # part 2: generation, screen on/off interleaved per prompt
    results = {}
    for label, opts in STRATEGIES.items():
        opts = dict(opts)
        strategy = opts.pop("strategy", "autoregressive")
        best = {"on": {}, "off": {}}
        for rep in range(args.repeats):
            for i, p in enumerate(prompts):
                for mode in ("off", "on") if (rep + i) % 2 == 0 else ("on", "off"):
                    rt._screened = sh if mode == "on" else None
                    t = time.perf_counter()
                    r = m.generate(p, max_new_tokens=args.max_new_tokens, strategy=strategy, **opts)
                    dt = time.perf_counter() - t
                    prev = best[mode].get(i)
                    if prev is not None and prev[1] != r.token_ids:
                        raise SystemExit(f"{label}: greedy output changed between repeats")
                    best[mode][i] = (min(dt, prev[0]) if prev else dt, r.token_ids)
        rt._screened = sh
        for i in best["on"]:
            if best["on"][i][1] != best["off"][i][1]:
                raise SystemExit(f"{label}: the screen changed the output of prompt {i}: a bug, please report it")
        n = sum(len(best["on"][i][1]) for i in best["on"])
        tps = {mode: n / sum(v[0] for v in best[mode].values()) for mode in best}
        results[label] = {"tokens": n, "full_tok_s": tps["off"], "screened_tok_s": tps["on"], "ratio": tps["on"] / tps["off"]}

    t1 = Table(title="LM head: full bf16 vs argmax-only (int8 screen + exact candidates), median ms")
    for c in ("rows", "full", "screened", "ratio", "candidates/row"):
        t1.add_column(c, justify="right")
    for r in head_rows:
        t1.add_row(str(r["rows"]), f"{r['full_ms']:.2f}", f"{r['screened_ms']:.2f}", f"{r['full_ms'] / r['screened_ms']:.2f}x",
                   f"{r['candidates_per_row']:.0f}")
    con.print(t1)
    t2 = Table(title=f"greedy generation, {len(prompts)} prompts x {args.max_new_tokens} tokens, tok/s (outputs identical)")
    for c in ("strategy", "full head", "screened", "ratio"):
        t2.add_column(c, justify="right")
    for label, r in results.items():
        t2.add_row(label, f"{r['full_tok_s']:.1f}", f"{r['screened_tok_s']:.1f}", f"{r['ratio']:.2f}x")
    con.print(t2)
    con.print(f"screen: {sh.nbytes / 1e6:.0f} MB (the bf16 head: {rt.head.data.numel() * rt.head.data.element_size() / 1e6:.0f} MB), "
              f"made in {made_s:.1f} s")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": machine(), "head": head_rows, "generation": results, "screen_mb": sh.nbytes / 1e6,
                               "made_s": made_s, "args": vars(args)}, indent=1) + "\n")


if __name__ == "__main__":
    main()
