"""selfspec autoregressive decoding vs transformers `generate`, default model, greedy.

Both run interleaved prompt by prompt in one process (machine drift hits both), after a
warm-up, for bfloat16 and float32. Also prints the share of the memory-bandwidth floor:
weight bytes x tokens/s / measured copy bandwidth.

    .venv/bin/python benchmarks/speed/ar_vs_transformers.py [--max-new-tokens 128] [--dtypes bfloat16,float32]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks/: common.py
from common import PROMPTS, copy_bandwidth_gbs, hf_generate_tps, hf_model, machine  # noqa: E402
from rich.console import Console
from rich.table import Table

import selfspec


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--prompts", type=int, default=len(PROMPTS))
    args = ap.parse_args()
    console = Console()
    bw = copy_bandwidth_gbs()
    console.print(f"machine: {machine()}; copy bandwidth {bw:.1f} GB/s")
    table = Table(title=f"greedy, {args.max_new_tokens} new tokens, {args.prompts} prompts (mean tok/s)")
    for col in ("dtype", "transformers tok/s", "selfspec tok/s", "ratio", "same tokens", "bandwidth-floor share"):
        table.add_column(col)
    for name in args.dtypes.split(","):
        dtype = getattr(torch, name)
        m = selfspec.load("gemma-3-270m", dtype=name)
        hf = hf_model(dtype)
        ids_list = [m.encode(p) for p in PROMPTS[: args.prompts]]
        # warm-up both
        m.generate(ids_list[0], max_new_tokens=8, strategy="autoregressive")
        hf_generate_tps(hf, ids_list[0], 8)
        ours, theirs, same = [], [], 0
        for ids in ids_list:
            r = m.generate(ids, max_new_tokens=args.max_new_tokens, strategy="autoregressive")
            tps_hf, hf_ids = hf_generate_tps(hf, ids, args.max_new_tokens, min_new_tokens=args.max_new_tokens, eos_token_id=None)
            r = m.generate(ids, max_new_tokens=args.max_new_tokens, strategy="autoregressive")  # interleaved: ours, theirs, ours
            ours.append(r.stats.tokens_per_second)
            theirs.append(tps_hf)
            n = min(len(hf_ids), len(r.token_ids))
            same += hf_ids[:n] == r.token_ids[:n]
        weight_bytes = m.runtime.weight_bytes()
        o, t = statistics.mean(ours), statistics.mean(theirs)
        share = weight_bytes * o / (bw * 1e9)
        table.add_row(name, f"{t:.1f}", f"{o:.1f}", f"{o / t:.2f}x", f"{same}/{len(ids_list)}", f"{share:.0%} ({weight_bytes / 1e6:.0f} MB)")
        del hf, m
    console.print(table)


if __name__ == "__main__":
    main()
