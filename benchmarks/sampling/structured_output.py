"""Issue 46 benchmarks: what the OpenAI fields cost, and JSON-schema output under speculation.

  1. cost per row (the default model's vocabulary, 262,144 logits a row, fp32; rows are random
     logits: the processors' cost does not depend on their values): presence + frequency +
     repetition penalties with a 512-token context and 300 logit_bias entries
     (Processing.row, with 4 drafts before the row), and logprobs with 5 alternatives
     (logprobs.token_logprob, greedy and sampled; under top_p also with the distribution
     acceptance built for the row, as a generation computes it); median of --reps, torch single-threaded as
     inside a generation (kernels.compute_scope);
  2. JSON-schema output on the default model (bf16): 8 prompts asking for a record, one schema
     with nested objects and enums, greedy, the default strategy (auto) against autoregressive
     decoding under the same schema, alternating prompt by prompt; tok/s over all tokens of an
     arm, the ratio, the share of tokens drafted free because the grammar forced them (and
     accepted), and whether the outputs are identical (they must be).

    python benchmarks/sampling/structured_output.py                 # both parts
    python benchmarks/sampling/structured_output.py --part costs    # part 1 only (no model)
    python benchmarks/sampling/structured_output.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from selfspec import kernels
from selfspec.config import GenerationConfig, SamplingConfig
from selfspec.logprobs import drawn_from, token_logprob
from selfspec.sampling import distribution
from selfspec.processors import Processing

V = 262_144
SCHEMA = {
    "type": "object", "additionalProperties": False, "required": ["name", "species", "habitat", "diet", "status"],
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "species": {"type": "string", "maxLength": 40},
        "habitat": {"type": "object", "additionalProperties": False, "required": ["continent", "climate"],
                    "properties": {"continent": {"enum": ["Africa", "Asia", "Europe", "North America", "South America",
                                                          "Oceania", "Antarctica"]},
                                   "climate": {"enum": ["tropical", "arid", "temperate", "polar"]}}},
        "diet": {"enum": ["herbivore", "carnivore", "omnivore"]},
        "status": {"type": "object", "additionalProperties": False, "required": ["endangered", "population_trend"],
                   "properties": {"endangered": {"type": "boolean"},
                                  "population_trend": {"enum": ["increasing", "stable", "decreasing", "unknown"]}}},
    },
}
ANIMALS = ["the African elephant", "the snow leopard", "the emperor penguin", "the red fox", "the koala",
           "the Bengal tiger", "the bald eagle", "the giant panda"]


def _median_ms(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def costs(reps: int) -> dict:
    """Inside kernels.compute_scope(), as during generation (torch single-threaded there)."""
    with kernels.compute_scope():
        return _costs(reps)


def _costs(reps: int) -> dict:
    g = torch.Generator().manual_seed(0)
    row = torch.randn(V, generator=g) * 3
    context = torch.randint(0, V, (512,), generator=g).tolist()
    bias = {int(t): float(b) for t, b in zip(torch.randint(0, V, (300,), generator=g), torch.randn(300, generator=g))}
    s = SamplingConfig(presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2, logit_bias=bias)
    proc = Processing(s, GenerationConfig(), context[:256], V)
    proc.commit(context[256:])
    drafts = context[:4]
    out = {"copy_ms": _median_ms(lambda: row.clone(), reps),
           "penalties_and_bias_ms": _median_ms(lambda: proc.row(row, drafts), reps),
           "penalties_and_bias_no_drafts_ms": _median_ms(lambda: proc.row(row), reps)}
    bias_only = Processing(SamplingConfig(logit_bias=bias), GenerationConfig(), [], V)
    out["bias_only_ms"] = _median_ms(lambda: bias_only.row(row), reps)
    greedy, warm, nucleus = SamplingConfig(), SamplingConfig(temperature=0.8), SamplingConfig(temperature=0.8, top_p=0.95)
    out["logprobs_top5_greedy_ms"] = _median_ms(lambda: token_logprob(row, 5, greedy, 5), reps)
    out["logprobs_top5_temperature_ms"] = _median_ms(lambda: token_logprob(row, 5, warm, 5), reps)
    out["logprobs_top5_top_p_ms"] = _median_ms(lambda: token_logprob(row, 5, nucleus, 5), reps)
    # in a generation the truncated distribution is acceptance's (ProcessedRows.dists): built once a row
    built = distribution(row, drawn_from(nucleus))
    out["logprobs_top5_top_p_shared_ms"] = _median_ms(lambda: token_logprob(row, 5, nucleus, 5, built), reps)
    out["logprobs_top0_greedy_ms"] = _median_ms(lambda: token_logprob(row, 5, greedy, 0), reps)
    return out


def json_speed(max_new_tokens: int, rounds: int) -> dict:
    import selfspec
    from selfspec.engine import GenerationResult

    m = selfspec.load("gemma-3-270m", dtype="bfloat16")
    prompts = [m.encode(f"Describe {a} as a JSON record with its name, species, habitat, diet and conservation status.",
                        chat=True) for a in ANIMALS]
    arms = {"autoregressive": dict(strategy="autoregressive"), "default": {}}
    for p in prompts[:2]:  # warm-up: the tokenizer's grammar view, kernels, auto's resources
        for kw in arms.values():
            m.generate(p, max_new_tokens=16, json_schema=SCHEMA, **kw)
    tokens = {a: 0 for a in arms}
    seconds = {a: 0.0 for a in arms}
    outs: dict[str, list[GenerationResult]] = {a: [] for a in arms}
    for r in range(rounds):
        for p in prompts:
            for a, kw in (arms.items() if r % 2 == 0 else reversed(arms.items())):
                t = time.perf_counter()
                res = m.generate(p, max_new_tokens=max_new_tokens, json_schema=SCHEMA, **kw)
                seconds[a] += time.perf_counter() - t
                tokens[a] += len(res.token_ids)
                if r == 0:
                    outs[a].append(res)
    d = outs["default"]
    valid = 0
    for res in d:
        try:
            json.loads(res.text)
            valid += 1
        except ValueError:
            pass
    n = sum(len(res.token_ids) for res in d)
    return {
        "tok_s": {a: tokens[a] / seconds[a] for a in arms},
        "speedup": (tokens["default"] / seconds["default"]) / (tokens["autoregressive"] / seconds["autoregressive"]),
        "identical": sum(x.token_ids == y.token_ids for x, y in zip(d, outs["autoregressive"])),
        "prompts": len(prompts),
        "valid_json": valid,
        "tokens": n,
        "forced_share": sum(res.stats.free_accepted for res in d) / n,
        "free_drafted": sum(res.stats.free_drafted for res in d),
        "free_accepted": sum(res.stats.free_accepted for res in d),
        "acceptance": sum(res.stats.accepted for res in d) / max(1, sum(res.stats.drafted for res in d)),
        "mean_accepted_length": statistics.mean(res.stats.mean_accepted_length for res in d),
        "finish": [res.finish_reason for res in d],
        "example": d[0].text,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=("all", "costs", "json"), default="all")
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--max-new-tokens", type=int, default=160)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    out = {}
    if args.part in ("all", "costs"):
        out["costs"] = costs(args.reps)
        for k, v in out["costs"].items():
            print(f"{k:32s} {v:8.3f}")
    if args.part in ("all", "json"):
        out["json_schema"] = j = json_speed(args.max_new_tokens, args.rounds)
        print(f"tok/s autoregressive {j['tok_s']['autoregressive']:.1f}, default {j['tok_s']['default']:.1f}: "
              f"{j['speedup']:.2f}x; identical {j['identical']}/{j['prompts']}; valid JSON {j['valid_json']}/{j['prompts']}; "
              f"forced (free, accepted) {j['forced_share']:.1%} of {j['tokens']} tokens; acceptance {j['acceptance']:.1%}; "
              f"tokens/step {j['mean_accepted_length']:.2f}")
        print(j["example"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0 if "json_schema" not in out or out["json_schema"]["identical"] == out["json_schema"]["prompts"] else 1


if __name__ == "__main__":
    sys.exit(main())
