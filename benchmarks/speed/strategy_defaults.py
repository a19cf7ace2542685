"""Each strategy named bare (no options) against its best options, on the built-in sets.

    python benchmarks/speed/strategy_defaults.py [--num-samples 3] [--max-new-tokens 128] [--search search/search.json]

For every strategy a user can name without options (quantized, early-exit, layer-skip,
prompt-lookup) it measures, side by side with autoregressive decoding on the same prompts:

  bare       `--strategy NAME` alone: what SelfSpecModel.draft_config resolves it to for this
             model (the profile's best options for it, else the calibrated choice, else the
             static defaults)
  static     the static defaults of config.py (what the bare name gave before issue 45), where
             they run at all (early-exit and layer-skip need an exit layer / skip sets)
  candidates other options: the best few per strategy of a search (--search search.json, by
             predicted speedup) and --extra NAME:opt=v,... configurations

and reports, per set, each configuration's speedup over autoregressive (ratio of summed
times, each prompt's fastest run), the best measured one per strategy, and bare / best. Greedy, default model,
bfloat16; every output is compared with autoregressive decoding. The prompts are the
built-in `code` and `text` sets at --seed 1, held out from the search's calibration (seed 0).
Configurations run back to back per prompt, their order rotating from prompt to prompt, so
machine drift hits them alike, in --rounds rounds; each prompt counts each configuration's
fastest run (on a shared machine other processes only ever add time: summed times of single
runs there swung a ratio by 2x and more). Read the ratios.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import selfspec
from selfspec.config import DraftConfig
from selfspec.errors import SelfSpecError
from selfspec.tools.datasets import load_dataset

STRATEGIES = ("quantized", "early-exit", "layer-skip", "prompt-lookup")
AR = DraftConfig("autoregressive")


def parse_extra(spec: str) -> DraftConfig:
    """"quantized:draft_vocab=16384,num_speculations=6" -> DraftConfig."""
    name, _, rest = spec.partition(":")
    opts = dict(kv.split("=", 1) for kv in rest.split(",") if kv)
    return DraftConfig.from_dict({"strategy": name, **opts})


def search_candidates(path: str, per_strategy: int) -> list[DraftConfig]:
    """The best `per_strategy` distinct configurations per strategy of a search's trials."""
    trials = json.loads(Path(path).read_text())["trials"]
    out: dict[str, list[DraftConfig]] = {}
    for t in sorted(trials, key=lambda t: -(t.get("value") or 0.0)):
        d = t.get("draft")
        if not d or d.get("strategy") not in STRATEGIES:
            continue
        cfg = DraftConfig.from_dict(d)
        got = out.setdefault(cfg.strategy, [])
        if len(got) < per_strategy and cfg not in got:
            got.append(cfg)
    return [c for cs in out.values() for c in cs]


def configurations(m, args) -> list[tuple[str, DraftConfig]]:
    """(role, config) per configuration to measure, deduplicated (a candidate equal to the bare
    default is measured once, as `bare`)."""
    rows: list[tuple[str, DraftConfig]] = []
    seen: set = set()

    def add(role: str, cfg: DraftConfig) -> None:
        if cfg not in seen:
            seen.add(cfg)
            rows.append((role, cfg))

    for s in STRATEGIES:
        add("bare", m.draft_config(s))
    for s in STRATEGIES:
        try:
            add("static", DraftConfig(s))
        except SelfSpecError:
            pass  # needs an option the static defaults do not have
    for cfg in (search_candidates(args.search, args.per_strategy) if args.search else []) + [parse_extra(e) for e in args.extra]:
        add("candidate", cfg)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gemma-3-270m")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--datasets", default="code,text")
    p.add_argument("--num-samples", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--search", default=None, help="a search.json whose best trials per strategy are candidates")
    p.add_argument("--per-strategy", type=int, default=3, help="candidates per strategy from --search")
    p.add_argument("--extra", action="append", default=[], help="another candidate, e.g. quantized:draft_vocab=16384,num_speculations=6")
    p.add_argument("--rounds", type=int, default=2, help="runs of every prompt and configuration; each keeps its fastest "
                                                          "(other processes only ever add time)")
    p.add_argument("--out", default="strategy-defaults.json")
    args = p.parse_args(argv)

    m = selfspec.load(args.model, dtype=args.dtype)
    confs = configurations(m, args)
    for _, cfg in confs:
        m.drafter(cfg)  # validate (and make what they draft with) before timing
    names = [d.strip() for d in args.datasets.split(",") if d.strip()]
    sets = {n: load_dataset(n, args.num_samples, args.seed).samples for n in names}
    print(f"{len(confs)} configurations + autoregressive, {sum(map(len, sets.values()))} prompts x {args.max_new_tokens} tokens", flush=True)
    order = [AR] + [c for _, c in confs]
    warm = m.encode(sets[names[0]][0].prompt)
    for cfg in order:
        m.generate(warm, max_new_tokens=8, draft=cfg)
    # best[set][prompt][label] = (fastest seconds over the rounds, tokens, output equal to autoregressive)
    best: dict[str, list[dict[str, tuple]]] = {n: [{} for _ in sets[n]] for n in names}
    t_start = time.time()
    for rnd in range(args.rounds):
        for n in names:
            for i, sample in enumerate(sets[n]):
                ids = m.encode(sample.prompt)[-384:]
                j = i + rnd * 7
                rot = order[j % len(order):] + order[: j % len(order)]
                outs = {}
                for cfg in rot:
                    r = m.generate(ids, max_new_tokens=args.max_new_tokens, draft=cfg)
                    outs[cfg.label()] = r
                for label, r in outs.items():
                    old = best[n][i].get(label)
                    same = r.token_ids == outs[AR.label()].token_ids and (old is None or old[2])
                    best[n][i][label] = (min(r.stats.time_s, old[0]) if old else r.stats.time_s, r.stats.new_tokens, same)
                print(f"  round {rnd + 1}: {n} {i + 1}/{len(sets[n])} done ({time.time() - t_start:.0f} s)", flush=True)
    # totals[set][label] = [seconds, tokens, outputs equal to autoregressive]: each prompt's fastest run
    totals: dict[str, dict[str, list]] = {n: {c.label(): [0.0, 0, 0] for c in order} for n in names}
    for n in names:
        for per_prompt in best[n]:
            for label, (secs, tokens, same) in per_prompt.items():
                t = totals[n][label]
                t[0], t[1], t[2] = t[0] + secs, t[1] + tokens, t[2] + same

    def speedup(n: str, cfg: DraftConfig) -> float:
        s, tok, _ = totals[n][cfg.label()]
        a, atok, _ = totals[n][AR.label()]
        return (tok / s) / (atok / a)

    rows = []
    for s in STRATEGIES:
        mine = [(role, c) for role, c in confs if c.strategy == s]
        for n in names:
            best_role, best = max(mine, key=lambda rc: speedup(n, rc[1]))
            bare = next(c for role, c in mine if role == "bare")
            for role, c in mine:
                rows.append({"strategy": s, "set": n, "role": role, "label": c.label(), "draft": c.explicit_options(),
                             "speedup": speedup(n, c), "best": c == best, "bare_over_best": speedup(n, bare) / speedup(n, best),
                             "identical": totals[n][c.label()][2], "prompts": len(sets[n])})
    Path(args.out).write_text(json.dumps({"model": m.name, "dtype": args.dtype, "max_new_tokens": args.max_new_tokens,
                                          "num_samples": args.num_samples, "seed": args.seed, "rows": rows}, indent=1) + "\n")
    print(f"\n| strategy | configuration | role | " + " | ".join(f"{n}: x AR" for n in names) + " |")
    print("|---|---|---|" + "---:|" * len(names))
    for s in STRATEGIES:
        for role, c in [(r, c) for r, c in confs if c.strategy == s]:
            cells = []
            for n in names:
                row = next(x for x in rows if x["set"] == n and x["label"] == c.label())
                same = "" if row["identical"] == row["prompts"] else f" ({row['identical']}/{row['prompts']} identical!)"
                cells.append(f"{'**' if row['best'] else ''}{row['speedup']:.2f}x{'**' if row['best'] else ''}{same}")
            print(f"| {s} | {c.label()} | {role} | " + " | ".join(cells) + " |")
    print()
    for s in STRATEGIES:
        ratios = [next(x["bare_over_best"] for x in rows if x["strategy"] == s and x["set"] == n) for n in names]
        print(f"{s}: bare / best measured " + ", ".join(f"{n} {r:.2f}" for n, r in zip(names, ratios)))
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
