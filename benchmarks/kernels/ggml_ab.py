"""The GGUF block kernels of this tree against those of an earlier revision, side by side: the
same random weights, the same activations, in one process, the two libraries alternated call by
call (fastest of each), per block type and row count.

    .venv/bin/python benchmarks/kernels/ggml_ab.py --against 0b9c3fb [--threads 1] [--rows 1,2,4,8]
        [--types Q5_0,Q8_0,Q4_K,Q6_K] [--streamed]

The earlier csrc/ggml_gemm.c (with csrc/pool.c) is compiled from `git show REV:...` with the
package's own flags into a temporary directory. This tree's library multiplies the weight as
GGMLWeight lays it out (packed where it packs); the earlier one gets the blocks as stored, the
layout every revision reads. Outputs are compared loosely (the chains differ across revisions).
--streamed: a head-sized weight (262144 x 640, K-quants 163840 x 1024) that streams from memory;
default: 16384 rows, which stay in cache.
"""

from __future__ import annotations

import argparse
import ctypes
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from gguf.constants import GGMLQuantizationType as Q
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # the repository, gguf_files.random_blocks

from gguf_files import random_blocks  # noqa: E402

from selfspec.kernels import build  # noqa: E402
from selfspec.kernels.ggml_gemm import GGMLWeight  # noqa: E402

_ARGS = [ctypes.c_long, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int]


def _library(rev: str | None, tmp: Path) -> ctypes.CDLL:
    """This tree's kernels (rev None), or csrc/ggml_gemm.c + pool.c of git revision rev compiled."""
    if rev is None:
        build._load()
        return build._blocks["dll"]
    for name in ("ggml_gemm.c", "pool.c", "pool.h"):
        text = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:selfspec/csrc/{name}"], capture_output=True, text=True, check=True).stdout
        (tmp / name).write_text(text)
    out = tmp / "old.so"
    subprocess.run(["gcc", *build._FLAGS, "-o", str(out), str(tmp / "ggml_gemm.c"), str(tmp / "pool.c"), "-lm"], check=True)
    return ctypes.CDLL(str(out))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--against", required=True, help="the git revision to compare with")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", default="1,2,4,6,8")
    ap.add_argument("--types", default="Q5_0,Q8_0,Q4_K,Q6_K")
    ap.add_argument("--streamed", action="store_true")
    ap.add_argument("--repeats", type=int, default=10)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        libs = {"then": _library(a.against, Path(tmp)), "now": _library(None, Path(tmp))}
        for lib in libs.values():
            lib.selfspec_ggemm.argtypes = _ARGS
        table = Table(title=f"block products, {a.against} -> this tree ({a.threads} thread(s), ms, fastest of each)")
        table.add_column("type")
        rows = [int(r) for r in a.rows.split(",")]
        for m in rows:
            table.add_column(f"{m} row(s)", justify="right")
        for name in a.types.split(","):
            qt = Q[name]
            K = 1024 if name.endswith("_K") else 640
            N = (163840 if K == 1024 else 262144) if a.streamed else 16384
            w = GGMLWeight([(random_blocks(qt, N, K, 1), qt)], K)
            desc = {"then": ctypes.addressof(w.stored), "now": ctypes.addressof(w.desc)}
            cells = []
            for m in rows:
                x = torch.randn(m, K).bfloat16()
                y = {k: torch.empty(m, N) for k in libs}
                best = dict.fromkeys(libs, float("inf"))
                for rep in range(a.repeats):
                    for k in (("then", "now") if rep % 2 == 0 else ("now", "then")):
                        time.sleep(0.005)  # the other library's workers stop spinning
                        for _ in range(3):
                            t0 = time.perf_counter()
                            libs[k].selfspec_ggemm(m, x.data_ptr(), 1, desc[k], y[k].data_ptr(), 0, a.threads)
                            best[k] = min(best[k], time.perf_counter() - t0)
                scale = y["then"].abs().max().item()
                if (y["then"] - y["now"]).abs().max().item() > 1e-3 * scale:
                    raise SystemExit(f"{name}, {m} rows: the two revisions disagree beyond rounding")
                cells.append(f"{best['then'] * 1e3:.2f} -> {best['now'] * 1e3:.2f} ({best['then'] / best['now']:.2f}x)")
            table.add_row(name, *cells)
        Console(width=160).print(table)


if __name__ == "__main__":
    main()
