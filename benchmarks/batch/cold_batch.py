"""The first `generate_batch` of a process against the same call warm (no hidden first-call costs).

    python benchmarks/batch/cold_batch.py [--processes 3] [--prompts 8] [--max-new-tokens 96] [--strategy autoregressive]

Each round starts a fresh Python process that loads the default model (bfloat16) and times
the same `generate_batch` call three times in a row: the first is the cold call, the other
two are warm. Reported per process: cold tok/s, warm tok/s (mean of the two), cold / warm.
Prompts: the built-in `code` and `text` sets (half each, at most 384 tokens), greedy.

Two cases:
  kept    the per-machine caches exist already (the measured costs under ~/.cache/selfspec/costs,
          or $SELFSPEC_COSTS_DIR): every process after the first on a machine
  first   an empty costs directory (--first-too): the very first process on a machine, which
          measures the costs once (load measures the single-sequence costs, the first batch
          its pass costs) and keeps them for every later process

Ratios are measured side by side within one process, by wall time and per CPU second of the
process (time.process_time: on a shared machine the time other processes take is left out of
the second; spinning worker threads count in both calls alike).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks/: common.py


def child(args) -> dict:
    import selfspec
    from selfspec.tools.datasets import load_dataset

    t = time.perf_counter()
    m = selfspec.load(args.model, dtype=args.dtype)
    load_s = time.perf_counter() - t
    half = (args.prompts + 1) // 2
    samples = list(load_dataset("code", half, seed=args.seed).samples) + list(load_dataset("text", args.prompts - half, seed=args.seed).samples)
    ids = [m.encode(s.prompt)[-384:] for s in samples]
    calls, outs = [], []
    for _ in range(3):
        t, c = time.perf_counter(), time.process_time()
        res = m.generate_batch(ids, max_new_tokens=args.max_new_tokens, strategy=args.strategy)
        dt, dc = time.perf_counter() - t, time.process_time() - c
        calls.append({"seconds": dt, "cpu_seconds": dc, "tokens": sum(r.stats.new_tokens for r in res)})
        outs.append([r.token_ids for r in res])
    return {"load_s": load_s, "calls": calls, "same_output": all(o == outs[0] for o in outs)}


def run_child(args, env: dict) -> dict:
    cmd = [sys.executable, __file__, "--child", "--model", args.model, "--dtype", args.dtype, "--prompts", str(args.prompts),
           "--max-new-tokens", str(args.max_new_tokens), "--strategy", args.strategy, "--seed", str(args.seed)]
    out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def summarize(label: str, r: dict) -> dict:
    tps = [c["tokens"] / c["seconds"] for c in r["calls"]]
    cps = [c["tokens"] / c["cpu_seconds"] for c in r["calls"]]  # per CPU second: what other processes take is left out
    warm, warm_cpu = statistics.mean(tps[1:]), statistics.mean(cps[1:])
    row = {"case": label, "load_s": r["load_s"], "cold_tok_s": tps[0], "warm_tok_s": warm, "cold_over_warm": tps[0] / warm,
           "cold_over_warm_cpu": cps[0] / warm_cpu, "calls": r["calls"], "same_output": r["same_output"]}
    print(f"{label:6s} load {r['load_s']:5.1f} s | cold {tps[0]:6.1f} tok/s | warm {warm:6.1f} tok/s "
          f"(calls 2, 3: {tps[1]:.1f}, {tps[2]:.1f}) | cold/warm {tps[0] / warm:.2f}x wall, {cps[0] / warm_cpu:.2f}x per CPU "
          f"second | outputs equal: {r['same_output']}", flush=True)
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gemma-3-270m")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--processes", type=int, default=3, help="fresh processes per case")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--strategy", default="autoregressive")
    p.add_argument("--seed", type=int, default=1, help="prompt selection (1: held out from search's calibration, seed 0)")
    p.add_argument("--first-too", action="store_true", help="also run processes with an empty costs directory")
    p.add_argument("--out", default=None, help="write the rows as JSON")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args)))
        return 0
    print(f"{args.prompts} prompts x {args.max_new_tokens} tokens, {args.strategy}, {args.dtype}; one fresh process per line")
    rows = []
    env = dict(os.environ)
    run_child(args, env)  # the costs this machine keeps exist from here on (the 'kept' case)
    for _ in range(args.processes):
        rows.append(summarize("kept", run_child(args, env)))
    if args.first_too:
        for _ in range(args.processes):
            with tempfile.TemporaryDirectory() as d:
                rows.append(summarize("first", run_child(args, {**env, "SELFSPEC_COSTS_DIR": d})))
    for case in ("kept", "first"):
        for key, what in (("cold_over_warm", "wall"), ("cold_over_warm_cpu", "per CPU second")):
            r = [x[key] for x in rows if x["case"] == case]
            if r:
                print(f"{case}: cold / warm ({what}) median {statistics.median(r):.2f}x (range {min(r):.2f}-{max(r):.2f}) "
                      f"over {len(r)} processes")
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
