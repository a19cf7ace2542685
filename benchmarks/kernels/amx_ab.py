"""The AMX chain (the layer matrices on tiles, the default where the CPU has AMX-BF16) against
VDPBF16PS (SELFSPEC_AMX=0), side by side.

    layers     the model's bf16 layer matrices streamed as a pass reads them, at T rows, packed
               both ways in one process and alternated round by round (median of the rounds;
               T = 1 is a decode step, 7 a K=6 verification, 64+ a prefill)
    generate   tok/s of autoregressive, the default (auto) and quantized drafting, greedy and
               sampled (T 0.8, top_p 0.95, seeded), over the built-in code + text prompts, in
               child processes with SELFSPEC_AMX=0 / 1 alternating (0, 1, 1, 0, ...: the chain
               is chosen once per process); each child checks its speculative greedy outputs
               against its own autoregressive ones

    python benchmarks/kernels/amx_ab.py                       # default model, 4 + 4 prompts x 128 tokens
    python benchmarks/kernels/amx_ab.py --rows 1,7,16 --num-samples 2 --json out.json
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import subprocess
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
from selfspec.runtime import _MATRICES  # noqa: E402
from selfspec.tools.datasets import load_dataset  # noqa: E402

from common import machine  # noqa: E402
from stream_overlap import chain  # noqa: E402

METHODS = {"autoregressive": {"strategy": "autoregressive"}, "auto": {"strategy": "auto"},
           "quantized": {"strategy": "quantized", "draft_vocab": 16384, "num_speculations": 6}}


def layers(rt, rows_list: list[int], rounds: int) -> list[dict]:
    plain = [L[k].unpack() if isinstance(L[k], kernels.PackedWeight) else L[k] for L in rt.layers for k in _MATRICES if k in L]
    copies = {amx: [kernels.pack(w, amx=amx) for w in plain] for amx in (False, True)}
    out = []
    for rows in rows_list:
        runs = {amx: chain(ws, rows, torch.bfloat16) for amx, ws in copies.items()}
        ts = {False: [], True: []}
        for r in range(rounds + 1):  # round 0 warms both up
            for amx in (False, True) if r % 2 == 0 else (True, False):
                t = runs[amx]()
                if r:
                    ts[amx].append(t)
        off, on = statistics.median(ts[False]), statistics.median(ts[True])
        out.append({"rows": rows, "vdpbf16_ms": 1000 * off, "amx_ms": 1000 * on, "speedup": off / on})
    return out


def child(model: str, num_samples: int, max_new: int) -> dict:
    """One process's tok/s per (method, mode), and whether greedy drafts changed a token."""
    m = selfspec.load(model, dtype="bfloat16")
    prompts = [s.prompt for name in ("code", "text") for s in load_dataset(name, num_samples, 0).samples]
    m.generate(prompts[0], max_new_tokens=4, strategy="auto")  # auto's costs measured before timing
    tok, sec = collections.Counter(), collections.Counter()
    identical = True
    for i, p in enumerate(prompts):
        for sampled in (False, True):
            kw = {"temperature": 0.8, "top_p": 0.95, "seed": i} if sampled else {}
            ref = None
            for name, opts in METHODS.items():
                t0 = time.perf_counter()
                r = m.generate(p, max_new_tokens=max_new, **kw, **opts)
                key = f"{name}/{'sampled' if sampled else 'greedy'}"
                sec[key] += time.perf_counter() - t0
                tok[key] += len(r.token_ids)
                if ref is None:
                    ref = r.token_ids
                elif not sampled and r.token_ids != ref:
                    identical = False
    return {"amx": kernels.amx(), "identical": identical, "tok_s": {k: tok[k] / sec[k] for k in tok}}


def generate(args) -> tuple[list[dict], bool]:
    runs: dict[bool, list[dict]] = {False: [], True: []}
    for amx in (r % 4 in (1, 2) for r in range(2 * args.rounds_generate)):  # off, on, on, off, off, on, ...
        cmd = [sys.executable, __file__, "--child", "--model", args.model, "--num-samples", str(args.num_samples),
               "--max-new-tokens", str(args.max_new_tokens)]
        p = subprocess.run(cmd, env={**os.environ, "SELFSPEC_AMX": "1" if amx else "0"}, capture_output=True, text=True)
        if p.returncode != 0:
            raise RuntimeError(f"the child (SELFSPEC_AMX={int(amx)}) failed: {p.stderr.strip().splitlines()[-1:]}")
        r = json.loads(p.stdout.strip().splitlines()[-1])
        if r["amx"] != amx:
            raise RuntimeError(f"the child with SELFSPEC_AMX={int(amx)} ran with amx={r['amx']}")
        runs[amx].append(r)
    rows = []
    for key in runs[False][0]["tok_s"]:
        off, on = (statistics.mean(r["tok_s"][key] for r in runs[v]) for v in (False, True))
        ar = "autoregressive/" + key.split("/")[1]
        ar_off, ar_on = (statistics.mean(r["tok_s"][ar] for r in runs[v]) for v in (False, True))
        rows.append({"method": key, "vdpbf16_tok_s": off, "amx_tok_s": on, "vdpbf16_vs_ar": off / ar_off,
                     "amx_vs_ar": on / ar_on, "amx_vs_vdpbf16": on / off})
    return rows, all(r["identical"] for v in runs.values() for r in v)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gemma-3-270m")
    ap.add_argument("--rows", default="1,2,4,7,16,64,128", help="row counts for the layers table (default %(default)s)")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--num-samples", type=int, default=4, help="prompts from each of code and text (0: no generate table)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--rounds-generate", type=int, default=2, help="child processes per chain (default %(default)s)")
    ap.add_argument("--json", default=None, help="also write the numbers here")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.model, args.num_samples, args.max_new_tokens)))
        return 0
    try:
        rows_list = [int(r) for r in args.rows.split(",") if r]
    except ValueError:
        ap.error(f"--rows must be comma-separated integers, got {args.rows!r}")
    if (not rows_list or min(rows_list) < 1 or args.rounds < 1 or args.num_samples < 0 or args.max_new_tokens < 1
            or args.rounds_generate < 1):
        ap.error("--rows, --rounds and --rounds-generate must be >= 1, --num-samples >= 0, --max-new-tokens >= 1")
    if not kernels.amx():
        print("error: no AMX pair path here (it needs the kernels, AVX512-BF16, AMX-BF16 and the kernel's "
              "permission for tile state; SELFSPEC_AMX=0 turns it off)", file=sys.stderr)
        return 2
    try:
        m = selfspec.load(args.model, dtype="bfloat16")
    except (OSError, ValueError) as e:  # SelfSpecError is a ValueError: an unknown alias, a bad path
        print(f"error: cannot load {args.model!r}: {e}", file=sys.stderr)
        return 2
    report: dict = {"model": args.model, "machine": machine()}
    console = Console()
    report["layers"] = layers(m.runtime, rows_list, args.rounds)
    del m  # the children load their own
    t = Table(title=f"{args.model} bf16 layer matrices, streamed ({machine()})")
    for col in ("rows", "VDPBF16PS ms", "AMX ms", "AMX speedup"):
        t.add_column(col, justify="right")
    for r in report["layers"]:
        t.add_row(str(r["rows"]), f"{r['vdpbf16_ms']:.2f}", f"{r['amx_ms']:.2f}", f"{r['speedup']:.2f}x")
    console.print(t)
    if args.num_samples:
        try:
            report["generate"], report["greedy_identical"] = generate(args)
        except RuntimeError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        n = 2 * args.num_samples
        t = Table(title=f"{n} prompts x {args.max_new_tokens} tokens, tok/s (mean of {args.rounds_generate} processes each)")
        for col in ("method", "SELFSPEC_AMX=0", "vs AR", "AMX", "vs AR", "AMX / off"):
            t.add_column(col, justify="right")
        for r in report["generate"]:
            t.add_row(r["method"], f"{r['vdpbf16_tok_s']:.1f}", f"{r['vdpbf16_vs_ar']:.2f}x", f"{r['amx_tok_s']:.1f}",
                      f"{r['amx_vs_ar']:.2f}x", f"{r['amx_vs_vdpbf16']:.2f}x")
        console.print(t)
        console.print("greedy speculative outputs identical to autoregressive on each chain: "
                      + ("yes" if report["greedy_identical"] else "NO"))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0 if report.get("greedy_identical", True) else 1


if __name__ == "__main__":
    sys.exit(main())
