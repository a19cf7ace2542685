"""Seeded sampling through the int8-screened head (issue 55), side by side in one run.

Default model, bfloat16, held-out prompts (the built-in sets code, text and summarize drawn with
seed 7; the tests use seed 0), seeded Gumbel-max sampling. Arms, interleaved prompt by prompt
for --rounds rounds (the machine's drift hits every arm alike):

  AR greedy | AR T 1 | AR T 0.8 top_p 0.95 | AR T 0.8 top_k 40 | AR T 1 min_p 0.05
  auto greedy | auto T 1 | auto T 0.8 top_p 0.95
  (each sampled arm screened, and through the exact head)

"exact head" arms run with sampled_head.ENABLED off (every sampled row through the bf16 head,
as before the screen). Prints tok/s (all tokens of an arm over its time), the ratios to the
strategy's greedy (median over rounds of each round's ratio) and whether every screened text is
its exact-head text. Exit status 1 if one is not.

    python benchmarks/sampling/screened_sampling.py [--rounds 5] [--max-new-tokens 128] [--only AR] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import selfspec
from selfspec import sampled_head
from selfspec.greedy_head import screened_head
from selfspec.tools.builtin_sets import builtin_set

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks/: common.py
from common import machine  # noqa: E402

T1 = dict(temperature=1.0)
TOP_P = dict(temperature=0.8, top_p=0.95)
TOP_K = dict(temperature=0.8, top_k=40)
MIN_P = dict(temperature=1.0, min_p=0.05)
# arm -> (strategy, sampling, screened)
ARMS = {
    "AR greedy": ("autoregressive", {}, True),
    "AR T 1": ("autoregressive", T1, True),
    "AR T 1, exact head": ("autoregressive", T1, False),
    "AR T 0.8 top_p 0.95": ("autoregressive", TOP_P, True),
    "AR T 0.8 top_p 0.95, exact head": ("autoregressive", TOP_P, False),
    "AR T 0.8 top_k 40": ("autoregressive", TOP_K, True),
    "AR T 0.8 top_k 40, exact head": ("autoregressive", TOP_K, False),
    "AR T 1 min_p 0.05": ("autoregressive", MIN_P, True),
    "AR T 1 min_p 0.05, exact head": ("autoregressive", MIN_P, False),
    "auto greedy": ("auto", {}, True),
    "auto T 1": ("auto", T1, True),
    "auto T 1, exact head": ("auto", T1, False),
    "auto T 0.8 top_p 0.95": ("auto", TOP_P, True),
    "auto T 0.8 top_p 0.95, exact head": ("auto", TOP_P, False),
}


FULL = {}  # arm -> its rows the screen could not decide (through the full head)


def prompts() -> list[str]:
    return [builtin_set(name, 1, 7, 0).samples[0].prompt for name in ("code", "text", "summarize")]


def run(model, rounds: int, n_new: int) -> tuple[dict, dict, dict]:
    """-> (arm -> [tokens, seconds], arm -> per-round tok/s, (arm, prompt, seed) -> token ids)."""
    sh = screened_head(model.runtime)
    total = {a: [0, 0.0] for a in ARMS}
    per_round = {a: [] for a in ARMS}
    texts = {}
    ps = prompts()
    for r in range(rounds):
        step = {a: [0, 0.0] for a in ARMS}
        for pi, p in enumerate(ps):
            for arm, (strategy, sampling, screened) in ARMS.items():
                sampled_head.ENABLED = screened
                full0 = sh.pick_full
                kw = dict(sampling, seed=100 * r + pi) if sampling else {}
                t0 = time.perf_counter()
                out = model.generate(p, max_new_tokens=n_new, strategy=strategy, **kw)
                dt = time.perf_counter() - t0
                sampled_head.ENABLED = True
                for acc in (total[arm], step[arm]):
                    acc[0] += len(out.token_ids)
                    acc[1] += dt
                texts[(arm, pi, r)] = out.token_ids
                if screened and sampling:
                    FULL[arm] = FULL.get(arm, 0) + sh.pick_full - full0
        for arm in ARMS:
            per_round[arm].append(step[arm][0] / step[arm][1])
    return total, per_round, texts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--json", default=None)
    ap.add_argument("--only", default=None, help="arms starting with this (AR or auto)")
    args = ap.parse_args()
    if args.only:
        for arm in [a for a in ARMS if not a.startswith(args.only)]:
            del ARMS[arm]
    model = selfspec.load("gemma-3-270m", dtype="bfloat16")
    model.generate(prompts()[0], max_new_tokens=8, strategy="autoregressive")  # warm: kernels, screen, auto's costs
    total, per_round, texts = run(model, args.rounds, args.max_new_tokens)
    same = all(texts[(arm.replace(", exact head", ""), pi, r)] == ids
               for (arm, pi, r), ids in texts.items() if arm.endswith("exact head"))
    sh = screened_head(model.runtime)
    print(f"# {machine()}; {args.rounds} rounds x {len(prompts())} prompts x {args.max_new_tokens} tokens")
    print("| arm | tok/s | vs its greedy (median of rounds) |")
    print("|---|---:|---:|")
    rows = {}
    for arm in ARMS:
        base = "AR greedy" if arm.startswith("AR") else "auto greedy"
        ratio = statistics.median(a / b for a, b in zip(per_round[arm], per_round[base]))
        rows[arm] = dict(tok_s=total[arm][0] / total[arm][1], ratio=ratio, per_round=per_round[arm])
        print(f"| {arm} | {rows[arm]['tok_s']:.1f} | {ratio:.3f}x |")
    print(f"screened texts equal to the exact head's: {same}")
    print(f"screened picks {sh.picks}: {sh.pick_candidates / max(sh.picks, 1):.1f} candidates, "
          f"{sh.pick_computed / max(sh.picks, 1):.1f} columns computed a pick; rows through the full head {sh.pick_full}")
    print("screened rows the screen left to the full head, by arm: " + ", ".join(f"{a} {n}" for a, n in FULL.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(machine=machine(), rounds=args.rounds, max_new_tokens=args.max_new_tokens, arms=rows, same=same), f, indent=1)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
