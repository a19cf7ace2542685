"""Generation speed by calling thread: the main thread, a worker thread, a new thread per call.

A server's engine, a web framework's thread pool or a user's own thread calls `generate` from
a thread other than the one that loaded the model. The kernels run on their own thread pool
(csrc/pool.c), so the calling thread must not matter; with OpenMP (before) a second thread's
pool made every pool's workers sleep between parallel regions and such calls ran ~0.7x.

    .venv/bin/python benchmarks/speed/threads.py [--strategy autoregressive] [--rounds 3] [--max-new-tokens 128]

Per round, interleaved: one greedy generation per prompt from the main thread, from one
long-lived worker thread, and from a fresh thread per call; tok/s summed over the prompts,
the best round counting. Outputs are checked to be identical.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks/: common.py

import selfspec  # noqa: E402
from selfspec.tools.datasets import load_dataset  # noqa: E402

from common import machine  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gemma-3-270m")
    ap.add_argument("--strategy", default="autoregressive")
    ap.add_argument("--num-samples", type=int, default=2, help="prompts per built-in set (code, text)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    m = selfspec.load(args.model, dtype="bfloat16")
    prompts = [s.prompt for name in ("code", "text") for s in load_dataset(name, args.num_samples, 0).samples]
    m.generate(prompts[0], max_new_tokens=8, strategy=args.strategy)  # warm-up

    def one(p):
        t = time.perf_counter()
        r = m.generate(p, max_new_tokens=args.max_new_tokens, strategy=args.strategy)
        return r.token_ids, time.perf_counter() - t

    def fresh_thread(p):
        box = []
        th = threading.Thread(target=lambda: box.append(one(p)))
        th.start()
        th.join()
        return box[0]

    worker = ThreadPoolExecutor(max_workers=1)
    ways = {"main thread": one, "a worker thread": lambda p: worker.submit(one, p).result(), "a new thread per call": fresh_thread}
    best = {w: 0.0 for w in ways}
    outputs: dict[str, list] = {}
    for _ in range(args.rounds):
        for way, call in ways.items():
            n = t = 0.0
            outs = []
            for p in prompts:
                ids, dt = call(p)
                n, t = n + len(ids), t + dt
                outs.append(ids)
            best[way] = max(best[way], n / t)
            outputs.setdefault(way, outs)
            if outs != outputs["main thread"]:
                raise SystemExit(f"outputs from {way} differ from the main thread's: a bug, please report it")
    worker.shutdown()
    print(f"machine: {machine()}; {args.model}, bfloat16, {args.strategy}, greedy, {len(prompts)} prompts x {args.max_new_tokens} tokens")
    print("| called from | tok/s | vs main thread |\n|---|---:|---:|")
    for way, v in best.items():
        print(f"| {way} | {v:.1f} | {v / best['main thread']:.2f}x |")
    print("outputs identical from every thread")


if __name__ == "__main__":
    main()
