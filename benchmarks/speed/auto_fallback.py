"""`--strategy auto` against plain decoding, side by side in one run (issue "never slower").

    python benchmarks/speed/auto_fallback.py [--num-samples 3] [--max-new-tokens 128] [--dtype bfloat16]

Sections (greedy, built-in prompt sets code + text, interleaved per prompt, outputs compared):
  default      the untrained default model: auto (its shipped profile), auto gating a bad
               draft (early exit at layer 12, full head: 0.3-0.4x on its own), and that bad
               draft alone. Target: auto >= 0.97x autoregressive.
  ideal        the default model with layers >= 6 zeroed (early exit at 6 is always right),
               no profile: auto calibrates on the prompt. Target: auto >= 1.2x.
Writes results/auto_fallback.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks/: common.py

from rich.console import Console
from rich.table import Table

import selfspec
from selfspec.config import DraftConfig
from selfspec.tools.datasets import load_dataset

from common import machine
from engine_efficiency import ideal_model

AR = DraftConfig("autoregressive")


def run(m, prompts_ids: list[list[int]], methods: dict[str, DraftConfig], max_new: int) -> dict:
    """Every method on every prompt, interleaved; one warm-up pass first."""
    for cfg in methods.values():
        m.generate(prompts_ids[0], max_new_tokens=8, draft=cfg)
    times = {k: 0.0 for k in methods}
    tokens = {k: 0 for k in methods}
    same = {k: True for k in methods}
    acc = {k: [0, 0] for k in methods}
    for ids in prompts_ids:
        ref = None
        for name, cfg in methods.items():
            out = m.generate(ids, max_new_tokens=max_new, draft=cfg)
            times[name] += out.stats.time_s
            tokens[name] += out.stats.new_tokens
            acc[name][0] += out.stats.accepted
            acc[name][1] += out.stats.drafted
            if ref is None:
                ref = out.token_ids
            same[name] &= out.token_ids == ref
    base = tokens["autoregressive"] / times["autoregressive"]
    rows = {}
    for name in methods:
        tps = tokens[name] / times[name]
        d = m.drafter(methods[name])
        rows[name] = {
            "tokens_per_second": tps,
            "speedup": tps / base,
            "acceptance_rate": acc[name][0] / acc[name][1] if acc[name][1] else 0.0,
            "drafted": acc[name][1],
            "identical": same[name],
            "base": d.base.cfg.to_dict() if getattr(d, "base", None) is not None else None,
        }
    return rows


def table(title: str, rows: dict) -> Table:
    t = Table(title=title)
    for c in ("method", "tok/s", "vs AR", "acceptance", "drafted", "identical"):
        t.add_column(c)
    for name, r in rows.items():
        t.add_row(name, f"{r['tokens_per_second']:.1f}", f"{r['speedup']:.3f}x", f"{r['acceptance_rate']:.0%}",
                  str(r["drafted"]), str(r["identical"]))
    return t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-samples", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--sections", default="default,ideal")
    ap.add_argument("--out", default="results/auto_fallback.json")
    args = ap.parse_args()
    console = Console(width=140)
    m = selfspec.load("gemma-3-270m", dtype=args.dtype)
    prompts = [s.prompt for name in ("code", "text") for s in load_dataset(name, args.num_samples, 0).samples]
    ids = [m.encode(p) for p in prompts]
    result = {"machine": machine(), "dtype": args.dtype, "max_new_tokens": args.max_new_tokens, "prompts": len(ids),
              "date": time.strftime("%Y-%m-%d %H:%M")}
    sections = set(args.sections.split(","))
    if "default" in sections:
        bad = DraftConfig("early-exit", exit_layer=12, num_speculations=4)
        methods = {"autoregressive": AR, "auto (shipped profile)": DraftConfig("auto"),
                   "auto gating EE E=12 K=4": DraftConfig("auto", base=bad), "EE E=12 K=4 alone": bad}
        rows = run(m, ids, methods, args.max_new_tokens)
        result["default"] = rows
        console.print(table(f"untrained default model ({args.dtype}, {len(ids)} prompts x {args.max_new_tokens} tokens)", rows))
    if "ideal" in sections:
        mi = ideal_model(getattr(torch, args.dtype), list(range(6, 18)))
        methods = {"autoregressive": AR, "auto (calibrated)": DraftConfig("auto"),
                   "EE E=6 K=8 (oracle choice)": DraftConfig("early-exit", exit_layer=6, num_speculations=8)}
        rows = run(mi, ids, methods, args.max_new_tokens)
        result["ideal"] = rows
        console.print(table("ideal-drafter model (layers >= 6 zeroed), no profile", rows))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    console.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
