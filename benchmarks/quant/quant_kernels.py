"""How fast the quantized matmuls stream the default model's LM head, next to bfloat16.

A decode step's LM head is one row times a [640, 262144] matrix: pure weight streaming. For
each format (bf16 pairs as the verifier uses it, int8 per channel, int4 groups of 64) this
times M = 1 (a draft token), M = 5 (a K = 4 verification) and M = 8 (a batch drafting together) and reports GB/s of weight bytes
read, against the machine's read bandwidth (a large tensor summed: bytes read per second).
Target (quantized-drafting issue): the int8 head at >= 80% of the read bandwidth.

    .venv/bin/python benchmarks/quant/quant_kernels.py [--repeats 30] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks/: common.py

import selfspec
from selfspec import kernels
from selfspec.quant import quantize_columns

from common import machine


def read_bandwidth_gbs(size_mb: int = 1024, repeats: int = 7) -> float:
    x = torch.ones(size_mb * 2**20 // 4, dtype=torch.float32)
    x.sum()
    best = min(_timed(lambda: x.sum()) for _ in range(repeats))
    return x.numel() * 4 / best / 1e9


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="1,5,8", help="M values (rows) to time")
    ap.add_argument("--out", default="results/quant_kernels.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    m = selfspec.load("gemma-3-270m", dtype="bfloat16")
    rt = m.runtime
    w = rt.head_weight()  # [H, V] bf16
    heads = {"bf16 (verifier)": rt.head, "int8": quantize_columns(w, 8), "int4 g64": quantize_columns(w, 4)}
    bw = read_bandwidth_gbs()
    rows = []
    for name, head in heads.items():
        nbytes = head.nbytes if hasattr(head, "nbytes") else w.numel() * 2
        for M in map(int, args.rows.split(",")):
            x = torch.randn(M, w.shape[0]).to(rt.dtype)
            kernels.matmul(x, head)
            times = [_timed(lambda: kernels.matmul(x, head)) for _ in range(args.repeats)]
            t = statistics.median(times)
            rows.append({"format": name, "M": M, "ms": t * 1e3, "MB": nbytes / 1e6, "GB/s": nbytes / t / 1e9,
                         "of read bandwidth": nbytes / t / 1e9 / bw})
    console = Console(width=120)
    table = Table(title=f"LM head [{w.shape[0]} x {w.shape[1]}], median of {args.repeats}, {args.threads} threads; "
                        f"read bandwidth {bw:.1f} GB/s")
    for c in ("format", "M", "ms", "MB", "GB/s", "of read bandwidth"):
        table.add_column(c)
    for r in rows:
        table.add_row(r["format"], str(r["M"]), f"{r['ms']:.2f}", f"{r['MB']:.0f}", f"{r['GB/s']:.1f}", f"{r['of read bandwidth']:.0%}")
    console.print(table)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"machine": machine(), "read_bandwidth_gbs": bw, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
