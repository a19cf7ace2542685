"""Models at size on this machine: random-weight Llama checkpoints of the 1B, 3B and 7B shapes
(Llama 3.2 1B = layerskip-llama3.2-1B, Llama 3.2 3B, Llama 2 7B = layerskip-llama2-7B) written
as bf16 safetensors shards (no Hub needed), each measured in a fresh process:

  * load: seconds of `selfspec.load`, and peak RSS over its window (minus the process's RSS
    before it) against the weights' bytes in the runtime dtype; the greedy head's int8 screen
    (made at load) is counted and shown apart;
  * autoregressive greedy tok/s, and its decode step against the memory floor: the bytes one
    step reads (the layer matrices and, greedy, the int8 screen of the head plus its few exact
    columns) at the machine's read bandwidth (a 1 GB tensor summed in the same process, best of
    samples taken between the runs: on a shared VM it drifts);
  * early exit E=4 K=4: seconds per draft token over seconds per autoregressive step, beside
    LayerSkip's arithmetic (the bytes of E layers plus the draft head over a step's bytes).
    Random weights: drafts are rejected, which changes nothing about what a draft costs.

    python benchmarks/models/big_models.py                       # 1B, 3B, 7B (7B: 13.5 GB of disk, ~15 GB of memory)
    python benchmarks/models/big_models.py --sizes 1B --tokens 64 --out results/big_models.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # benchmarks/: common.py
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT.parent / "tests"))

SHAPES = {  # the published models' shapes
    "1B": dict(hidden=2048, intermediate=8192, layers=16, heads=32, kv_heads=8, vocab=128256, tied=True),
    "3B": dict(hidden=3072, intermediate=8192, layers=28, heads=24, kv_heads=8, vocab=128256, tied=True),
    "7B": dict(hidden=4096, intermediate=11008, layers=32, heads=32, kv_heads=32, vocab=32000, tied=False),
}


def _status(key: str) -> int:
    return next(int(line.split()[1]) * 1024 for line in Path("/proc/self/status").read_text().splitlines() if line.startswith(key))


def _read_gbs(x, repeats: int = 5) -> float:
    """GB/s of summing x (bytes read per second), best of a few."""
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return x.numel() * x.element_size() / best / 1e9


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")


def child(path: str, tokens: int, exit_layer: int, k: int, runs: int) -> dict:
    """One checkpoint, measured in this (fresh) process."""
    import torch

    import selfspec
    import transformers.models.llama.modeling_llama  # noqa: F401  (imports outside the measured window)
    from selfspec import kernels
    from selfspec.greedy_head import screened_head

    kernels.available()
    probe = torch.ones(2**28, dtype=torch.float32)  # 1 GB, allocated before the measured window
    _read_gbs(probe)
    _reset_peak()
    base = _status("VmRSS:")
    t = time.perf_counter()
    m = selfspec.load(path, dtype="bfloat16")
    load_s = time.perf_counter() - t
    peak_load, after_load = _status("VmHWM:") - base, _status("VmRSS:") - base
    rt = m.runtime
    layers = sum(kernels.nbytes(w) for L in rt.layers for w in L.values())
    head = kernels.nbytes(rt.head)
    embed = 0 if rt.embed_weight is None else kernels.nbytes(rt.embed_weight)
    screen = screened_head(rt)
    screen_bytes = screen.nbytes if screen is not None else 0
    weights = layers + head + embed
    step_bytes = layers + (screen_bytes if screen is not None else head)
    prompt = torch.randint(0, rt.spec.vocab_size, (32,), generator=torch.Generator().manual_seed(0)).tolist()
    _reset_peak()
    m.generate(prompt, max_new_tokens=4, strategy="autoregressive")  # warm
    # Side by side: each autoregressive run is bracketed by bandwidth probes and followed by an
    # early-exit run; ratios are taken per round, then their median (the machine drifts, and a
    # busy neighbour on one of the 2 cores halves both a probe and a decode step).
    rounds = []
    for _ in range(runs):
        before = _read_gbs(probe)
        ar = m.generate(prompt, max_new_tokens=tokens, strategy="autoregressive")
        after = _read_gbs(probe)
        ee = m.generate(prompt, max_new_tokens=tokens, strategy="early-exit", exit_layer=exit_layer, num_speculations=k)
        assert ee.token_ids == ar.token_ids, "early exit changed the output"
        step = (ar.stats.time_s - ar.stats.time_prefill_s) / max(1, ar.stats.new_tokens - 1)
        rounds.append({"bandwidth_gbs": max(before, after), "ar_step_s": step, "ar_tokens_per_second": ar.stats.tokens_per_second,
                       "of_floor": step_bytes / step / 1e9 / max(before, after),
                       "draft_over_step": ee.stats.time_draft_s / max(1, ee.stats.drafted) / step,
                       "ee_verify_step_s": ee.stats.time_verify_s / max(1, ee.stats.verify_steps),
                       "ee_acceptance": ee.stats.acceptance_rate})
    med = lambda key: statistics.median(r[key] for r in rounds)  # noqa: E731
    L = rt.spec.num_layers
    return {
        "path": path, "layers": L, "vocab": rt.spec.vocab_size, "rounds": rounds,
        "load_s": load_s, "weights_bytes": weights, "layers_bytes": layers, "head_bytes": head, "embed_bytes": embed,
        "screen_bytes": screen_bytes, "peak_load_bytes": peak_load, "rss_after_load_bytes": after_load,
        "peak_decode_bytes": _status("VmHWM:") - base, "step_bytes": step_bytes,
        "read_bandwidth_gbs": med("bandwidth_gbs"), "ar_step_s": med("ar_step_s"), "ar_tokens_per_second": med("ar_tokens_per_second"),
        "of_floor": med("of_floor"), "draft_over_step": med("draft_over_step"),
        # LayerSkip's arithmetic: E of L layers, then the head (the drafter reads the full bf16 head)
        "ee_predicted_c": (layers * exit_layer / L + head) / step_bytes,
        "exit_layer": exit_layer, "k": k,
    }


def make(size: str, root: Path) -> Path:
    import helpers

    d = root / f"llama-{size}"
    if not (d / "config.json").exists() or not list(d.glob("*.safetensors")):
        t = time.perf_counter()
        n = helpers.write_llama_checkpoint(d, **SHAPES[size], shard_bytes=2 << 30)
        print(f"wrote {d} ({n / 1e9:.1f} GB) in {time.perf_counter() - t:.0f} s", flush=True)
    return d


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1B,3B,7B")
    ap.add_argument("--dir", default=os.path.join(os.path.expanduser("~"), ".cache", "selfspec", "bench-checkpoints"),
                    help="where the generated checkpoints are kept (reused across runs)")
    ap.add_argument("--tokens", type=int, default=16, help="new tokens per run")
    ap.add_argument("--runs", type=int, default=5, help="rounds of (probe, autoregressive, probe, early exit)")
    ap.add_argument("--exit-layer", type=int, default=4)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--out", default="results/big_models.json")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.tokens, args.exit_layer, args.k, args.runs)))
        return
    from rich.console import Console
    from rich.table import Table

    from common import machine

    rows = []
    for size in args.sizes.split(","):
        d = make(size, Path(args.dir))
        out = subprocess.run([sys.executable, __file__, "--child", str(d), "--tokens", str(args.tokens), "--runs", str(args.runs),
                              "--exit-layer", str(args.exit_layer), "--k", str(args.k)], capture_output=True, text=True)
        if out.returncode:
            sys.exit(f"{size}: the measurement failed:\n{out.stderr[-3000:]}")
        r = json.loads(out.stdout.strip().splitlines()[-1])
        rows.append({"size": size, **r})
        print(f"{size}: {json.dumps(r)}", flush=True)
    t = Table(title=f"Models at size ({machine()}; bf16)")
    for c in ("shape", "weights", "load", "peak RSS / weights", "of it: int8 screen", "AR decode tok/s", "AR step / floor",
              f"E={args.exit_layer} draft token / step", "predicted"):
        t.add_column(c, justify="right")
    for r in rows:
        w = r["weights_bytes"]
        t.add_row(r["size"], f"{w / 1e9:.2f} GB", f"{r['load_s']:.1f} s", f"{r['peak_load_bytes'] / w:.3f}x",
                  f"{r['screen_bytes'] / w:.1%}", f"{r['ar_tokens_per_second']:.2f}",
                  f"{r['of_floor']:.0%}", f"{r['draft_over_step']:.3f}", f"{r['ee_predicted_c']:.3f}")
    Console().print(t)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"machine": machine(), "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
