"""The GGUF block kernels (csrc/ggml_gemm.c) at Gemma 3 4B's shapes: weight bytes streamed per
second for 1 row (autoregressive decoding) and the cost of R rows against one (a speculative
verify of K drafts is K + 1 rows), per block type, against the bf16 kernel of the same shape.

    .venv/bin/python benchmarks/kernels/ggml_blocks.py [--threads 2] [--rows 1,2,4,6,16] [--repeats 15]

Random blocks (tests/gguf_files.random_blocks: any bytes are a valid block; only the fp16 scales
are kept finite). Each (weight, rows) point: the fastest of --repeats calls, the configurations
interleaved call by call. "GB/s in cache" multiplies one matrix again and again (a matrix below
the last-level cache stays there); "GB/s from memory" cycles through distinct copies of it, 256 MB
in all, as a decode step streams its layers' weights: the rate the step sees.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from gguf.constants import GGMLQuantizationType as Q
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks/: common.py
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))  # gguf_files.random_blocks

from gguf_files import random_blocks  # noqa: E402

from selfspec import kernels  # noqa: E402
from selfspec.kernels.ggml_gemm import GGMLWeight  # noqa: E402

from common import machine  # noqa: E402

# (what, block type, out, in): Gemma 3 4B as Q4_K_M lays it out
SHAPES = [("gate|up", Q.Q4_K, 20480, 2560), ("down (Q6_K layers)", Q.Q6_K, 2560, 10240),
          ("down (Q4_K layers)", Q.Q4_K, 2560, 10240), ("head, a quarter", Q.Q6_K, 65536, 2560),
          ("q|k|v as Q5_K", Q.Q5_K, 4096 + 2048, 2560), ("Q8_0", Q.Q8_0, 10240, 2560),
          ("Q4_0", Q.Q4_0, 10240, 2560)]
STREAM_BYTES = 256 << 20  # "from memory": distinct copies of a weight, this many bytes in all


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rows", default="1,2,4,6,16")
    p.add_argument("--repeats", type=int, default=15)
    a = p.parse_args()
    if not kernels.available():
        sys.exit("ggml_blocks: selfspec's kernels are not built on this machine")
    rows = [int(r) for r in a.rows.split(",")]
    console = Console(width=200)
    table = Table(title=f"GGUF block kernels, {a.threads} threads ({machine()})")
    for col in ["weight", "type", "MB", "1 row ms", "GB/s in cache", "GB/s from memory", "bf16 1 row ms"] + [f"{r} rows / 1" for r in rows if r > 1]:
        table.add_column(col, justify="left" if col in ("weight", "type") else "right")
    for what, qtype, out, inn in SHAPES:
        w = GGMLWeight([(random_blocks(qtype, out, inn, seed=0), qtype)], inn)
        wb = kernels.pack(torch.randn(inn, out).bfloat16())  # the runtime's layout for a bf16 weight
        best = {(k, r): float("inf") for k in ("blocks", "bf16") for r in rows}
        xs = {r: torch.randn(r, inn).bfloat16() for r in rows}
        for _ in range(a.repeats):
            for r in rows:
                for k, weight in (("blocks", w), ("bf16", wb)):
                    if k == "bf16" and r != 1:
                        continue
                    t = time.perf_counter()
                    kernels.matmul(xs[r], weight, num_threads=a.threads)
                    best[k, r] = min(best[k, r], time.perf_counter() - t)
        one = best["blocks", 1]
        n_copies = -(-STREAM_BYTES // w.nbytes)
        copies = [w] + [GGMLWeight([(random_blocks(qtype, out, inn, seed=s), qtype)], inn) for s in range(1, n_copies)]
        cold = float("inf")
        for _ in range(max(3, a.repeats // 3)):
            t = time.perf_counter()
            for c in copies:
                kernels.matmul(xs[1], c, num_threads=a.threads)
            cold = min(cold, time.perf_counter() - t)
        del copies
        table.add_row(what, qtype.name, f"{w.nbytes / 1e6:.1f}", f"{one * 1e3:.2f}", f"{w.nbytes / one / 1e9:.1f}",
                      f"{n_copies * w.nbytes / cold / 1e9:.1f}",
                      f"{best['bf16', 1] * 1e3:.2f}", *[f"{best['blocks', r] / one:.2f}x" for r in rows if r > 1])
    console.print(table)


if __name__ == "__main__":
    main()
