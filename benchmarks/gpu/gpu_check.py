"""The CUDA path, on a lent GPU: exactness and bf16 speed (not part of CI).

1. Row invariance: a verify pass over T positions vs T single-token steps, bit for bit,
   on tiny random models (fp32, bf16), T = 2..17.
2. Greedy equality of every strategy with autoregressive on tiny random models.
3. Speed (bf16): a random-weight Llama-shaped model (~1B params) whose layers >= E are
   zeroed (an ideal early-exit drafter): selfspec AR vs transformers generate, and
   early-exit / layer-skip speedups over AR, side by side in one run.
4. The compiled backend (selfspec/compiled, issue 53), on the Gemma-3-270M and Llama-1.1B shapes
   (layers >= 6 zeroed): transformers generate with the static cache (compiled, CUDA graphs) vs
   the compiled step autoregressive and early exit E=6 K=8 (ideal drafter), and a batch of 8 vs
   transformers' eager batch of 8; exactness: early exit = autoregressive, batch rows = solo.
   Targets: AR >= 1.0x, early exit >= 3x the static cache; batch 8 >= 2x the eager batch.

    python benchmarks/gpu/gpu_check.py [--out results.json] [--only compiled]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import transformers
from transformers import Gemma3TextConfig, LlamaConfig, Qwen3Config

import selfspec
import selfspec.compiled
from selfspec.config import DraftConfig


def tiny_models():
    kw = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=6, max_position_embeddings=1024, initializer_range=0.3)
    yield "llama", LlamaConfig(num_attention_heads=4, num_key_value_heads=2, **kw)
    yield "qwen3", Qwen3Config(num_attention_heads=4, num_key_value_heads=2, head_dim=32, **kw)
    yield "gemma3", Gemma3TextConfig(num_attention_heads=4, num_key_value_heads=1, head_dim=32, sliding_window=16, query_pre_attn_scalar=32, **kw)


def invariance(report):
    for name, cfg in tiny_models():
        hf = transformers.AutoModelForCausalLM.from_config(cfg).eval()
        for dt in ("float32", "bfloat16"):
            m = selfspec.load(hf, dtype=dt, device="cuda")
            rt = m.runtime
            ids = torch.randint(0, 512, (60,), generator=torch.Generator().manual_seed(0)).cuda()
            cache = rt.new_cache(120)
            with torch.inference_mode():
                rt.forward(ids[:20], 0, cache)
                singles = torch.cat([rt.forward(ids[j:j + 1], j, cache) for j in range(20, 40)])
                bad = [T for T in range(2, 18) if not torch.equal(rt.forward(ids[20:20 + T], 20, cache), singles[:T])]
            report["invariance"][f"{name}/{dt}"] = bad
            print("row invariance", name, dt, "mismatching T:", bad, flush=True)


def equality(report):
    for name, cfg in tiny_models():
        hf = transformers.AutoModelForCausalLM.from_config(cfg).eval()
        for dt in ("float32", "bfloat16"):
            m = selfspec.load(hf, dtype=dt, device="cuda")
            prompts = [[1, 5, 9, 3, 7, 2], list(range(10, 40))]
            for cfgd in [DraftConfig("early-exit", exit_layer=2, num_speculations=4), DraftConfig("early-exit", exit_layer=4, num_speculations=8),
                         DraftConfig("layer-skip", skip_attn=(1, 3), skip_mlp=(2,)), DraftConfig("prompt-lookup")]:
                same = sum(m.generate(p, max_new_tokens=64, draft=cfgd).token_ids == m.generate(p, max_new_tokens=64).token_ids for p in prompts)
                key = f"{name}/{dt}/{cfgd.strategy}/{cfgd.exit_layer}"
                report["equality"][key] = f"{same}/{len(prompts)}"
                print("greedy equality", key, f"{same}/{len(prompts)}", flush=True)


def speed(report, max_new=128):
    cfg = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                      num_key_value_heads=4, max_position_embeddings=2048, initializer_range=0.02)
    torch.manual_seed(0)
    with torch.device("cuda"):
        hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    E = 6
    with torch.no_grad():
        for L in hf.model.layers[E:]:
            L.self_attn.o_proj.weight.zero_()
            L.mlp.down_proj.weight.zero_()
    m = selfspec.load(hf, dtype="bfloat16", device="cuda")
    prompt = list(range(100, 164))
    x = torch.tensor([prompt], device="cuda")

    def hf_tps():
        torch.cuda.synchronize(); t = time.perf_counter()
        with torch.inference_mode():
            out = hf.generate(x, max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False, eos_token_id=None, pad_token_id=0)
        torch.cuda.synchronize()
        return (out.shape[1] - x.shape[1]) / (time.perf_counter() - t)

    def ours(draft):
        torch.cuda.synchronize()
        r = m.generate(prompt, max_new_tokens=max_new, draft=draft)
        return r.stats.tokens_per_second, r

    configs = {"autoregressive": DraftConfig("autoregressive")}
    for K in (2, 4, 8):
        configs[f"early-exit E={E} K={K}"] = DraftConfig("early-exit", exit_layer=E, num_speculations=K)
    skip = tuple(range(E, 22))
    configs["layer-skip (16 dead layers) K=4"] = DraftConfig("layer-skip", skip_attn=skip, skip_mlp=skip, num_speculations=4)
    for d in configs.values():
        ours(d)
    hf_tps()
    rows = {k: [] for k in configs}
    rows["transformers generate"] = []
    same = {}
    for _ in range(3):
        rows["transformers generate"].append(hf_tps())
        base = None
        for k, d in configs.items():
            tps, r = ours(d)
            rows[k].append(tps)
            base = base or r.token_ids
            same[k] = r.token_ids == base
    ar = statistics.mean(rows["autoregressive"])
    for k, v in rows.items():
        tps = statistics.mean(v)
        report["speed"][k] = {"tokens_per_second": tps, "vs_selfspec_ar": tps / ar, "identical_to_ar": same.get(k)}
        print(f"{k:36s} {tps:8.1f} tok/s  {tps / ar:5.2f}x of selfspec AR  identical={same.get(k)}", flush=True)


def ideal_model(cfg, E=6):
    """A random-weight bf16 model on CUDA whose layers >= E add nothing (an ideal early exit at E)."""
    torch.manual_seed(0)
    with torch.device("cuda"):
        hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        for L in hf.model.layers[E:]:
            L.self_attn.o_proj.weight.zero_()
            L.mlp.down_proj.weight.zero_()
    return hf


def _timed(fn, reps=3):
    """(median seconds of reps calls after one warm-up call, the last result)."""
    fn()
    times, out = [], None
    for _ in range(reps):
        torch.cuda.synchronize(); t = time.perf_counter()
        out = fn()
        torch.cuda.synchronize(); times.append(time.perf_counter() - t)
    return statistics.median(times), out


def compiled(report, max_new=128, E=6):
    shapes = {"gemma-3-270m": Gemma3TextConfig(vocab_size=262144, hidden_size=640, intermediate_size=2048, num_hidden_layers=18,
                                               num_attention_heads=4, num_key_value_heads=1, head_dim=256, sliding_window=512,
                                               query_pre_attn_scalar=256, max_position_embeddings=32768),
              "llama-1.1b": LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                                        num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=2048)}
    for name, cfg in shapes.items():
        hf = ideal_model(cfg, E)
        m = selfspec.compiled.CompiledModel(selfspec.load(hf, dtype="bfloat16", device="cuda"))
        prompt = list(range(100, 164))
        prompts = [list(range(100 + 7 * i, 164 + 5 * i)) for i in range(8)]
        x = torch.tensor([prompt], device="cuda")
        kw = dict(max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False, eos_token_id=None, pad_token_id=0)
        with torch.inference_mode():
            t_static, _ = _timed(lambda: hf.generate(x, cache_implementation="static", **kw))
            xb = torch.tensor([p[:64] for p in prompts], device="cuda")
            t_eager8, _ = _timed(lambda: hf.generate(xb, **kw))
        ar = DraftConfig("autoregressive")
        ee = DraftConfig("early-exit", exit_layer=E, num_speculations=8)
        t_ar, r_ar = _timed(lambda: m.generate(prompt, max_new_tokens=max_new, draft=ar))
        t_ee, r_ee = _timed(lambda: m.generate(prompt, max_new_tokens=max_new, draft=ee))
        t_b8, r_b8 = _timed(lambda: m.generate_batch(prompts, max_new_tokens=max_new, draft=ee))
        t_b8ar, _ = _timed(lambda: m.generate_batch(prompts, max_new_tokens=max_new, draft=ar))
        solo = [m.generate(p, max_new_tokens=max_new, draft=ar).token_ids for p in prompts]
        row = {"transformers static cache tok/s": max_new / t_static, "transformers eager batch 8 tok/s": 8 * max_new / t_eager8,
               "compiled AR tok/s": max_new / t_ar, "compiled early exit K=8 tok/s": max_new / t_ee,
               "compiled batch 8 early exit K=8 tok/s": sum(len(r.token_ids) for r in r_b8) / t_b8,
               "compiled batch 8 AR tok/s": 8 * max_new / t_b8ar,
               "exact early exit = AR": r_ee.token_ids == r_ar.token_ids, "exact batch rows = solo": [r.token_ids for r in r_b8] == solo}
        row["AR vs static (target >= 1.0)"] = row["compiled AR tok/s"] / row["transformers static cache tok/s"]
        row["early exit vs static (target >= 3)"] = row["compiled early exit K=8 tok/s"] / row["transformers static cache tok/s"]
        row["batch 8 vs eager batch (target >= 2)"] = row["compiled batch 8 early exit K=8 tok/s"] / row["transformers eager batch 8 tok/s"]
        report["compiled"][name] = row
        for k, v in row.items():
            print(f"{name:14s} {k:42s} {v:.2f}" if isinstance(v, float) else f"{name:14s} {k:42s} {v}", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="gpu_check.json")
    ap.add_argument("--only", choices=["compiled"], default=None, help="run only the compiled backend's side by side")
    args = ap.parse_args()
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "transformers", transformers.__version__, flush=True)
    report = {"device": torch.cuda.get_device_name(), "invariance": {}, "equality": {}, "speed": {}, "compiled": {}}
    if args.only is None:
        invariance(report)
        equality(report)
        speed(report)
    compiled(report)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
