"""How much can self-speculation gain on this machine? The verify cost curve and its ceiling.

Speculation pays because a forward over T positions costs little more than over one, when a
step is bound by reading the weights. This script measures, per model, the forward over T
positions relative to one (v(T)), the cost of one early-exit draft token at a few exit layers
relative to a step (c, full head and restricted draft head), and from them the best speedup
any drafter could reach: a perfect one (every draft accepted), and one accepted with
probability alpha, maximised over K:

    S(K, alpha) = E[N](alpha, K) / (K * c + v(K + 1)),   E[N] = (1 - alpha^(K+1)) / (1 - alpha)

    python benchmarks/speed/verify_cost.py                                  # the default model
    python benchmarks/speed/verify_cost.py --model results/layerskip_demo/lm/final --exits 2,3,6

A model whose weights fit in the CPU's last-level cache is compute-bound: v(T) grows by a
large fraction of a step per extra position, which caps every drafter no matter how good.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]  # the repository, common.py

import selfspec  # noqa: E402
from selfspec.predictor.simulate import expected_tokens  # noqa: E402

from common import machine  # noqa: E402


def timed(fn, min_s: float = 0.3) -> float:
    fn()
    n, t0 = 0, time.perf_counter()
    while True:
        fn()
        n += 1
        if time.perf_counter() - t0 >= min_s:
            return (time.perf_counter() - t0) / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gemma-3-270m")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--context", type=int, default=200, help="positions already in the cache")
    ap.add_argument("--max-t", type=int, default=9)
    ap.add_argument("--exits", default=None, help="exit layers for c (default: L/6, L/3, L/2, 2L/3)")
    ap.add_argument("--draft-vocab", type=int, default=16384)
    ap.add_argument("--alphas", default="0.5,0.7,0.9,1.0")
    ap.add_argument("--out", default=None, help="also write the numbers as JSON here")
    args = ap.parse_args()
    m = selfspec.load(args.model, dtype=args.dtype)
    rt = m.runtime
    L, V = rt.num_layers, m.spec.vocab_size
    exits = [int(e) for e in args.exits.split(",")] if args.exits else sorted({max(1, L // 6), L // 3, L // 2, 2 * L // 3})
    ids = torch.randint(0, min(V, 5000), (args.context + args.max_t,), generator=torch.Generator().manual_seed(0))
    cache = rt.new_cache(args.context + args.max_t)
    n_vocab = min(args.draft_vocab, V)
    small_head = rt.prepare_weight(rt.head_columns(m.draft_vocabulary(n_vocab)).contiguous()) if n_vocab < V else None
    with torch.inference_mode():
        rt.forward(ids[: args.context], 0, cache, last_only=True)
        P = args.context
        step = {T: timed(lambda T=T: rt.forward(ids[P : P + T], P, cache)) for T in range(1, args.max_t + 1)}
        one = ids[P : P + 1]
        draft = {}
        for E in exits:
            h = rt.run_layers(rt.embed(one), 0, E, P, cache)
            layers = timed(lambda E=E: rt.run_layers(rt.embed(one), 0, E, P, cache))
            draft[E] = {"full": layers + timed(lambda h=h: rt.logits(h)),
                        "restricted": layers + (timed(lambda h=h: rt.logits(h, head=small_head)) if small_head is not None else 0.0)}
    v = {T: s / step[1] for T, s in step.items()}
    console = Console(width=140)
    console.print(f"{args.model} ({rt.dtype}, {machine()}): weights {rt.weight_bytes() / 1e6:.0f} MB, "
                  f"a step {step[1] * 1e3:.2f} ms at {P} positions")
    t = Table(title="v(T) = forward over T positions / over 1")
    for T in v:
        t.add_column(f"T={T}")
    t.add_row(*(f"{x:.2f}" for x in v.values()))
    console.print(t)
    alphas = [float(a) for a in args.alphas.split(",")]
    t = Table(title="best speedup over autoregressive any drafter could reach: max over K of E[N] / (K c + v(K+1))")
    for col in ("exit layer", "head", "c", *(f"alpha={a:g}" for a in alphas)):
        t.add_column(col)
    rows = []
    for E, costs in draft.items():
        for head, cost in costs.items():
            if head == "restricted" and small_head is None:
                continue
            c = cost / step[1]
            best = []
            for a in alphas:
                s, k = max((expected_tokens(a, K) / (K * c + v[K + 1]), K) for K in range(1, args.max_t))
                best.append((s, k))
            rows.append({"exit_layer": E, "head": head if head == "full" else f"{n_vocab}", "c": c,
                         "best": {str(a): {"speedup": s, "K": k} for a, (s, k) in zip(alphas, best)}})
            t.add_row(str(E), rows[-1]["head"], f"{c:.2f}", *(f"{s:.2f}x (K={k})" for s, k in best))
    console.print(t)
    if args.out:
        Path(args.out).write_text(json.dumps({"model": args.model, "dtype": str(rt.dtype), "machine": machine(),
                                              "step_s": step[1], "v": v, "drafts": rows}, indent=2))


if __name__ == "__main__":
    main()
