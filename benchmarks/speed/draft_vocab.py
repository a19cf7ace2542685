"""Restricted draft vocabulary on the default model: draft cost per token and acceptance at
N in {8k, 16k, 32k, full} (issue "never slower", part 2).

    python benchmarks/speed/draft_vocab.py [--exits 6,9,12,15] [--num-samples 3] [--max-new-tokens 64]

Cost: the measured CostModel (speedup.py): one draft token = layers < E + the draft head
over N tokens; c = that / one autoregressive step. Acceptance: top-1 agreement of the exit
draft with the full model over the model's own greedy continuations of the built-in code
and text prompts (teacher-forced: exactly the greedy acceptance per drafted position), and
how many of the full model's greedy tokens the N most frequent tokens contain at all.
Writes results/draft_vocab.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks/: common.py

from rich.console import Console
from rich.table import Table

import selfspec
from selfspec.search import Calibration, SearchConfig, calibration_prompts

from common import machine

SIZES = (8192, 16384, 32768, None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--exits", default="6,9,12,15")
    ap.add_argument("--num-samples", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", default="results/draft_vocab.json")
    args = ap.parse_args()
    exits = [int(e) for e in args.exits.split(",")]
    m = selfspec.load("gemma-3-270m", dtype=args.dtype)
    prompts = calibration_prompts(SearchConfig(num_samples=args.num_samples))
    cal = Calibration(m, prompts, args.max_new_tokens)
    costs = m.cost_model(tuple(n for n in SIZES if n))
    targets = np.concatenate([np.array(s.ids[s.start + 1 :]) for s in cal.seqs])
    rows = []
    for n in SIZES:
        head_ms = costs.draft_head(n) * 1e3
        covered = 1.0 if n is None else float(np.isin(targets, m.draft_vocabulary(n).cpu().numpy()).mean())
        for E in exits:
            sig = cal.signals(("exit", E), n)
            match = np.concatenate([s.match for s in sig])
            cost = costs.embed + costs.layers(E) + costs.draft_head(n)
            rows.append({"draft_vocab": n or "full", "exit_layer": E, "draft_head_ms": head_ms,
                         "draft_token_ms": cost * 1e3, "c": cost / costs.ar_step, "acceptance": float(match.mean()),
                         "greedy_tokens_in_vocab": covered})
    t = Table(title=f"draft vocabulary on gemma-3-270m ({args.dtype}; {len(cal.seqs)} prompts x {args.max_new_tokens} greedy tokens; "
                    f"AR step {costs.ar_step * 1e3:.1f} ms)")
    for c in ("N", "E", "draft head ms", "draft token ms", "c", "acceptance", "greedy tokens in vocab"):
        t.add_column(c)
    for r in rows:
        t.add_row(str(r["draft_vocab"]), str(r["exit_layer"]), f"{r['draft_head_ms']:.2f}", f"{r['draft_token_ms']:.2f}",
                  f"{r['c']:.3f}", f"{r['acceptance']:.1%}", f"{r['greedy_tokens_in_vocab']:.1%}")
    Console(width=160).print(t)
    out = {"machine": machine(), "dtype": args.dtype, "date": time.strftime("%Y-%m-%d %H:%M"), "ar_step_ms": costs.ar_step * 1e3,
           "costs": costs.to_dict(), "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
