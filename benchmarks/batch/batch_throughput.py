"""Aggregate throughput of batched generation (selfspec.batch) against one request at a time.

    python benchmarks/batch/batch_throughput.py [--concurrency 1,4,8,16] [--max-new-tokens 128] [--hf 1,8]

Default model (Gemma 3 270M), bfloat16, greedy; prompts from the built-in code + text sets.
For each concurrency c the first c prompts are generated (a) one at a time with `generate`
and (b) together with `generate_batch`, autoregressive and with the default strategy (auto),
and, where the installed transformers has it, (c) transformers' continuous batching
(`generate_batch`) on the same token ids. Every selfspec output is checked against solo
autoregressive decoding. Ratios are measured side by side in one run (a shared, noisy
machine: read ratios, not absolute numbers).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks/: common.py

import selfspec  # noqa: E402
from selfspec.tools.datasets import load_dataset  # noqa: E402

from common import hf_batch, hf_model, machine  # noqa: E402


def prompt_ids(m, n: int) -> list[list[int]]:
    half = (n + 1) // 2
    samples = list(load_dataset("code", half, seed=0).samples) + list(load_dataset("text", n - half, seed=0).samples)
    return [m.encode(s.prompt)[-384:] for s in samples]  # prompts of at most 384 tokens


def solo(m, ids: list[list[int]], n_new: int, strategy: str) -> tuple[list[float], list[list[int]]]:
    times, outs = [], []
    for p in ids:
        t = time.perf_counter()
        r = m.generate(p, max_new_tokens=n_new, strategy=strategy)
        times.append(time.perf_counter() - t)
        outs.append(r.token_ids)
    return times, outs


def batched(m, ids, n_new: int, strategy: str) -> tuple[float, list[list[int]], list]:
    t = time.perf_counter()
    res = m.generate_batch(ids, max_new_tokens=n_new, strategy=strategy, max_batch=len(ids))
    return time.perf_counter() - t, [r.token_ids for r in res], res


def measure(m, hf, ids, n: int, c: int, repeats: int, ref: list[list[int]], with_hf: bool) -> dict:
    """One concurrency: every method on the same c prompts, interleaved, fastest of `repeats`."""
    row: dict = {"concurrency": c, "tokens": c * n}
    best: dict[str, float] = {}
    for _ in range(repeats):
        for strat, key in (("autoregressive", "ar"), ("auto", "auto")):
            times, outs = solo(m, ids[:c], n, strat)
            assert outs == ref[:c], f"{strat} solo differs from autoregressive"
            best[key + "_one_at_a_time"] = min(best.get(key + "_one_at_a_time", 1e9), sum(times))
            dt, outs, res = batched(m, ids[:c], n, strat)
            assert outs == ref[:c], f"{strat} batched at {c} differs from solo"
            if dt < best.get(key + "_batched", 1e9):
                best[key + "_batched"] = dt
                row[key + "_batched_longest_stall_s"] = max(r.stats.longest_stall_s for r in res)
                if strat == "auto":
                    row["auto_acceptance"] = sum(r.stats.accepted for r in res) / max(1, sum(r.stats.drafted for r in res))
        if with_hf:
            got = hf_batch(hf, ids[:c], n)
            if got is not None:
                best["hf_generate_batch"] = min(best.get("hf_generate_batch", 1e9), got[0])
                row["hf_same_tokens"] = sum(o == r for o, r in zip(got[1], ref[:c]))
    row.update({k: c * n / v for k, v in best.items()})  # tokens per second
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gemma-3-270m")
    ap.add_argument("--concurrency", default="1,4,8,16")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=1, help="fastest of this many runs per method (a busy machine)")
    ap.add_argument("--hf", default="1,8", help="concurrencies to run transformers' generate_batch at ('' = none)")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    a = ap.parse_args(argv)
    cs = [int(c) for c in a.concurrency.split(",")]
    m = selfspec.load(a.model, dtype="bfloat16", device="cpu")
    ids = prompt_ids(m, max(cs))
    m.eos_token_ids = ()  # no EOS stops: every request produces exactly max-new-tokens (a fair count)
    n = a.max_new_tokens
    m.generate(ids[0], max_new_tokens=8, strategy="auto")  # warm-up (and auto's cost table)
    m.generate_batch(ids[:2], max_new_tokens=8, strategy="auto")  # and the batch costs
    print(f"machine: {machine()}; {len(ids)} prompts, {n} new tokens each, bfloat16, greedy", flush=True)
    ref = [m.generate(p, max_new_tokens=n, strategy="autoregressive").token_ids for p in ids]
    hf_cs = [int(c) for c in a.hf.split(",") if c]
    hf = hf_model(torch.bfloat16) if hf_cs else None
    if hf is not None and not hasattr(hf, "generate_batch"):
        print("transformers has no generate_batch here: skipped", flush=True)
        hf = None
    rows = []
    for c in cs:
        rows.append(measure(m, hf, ids, n, c, a.repeats, ref, hf is not None and c in hf_cs))
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in rows[-1].items()}), flush=True)
    base_ar, base_auto = rows[0]["ar_one_at_a_time"], rows[0]["auto_one_at_a_time"]
    print("\n| sequences | AR one at a time | AR batched | x 1-seq AR | auto one at a time | auto batched | x 1-seq auto "
          "| auto / AR batched | transformers generate_batch |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        hf_s = f"{r['hf_generate_batch']:.1f}" if "hf_generate_batch" in r else "-"
        print(f"| {r['concurrency']} | {r['ar_one_at_a_time']:.1f} | {r['ar_batched']:.1f} | {r['ar_batched'] / base_ar:.2f}x "
              f"| {r['auto_one_at_a_time']:.1f} | {r['auto_batched']:.1f} | {r['auto_batched'] / base_auto:.2f}x "
              f"| {r['auto_batched'] / r['ar_batched']:.2f}x | {hf_s} |")
    if a.out:
        Path(a.out).write_text(json.dumps({"machine": machine(), "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
