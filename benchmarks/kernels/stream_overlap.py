"""Do the kernels overlap streaming the weights with computing on them? The verify pass's headroom.

A verification of T rows reads every weight once, like a decode step, and does T times its
arithmetic. On a CPU where T = 4-8 rows of compute take about as long as the weights take to
stream, the pass costs max(stream, compute) if the two overlap and their sum if they do not.
This script times, for the model's own layer matrices (the bf16 verifier's, and optionally
the int8 draft copy's) at each row count T:

    streamed   every layer's matrices once, as a pass reads them (more bytes than the L2s hold:
               from memory, or from a large shared L3's share)
    in cache   the same number of matmuls on the first layer's matrices only (a few MB that
               stay cached: mostly the compute)
    floor      max(streamed at T = 1, in cache at T): what a perfect overlap would take
    overlap    floor / streamed (1.0: perfectly overlapped; ~0.5: serialised)

    python benchmarks/kernels/stream_overlap.py                   # default model, bf16, T = 1,2,4,6,7,8,16
    python benchmarks/kernels/stream_overlap.py --int8 --json out.json

The matmuls are called through the kernels' C entry point directly (no tensor allocation per
call), one after another as a pass makes them; the fused blocks add attention and norms,
which are small beside them at these row counts. Rounds alternate the two measurements, a
cell is the median round (the machine's speed drifts).
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

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]  # the repository, common.py

import selfspec  # noqa: E402
from selfspec import kernels  # noqa: E402
from selfspec.kernels import build  # noqa: E402
from selfspec.kernels.gemm import operand  # noqa: E402
from selfspec.kernels.weights import nbytes as _nbytes  # noqa: E402
from selfspec.runtime import _MATRICES  # noqa: E402

from common import machine  # noqa: E402


def chain(weights: list, rows: int, dtype: torch.dtype):
    """A function running x @ w for every weight in order (each x and y preallocated) -> seconds."""
    fn, _ = build._load()
    nt = kernels.threads()
    calls, keep = [], []  # keep: the x and y tensors the calls point into
    for w in weights:
        k, n = w.shape
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(k)).to(dtype)
        y = torch.empty(rows, n, dtype=dtype)
        keep += [x, y]
        wp, layout, w_bf16 = operand(w)
        calls.append((rows, k, n, x.data_ptr(), x.dtype == torch.bfloat16, wp, w_bf16, layout, y.data_ptr(),
                      y.dtype == torch.bfloat16, nt))

    def run() -> float:
        t0 = time.perf_counter()
        for c in calls:
            if fn(*c):
                raise RuntimeError("kernel call failed")
        return time.perf_counter() - t0

    run.keep = keep

    return run


def measure(layers: list[dict], rows_list: list[int], rounds: int, dtype: torch.dtype) -> list[dict]:
    streamed = [L[k] for L in layers for k in _MATRICES if k in L]
    first = [layers[0][k] for k in _MATRICES if k in layers[0]]
    resident = first * len(layers)  # the same calls, on one layer's matrices
    out = []  # rows_list starts at 1: the streamed 1-row time is every floor's memory part
    for rows in rows_list:
        a, b = chain(streamed, rows, dtype), chain(resident, rows, dtype)
        a(), b()  # warm-up
        ts, tc = [], []
        for r in range(rounds):
            for f, acc in ((a, ts), (b, tc)) if r % 2 == 0 else ((b, tc), (a, ts)):
                acc.append(f())
        s, c = statistics.median(ts), statistics.median(tc)
        floor = max(out[0]["streamed_ms"] / 1000 if out else s, c)
        out.append({"rows": rows, "streamed_ms": 1000 * s, "in_cache_ms": 1000 * c, "floor_ms": 1000 * floor,
                    "overlap": floor / s})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gemma-3-270m")
    ap.add_argument("--rows", default="1,2,4,6,7,8,16", help="row counts T (default %(default)s; 1 is always measured)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--int8", action="store_true", help="also the int8 draft copy's matrices")
    ap.add_argument("--json", default=None, help="also write the numbers here")
    args = ap.parse_args(argv)
    try:
        rows_list = sorted({1} | {int(r) for r in args.rows.split(",")})  # 1: the floors' memory time
    except ValueError:
        ap.error(f"--rows must be comma-separated integers, got {args.rows!r}")
    if rows_list[0] < 1 or args.rounds < 1:
        ap.error("--rows must be >= 1 and --rounds >= 1")
    m = selfspec.load(args.model, dtype="bfloat16")
    rt = m.runtime
    if not rt.uses_kernels:
        print(f"error: the CPU kernels are unavailable here ({rt.kernels_missing()})", file=sys.stderr)
        return 2
    copies = {"bf16 (verifier)": rt.layers}
    if args.int8:
        copies["int8 (draft copy)"] = m.resources.quantized(8).layers
    report = {"model": args.model, "machine": machine(), "copies": {}}
    console = Console()
    for name, layers in copies.items():
        nbytes = sum(_nbytes(L[k]) for L in layers for k in _MATRICES if k in L)
        rows = measure(layers, rows_list, args.rounds, torch.bfloat16)
        report["copies"][name] = {"weight_mb": nbytes / 1e6, "rows": rows}
        t = Table(title=f"{args.model} layer matrices, {name}: {nbytes / 1e6:.0f} MB ({machine()})")
        for col in ("rows", "streamed ms", "in cache ms", "floor ms", "overlap", "GB/s streamed"):
            t.add_column(col, justify="right")
        for r in rows:
            t.add_row(str(r["rows"]), f"{r['streamed_ms']:.2f}", f"{r['in_cache_ms']:.2f}", f"{r['floor_ms']:.2f}",
                      f"{r['overlap']:.2f}", f"{nbytes / r['streamed_ms'] / 1e6:.1f}")
        console.print(t)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
