"""Engine efficiency with an ideal drafter, and selfspec early exit vs transformers'.

1. Ideal drafter: a copy of the default model whose layers >= E contribute nothing (their
   attention output and MLP down projections are zeroed), so early exit at E is always
   accepted. For each (E, K): measured speedup of early-exit over autoregressive, and the
   prediction S = (K+1) / (K*c + v) from primitive costs timed separately
   (c = one draft token / one decode step, v = one verify pass / one decode step).
   Same for layer-skip with the skipped layers zeroed. Target: measured/predicted >= 0.8.
2. The real default model: selfspec early-exit vs transformers
   generate(assistant_early_exit=E) at the same E and draft length, greedy. Target >= 3x.
3. Peak memory (max RSS, each strategy in its own process): early-exit vs autoregressive.

    .venv/bin/python benchmarks/speed/engine_efficiency.py [--dtype bfloat16] [--max-new-tokens 64]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks/: common.py
from common import PROMPTS, hf_model, machine  # noqa: E402
from rich.console import Console
from rich.table import Table

import selfspec
from selfspec.config import DraftConfig
from selfspec.predictor.costs import time_call


def ideal_model(dtype, dead_layers: list[int]):
    """The default model with `dead_layers` turned into identities (zeroed outputs)."""
    hf = hf_model(torch.float32)
    with torch.no_grad():
        for i in dead_layers:
            layer = hf.model.layers[i]
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    return selfspec.load(hf, tokenizer=None, dtype=dtype)


def timed(fn, repeats=5) -> float:
    return time_call(fn, repeats, statistics.median)


def primitive_costs(m, E: int | None, K: int, skip: frozenset[int] = frozenset()) -> tuple[float, float, float]:
    """Seconds for: one decode step, one draft token, one verify pass over K+1 positions."""
    rt = m.runtime
    L = rt.num_layers
    cache = rt.new_cache(512)
    pos = 100
    one = torch.tensor([5])
    rows = torch.arange(K + 1) + 5
    with torch.inference_mode():
        rt.forward(torch.arange(pos) + 3, 0, cache)
        step = timed(lambda: rt.forward(one, pos, cache))
        if E is not None:
            draft = timed(lambda: rt.logits(rt.run_layers(rt.embed(one), 0, E, pos, cache)))
            h = rt.run_layers(rt.embed(rows), 0, E, pos, cache)

            def verify():
                rt.run_layers(rt.embed(one), 0, E, pos + K, cache)  # the last draft's early layers
                return rt.logits(rt.run_layers(h, E, L, pos, cache))

            ver = timed(verify)
        else:
            draft = timed(lambda: rt.logits(rt.run_layers(rt.embed(one), 0, L, pos, cache, skip, skip)))
            ver = timed(lambda: rt.forward(rows, pos, cache))
    return step, draft, ver


def measure(m, cfg: DraftConfig, ids_list, max_new) -> tuple[float, float, list[int]]:
    """Mean decode tok/s (prefill excluded) of AR and of cfg, interleaved; and AR/cfg equality."""
    ar_cfg = DraftConfig("autoregressive")
    ar_t, sp_t, same = [], [], []
    for ids in ids_list:
        a = m.generate(ids, max_new_tokens=max_new, draft=ar_cfg)
        s = m.generate(ids, max_new_tokens=max_new, draft=cfg)
        ar_t.append((a.stats.time_s - a.stats.time_prefill_s) / max(a.stats.new_tokens - 1, 1))
        sp_t.append((s.stats.time_s - s.stats.time_prefill_s) / max(s.stats.new_tokens - 1, 1))
        same.append(a.token_ids == s.token_ids)
    return statistics.mean(ar_t), statistics.mean(sp_t), same


def ideal_section(console, dtype, max_new, n_prompts) -> list[dict]:
    rows = []
    table = Table(title=f"ideal drafter ({dtype}, {max_new} new tokens, {n_prompts} prompts)")
    for c in ("strategy", "E / skipped", "K", "acc.", "measured", "predicted", "meas/pred", "c", "v"):
        table.add_column(c)
    configs = [("early-exit", 6, [2, 4, 8]), ("early-exit", 12, [2, 4, 8])]
    for strategy, E, Ks in configs:
        m = ideal_model(dtype, list(range(E, 18)))
        ids_list = [_ids(p) for p in PROMPTS[:n_prompts]]
        m.generate(ids_list[0], max_new_tokens=8, strategy="autoregressive")
        for K in Ks:
            cfg = DraftConfig(strategy="early-exit", exit_layer=E, num_speculations=K)
            m.generate(ids_list[0], max_new_tokens=8, draft=cfg)
            ar, sp, same = measure(m, cfg, ids_list, max_new)
            step, draft, ver = primitive_costs(m, E, K)
            c, v = draft / step, ver / step
            pred = (K + 1) / (K * c + v)
            meas = ar / sp
            rows.append(dict(strategy=strategy, exit_layer=E, K=K, measured=meas, predicted=pred, c=c, v=v, identical=all(same)))
            table.add_row(strategy, str(E), str(K), "100%" if all(same) else "DIFF", f"{meas:.2f}x", f"{pred:.2f}x", f"{meas / pred:.2f}", f"{c:.2f}", f"{v:.2f}")
        del m
    skip = list(range(3, 18, 2))  # every other layer from 3 on
    m = ideal_model(dtype, skip)
    ids_list = [_ids(p) for p in PROMPTS[:n_prompts]]
    for K in (2, 4):
        cfg = DraftConfig(strategy="layer-skip", skip_attn=tuple(skip), skip_mlp=tuple(skip), num_speculations=K)
        m.generate(ids_list[0], max_new_tokens=8, draft=cfg)
        ar, sp, same = measure(m, cfg, ids_list, max_new)
        step, draft, ver = primitive_costs(m, None, K, frozenset(skip))
        c, v = draft / step, ver / step
        pred = (K + 1) / (K * c + v)
        meas = ar / sp
        rows.append(dict(strategy="layer-skip", skipped=skip, K=K, measured=meas, predicted=pred, c=c, v=v, identical=all(same)))
        table.add_row("layer-skip", f"{len(skip)} layers", str(K), "100%" if all(same) else "DIFF", f"{meas:.2f}x", f"{pred:.2f}x", f"{meas / pred:.2f}", f"{c:.2f}", f"{v:.2f}")
    console.print(table)
    return rows


_TOK = None


def _ids(prompt: str) -> list[int]:
    global _TOK
    if _TOK is None:
        from transformers import AutoTokenizer

        from selfspec.loading import default_model_dir

        _TOK = AutoTokenizer.from_pretrained(str(default_model_dir()), local_files_only=True)
    return _TOK(prompt).input_ids


def transformers_section(console, dtype, max_new, n_prompts, E: int, K: int) -> dict:
    """selfspec early exit (full draft head, and a 16k restricted draft vocabulary) vs
    transformers' assistant_early_exit at the same E and a constant draft length K."""
    m = selfspec.load("gemma-3-270m", dtype=dtype)
    hf = hf_model(getattr(torch, dtype))
    cfgs = {"selfspec early-exit": DraftConfig(strategy="early-exit", exit_layer=E, num_speculations=K),
            "selfspec early-exit, draft vocab 16k": DraftConfig(strategy="early-exit", exit_layer=E, num_speculations=K, draft_vocab=16384)}
    ids_list = [m.encode(p) for p in PROMPTS[:n_prompts]]
    tps: dict[str, list[float]] = {k: [] for k in (*cfgs, "transformers assistant_early_exit")}
    same = {k: 0 for k in cfgs}
    for cfg in cfgs.values():
        m.generate(ids_list[0], max_new_tokens=8, draft=cfg)
    for ids in ids_list:
        ar = m.generate(ids, max_new_tokens=max_new, strategy="autoregressive").token_ids
        for name, cfg in cfgs.items():
            r = m.generate(ids, max_new_tokens=max_new, draft=cfg)
            tps[name].append(r.stats.tokens_per_second)
            same[name] += r.token_ids == ar
        x = torch.tensor([ids])
        t = time.perf_counter()
        with torch.inference_mode():
            out = hf.generate(x, max_new_tokens=max_new, do_sample=False, assistant_early_exit=E,
                              num_assistant_tokens=K, num_assistant_tokens_schedule="constant",
                              assistant_confidence_threshold=0.0)
        tps["transformers assistant_early_exit"].append((out.shape[1] - len(ids)) / (time.perf_counter() - t))
    hf_tps = statistics.mean(tps["transformers assistant_early_exit"])
    table = Table(title=f"real default model, early exit E={E}, K={K}, greedy ({dtype}, {max_new} new tokens, {n_prompts} prompts)")
    for c in ("method", "tok/s", "vs transformers", "identical to selfspec AR"):
        table.add_column(c)
    out = {}
    for name, v in tps.items():
        mean = statistics.mean(v)
        out[name] = mean
        table.add_row(name, f"{mean:.2f}", f"{mean / hf_tps:.2f}x", f"{same[name]}/{len(ids_list)}" if name in same else "-")
    console.print(table)
    return out


def peak_memory_child(strategy: str, dtype: str, max_new: int) -> None:
    m = selfspec.load("gemma-3-270m", dtype=dtype)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    kw = dict(strategy="early-exit", exit_layer=12, num_speculations=4) if strategy == "early-exit" else dict(strategy="autoregressive")
    m.generate(PROMPTS[0], max_new_tokens=max_new, **kw)
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"strategy": strategy, "peak_rss_mb": after / 1024, "before_mb": before / 1024}))


def memory_section(console, dtype, max_new) -> dict:
    out = {}
    for s in ("autoregressive", "early-exit"):
        p = subprocess.run([sys.executable, __file__, "--child-memory", s, "--dtype", dtype, "--max-new-tokens", str(max_new)],
                           capture_output=True, text=True, check=True)
        out[s] = json.loads(p.stdout.strip().splitlines()[-1])["peak_rss_mb"]
    console.print(f"peak RSS: autoregressive {out['autoregressive']:.0f} MB, early-exit {out['early-exit']:.0f} MB "
                  f"({out['early-exit'] / out['autoregressive'] - 1:+.1%})")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--sections", default="ideal,transformers,memory")
    ap.add_argument("--child-memory", default=None)
    args = ap.parse_args()
    if args.child_memory:
        peak_memory_child(args.child_memory, args.dtype, args.max_new_tokens)
        return
    console = Console()
    console.print(f"machine: {machine()}")
    sections = args.sections.split(",")
    if "ideal" in sections:
        ideal_section(console, args.dtype, args.max_new_tokens, args.prompts)
    if "transformers" in sections:
        transformers_section(console, args.dtype, args.max_new_tokens, args.prompts, E=6, K=4)
    if "memory" in sections:
        memory_section(console, args.dtype, args.max_new_tokens)


if __name__ == "__main__":
    main()
