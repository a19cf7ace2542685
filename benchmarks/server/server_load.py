"""Load benchmark for `selfspec serve` (loopback only, bounded in count and time).

    python benchmarks/server/server_load.py --model gemma-3-270m --dtype float32 --strategy early-exit --exit-layer 8 \\
        --clients 4 --requests 24 --max-tokens 64
    python benchmarks/server/server_load.py --tiny            # a tiny random model built on the fly (smoke run)

What it does:
  1. loads the model here (for direct generation) and starts `selfspec serve` with the same
     model and strategy as a subprocess on a free 127.0.0.1 port;
  2. single client: for each prompt, alternately one direct `model.generate` (greedy) and one
     streamed request through the server, --single-reps times; reports p50 total latency and
     time to first token of both and the server's overhead at p50 (target: within 5%);
  3. load: --clients concurrent streaming clients send --requests requests in total;
     reports throughput, p50/p99 time to first token and total latency, errors (must be 0),
     and checks that every response equals its direct-generation counterpart.
Everything stops by itself: --time-limit bounds the whole run, each request has a timeout.
Exit status 1 when any request failed or any output differed.

Sweep mode (issue 17: the batching server), with the `openai` client over loopback:

    python benchmarks/server/server_load.py --sweep                       # gemma-3-270m bf16, greedy, 128 new tokens
    python benchmarks/server/server_load.py --sweep --clients-list 1,4,8,16 --strategies autoregressive,default

For every strategy (`default`: the server's own, no `selfspec` field; any other name is sent
per request) and every client count N: N clients each stream --rounds requests at once;
reports aggregate tokens/s, p50 time to first token, the longest gap between two chunks any
client saw (a stall), and whether every output equals solo greedy decoding (computed here).
With --repeats R the strategies take turns at each client count R times and a cell's tok/s is
the median run's: the machine's speed drifts, and a strategy measured minutes after another
is not comparable to it; its TTFT p50 is over every request of its R runs ("TTFT x 1 client":
over the same strategy's 1-client cell).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks/: common.py
from common import stop_server  # noqa: E402

HOST = "127.0.0.1"  # loopback only, by design
PROMPTS = [
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "The three primary colours are",
    "Write a short story about a robot who learns to paint.",
    "import numpy as np\n\ndef normalize(x):\n",
    "Q: What is the capital of France?\nA:",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "Once upon a time, in a small village by the sea,",
    "List three benefits of regular exercise:\n1.",
]


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    v = sorted(values)
    k = (len(v) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def build_tiny(out: Path) -> Path:
    """A 4-layer random Llama + byte-level BPE tokenizer (as in tests/test_server.py)."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=384, special_tokens=["<s>", "</s>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(PROMPTS * 10, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(fast), hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=1024, bos_token_id=0, eos_token_id=1, pad_token_id=2)
    LlamaForCausalLM(cfg).save_pretrained(out, safe_serialization=True)
    fast.save_pretrained(out)
    return out


async def stream_one(client, url: str, body: dict, timeout: float) -> dict:
    """One streamed completion -> text, ttft, total, tokens (from the usage chunk)."""
    t0 = time.perf_counter()
    ttft = None
    parts: list[str] = []
    usage = None
    async with client.stream("POST", url + "/v1/completions", json=body, timeout=timeout) as r:
        if r.status_code != 200:
            await r.aread()
            raise RuntimeError(f"HTTP {r.status_code}: {r.text[:200]}")
        done = False
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                done = True
                break
            obj = json.loads(data)
            if "error" in obj:
                raise RuntimeError(f"stream error: {obj['error']}")
            if obj.get("usage"):
                usage = obj["usage"]
            for ch in obj.get("choices", []):
                if ch.get("text"):
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                    parts.append(ch["text"])
        if not done:
            raise RuntimeError("stream ended without data: [DONE]")
    total = time.perf_counter() - t0
    return {"text": "".join(parts), "ttft": ttft if ttft is not None else total, "total": total,
            "tokens": usage["completion_tokens"] if usage else 0}


def direct_one(model, prompt: str, max_tokens: int, draft) -> dict:
    t0 = time.perf_counter()
    first = []
    res = model.generate(prompt, max_new_tokens=max_tokens, temperature=0.0, draft=draft,
                         on_event=lambda ev: first.append(time.perf_counter()) if not first and ev.text else None)
    total = time.perf_counter() - t0
    return {"text": res.text, "ttft": (first[0] - t0) if first else total, "total": total, "tokens": len(res.token_ids)}


async def openai_stream(client, model_name: str, prompt: str, max_tokens: int, extra: dict | None) -> dict:
    """One streamed completion through the openai client -> text, ttft, longest gap, tokens."""
    t0 = time.perf_counter()
    ttft, last, gap, parts, tokens = None, None, 0.0, [], 0
    stream = await client.completions.create(model=model_name, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
                                             stream_options={"include_usage": True}, extra_body={"selfspec": extra} if extra else None)
    async for chunk in stream:
        if chunk.usage:
            tokens = chunk.usage.completion_tokens
        if chunk.choices and chunk.choices[0].text:
            now = time.perf_counter()
            if ttft is None:
                ttft = now - t0
            else:
                gap = max(gap, now - last)
            last = now
            parts.append(chunk.choices[0].text)
    total = time.perf_counter() - t0
    return {"text": "".join(parts), "ttft": total if ttft is None else ttft, "gap": gap, "total": total, "tokens": tokens}


def mismatch(prompt: int, got: str, want: str) -> dict:
    """A streamed text that differs from solo decoding's, kept whole for the report (--json)."""
    at = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    return {"prompt": prompt, "at": at, "got": got, "want": want}


async def sweep(args, url: str, model_name: str, refs: dict[str, str]) -> list[dict]:
    """Every strategy x client count (module doc, sweep mode). The strategies take turns at
    each client count, --repeats times (the order flipping each time), so that a drift of the
    machine's speed over minutes lands on all of them alike; a cell reports the median run
    (by tok/s), the TTFT p50 of every run's requests, and counts every run's outputs."""
    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=args.request_timeout)
    strategies = args.strategies.split(",")
    extras = {s: None if s == "default" else {"strategy": s} for s in strategies}
    for strategy in strategies:
        await openai_stream(client, model_name, PROMPTS[0], 8, extras[strategy])  # warm-up of this strategy
    runs: dict[tuple[str, int], list[dict]] = {}
    for n in [int(c) for c in args.clients_list.split(",")]:
        prompts = [PROMPTS[(i * args.rounds + r) % len(PROMPTS)] for i in range(n) for r in range(args.rounds)]
        # n connections open before timing (clients keep theirs alive): a new one cost its first request ~5-40 ms here
        await asyncio.gather(*(openai_stream(client, model_name, PROMPTS[i % len(PROMPTS)], 1, None) for i in range(n)))
        for rep in range(args.repeats):
            for strategy in strategies if rep % 2 == 0 else strategies[::-1]:
                extra = extras[strategy]

                async def one_client(i):
                    return [await openai_stream(client, model_name, prompts[i * args.rounds + r], args.max_tokens, extra)
                            for r in range(args.rounds)]

                t0 = time.perf_counter()
                results = [x for xs in await asyncio.gather(*(one_client(i) for i in range(n))) for x in xs]
                wall = time.perf_counter() - t0
                ttfts = [r["ttft"] for r in results]
                run = {"strategy": strategy, "clients": n, "requests": len(results), "wall_s": wall,
                       "tok_s": sum(r["tokens"] for r in results) / wall, "ttfts_s": ttfts, "ttft_p50_s": pct(ttfts, 0.5),
                       "longest_stall_s": max(r["gap"] for r in results),
                       "ttft_p50_by_round_s": [pct(ttfts[r :: args.rounds], 0.5) for r in range(args.rounds)],
                       "identical": sum(r["text"] == refs[p] for r, p in zip(results, prompts)),
                       "mismatches": [mismatch(PROMPTS.index(p), r["text"], refs[p]) for r, p in zip(results, prompts) if r["text"] != refs[p]]}
                for m in run["mismatches"]:
                    print(f"  MISMATCH {strategy} {n} clients, prompt {m['prompt']}: from character {m['at']}, "
                          f"got {m['got'][m['at']:m['at'] + 40]!r}, solo {m['want'][m['at']:m['at'] + 40]!r}", file=sys.stderr, flush=True)
                runs.setdefault((strategy, n), []).append(run)
                by_round = " / ".join(f"{t * 1000:.0f}" for t in run["ttft_p50_by_round_s"])
                print(f"  {strategy:>14} {n:>3} clients: {run['tok_s']:7.1f} tok/s, TTFT p50 {run['ttft_p50_s'] * 1000:6.0f} ms "
                      f"(by round {by_round}), "
                      f"longest stall {run['longest_stall_s'] * 1000:6.0f} ms, identical {run['identical']}/{len(results)}",
                      file=sys.stderr, flush=True)
    await client.close()
    rows = []
    for _, cell in sorted(runs.items(), key=lambda kv: strategies.index(kv[0][0])):  # by strategy, then clients
        row = dict(sorted(cell, key=lambda r: r["tok_s"])[(len(cell) - 1) // 2])  # the median run (lower of two)
        # time to first token: p50 over every request of the cell's runs (a per-request figure; the
        # run picked for its tok/s is one sample of a few requests, and it swung 1.7-2.2x between runs)
        row.update(ttft_p50_s=pct([t for r in cell for t in r["ttfts_s"]], 0.5), ttft_p50_runs_s=[r["ttft_p50_s"] for r in cell],
                   requests=sum(r["requests"] for r in cell), identical=sum(r["identical"] for r in cell),
                   mismatches=[m for r in cell for m in r["mismatches"]],
                   runs_tok_s=[r["tok_s"] for r in cell], longest_stall_s=max(r["longest_stall_s"] for r in cell))
        rows.append(row)
    return rows


def hf_sweep(args, model) -> list[dict]:
    """transformers' own continuous batching (`generate_batch`) on the same prompts and token
    budget, in this process (the server idles meanwhile): tokens/s at --hf-clients."""
    import torch

    from common import hf_batch, hf_model

    counts = args.hf_clients  # checked and parsed by main()
    if not counts or args.tiny:
        return []
    hf = hf_model(torch.bfloat16 if args.dtype == "bfloat16" else torch.float32)
    if not hasattr(hf, "generate_batch"):
        print("  transformers has no generate_batch here: skipped", file=sys.stderr)
        return []
    hf_batch(hf, [model.encode(PROMPTS[0])], 8)  # warm-up
    rows = []
    for n in counts:
        ids = [model.encode(PROMPTS[i % len(PROMPTS)]) for i in range(n)]
        dt, outs = hf_batch(hf, ids, args.max_tokens)
        rows.append({"clients": n, "tok_s": sum(map(len, outs)) / dt, "wall_s": dt})
        print(f"  transformers generate_batch {n:>3} requests: {rows[-1]['tok_s']:7.1f} tok/s", file=sys.stderr, flush=True)
    return rows


async def run(args) -> dict:
    import httpx
    import torch

    import selfspec
    from selfspec.cli_args import config_kwargs
    from selfspec.config import DraftConfig

    deadline = time.monotonic() + args.time_limit
    workdir = Path(tempfile.mkdtemp(prefix="selfspec-bench-"))
    model_src = str(build_tiny(workdir / "tiny")) if args.tiny else args.model
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"loading {model_src} for direct generation ...", file=sys.stderr)
    model = selfspec.load(model_src, dtype=args.dtype, device=args.device)
    draft = model.draft_config(profile=args.profile, **config_kwargs(args, DraftConfig))
    direct_one(model, "Hello", 4, draft)  # warm-up

    port = free_port()
    url = f"http://{HOST}:{port}"
    cmd = [sys.executable, "-m", "selfspec", "serve", "--model", model_src, "--host", HOST, "--port", str(port),
           "--max-concurrency", str(max(args.clients * 2, 4)), "--max-new-tokens-limit", str(max(args.max_tokens, 16)),
           "--queue-timeout", str(args.request_timeout), "--log-level", "warning"]
    if args.sweep:
        most = max(int(c) for c in args.clients_list.split(","))
        cmd[cmd.index("--max-concurrency") + 1] = str(max(most * 2, 4))
    if args.max_batch:
        cmd += ["--max-batch", str(args.max_batch)]
    if args.prefill_chunk is not None:
        cmd += ["--prefill-chunk", str(args.prefill_chunk)]
    for flag in ("dtype", "device", "profile", "threads"):
        if getattr(args, flag) is not None:
            cmd += [f"--{flag}", str(getattr(args, flag))]
    for k, v in config_kwargs(args, DraftConfig).items():
        cmd += [f"--{k.replace('_', '-')}"] if v is True else [f"--{k.replace('_', '-')}", ",".join(map(str, v)) if isinstance(v, tuple) else str(v)]
    log_path = workdir / "server.log"
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    report: dict = {"model": model_src, "strategy": draft.to_dict(), "clients": args.clients, "max_tokens": args.max_tokens}
    try:
        async with httpx.AsyncClient(timeout=args.request_timeout, limits=httpx.Limits(max_connections=args.clients + 4)) as client:
            while True:  # bounded wait for the server
                if proc.poll() is not None:
                    raise RuntimeError(f"the server exited ({proc.returncode}); log: {log_path}")
                if time.monotonic() > deadline:
                    raise RuntimeError("the server did not start within the time limit")
                try:
                    if (await client.get(url + "/health", timeout=2)).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(0.25)
            served = (await client.get(url + "/v1/models")).json()["data"][0]
            model_name = served["id"]
            # references computed here are the server's only if both processes do the same arithmetic
            report["numerics"] = {"here": model.runtime.numerics, "server_fingerprint": served.get("fingerprint")}
            if not str(served.get("fingerprint", "")).endswith("-" + model.runtime.numerics):
                print(f"  WARNING: this process computes as {model.runtime.numerics}, the server as {served.get('fingerprint')}: "
                      "a near-tie of two logits may break differently, so texts may differ", file=sys.stderr, flush=True)
            prompts = PROMPTS[: args.prompts]
            if args.sweep:
                ar = model.draft_config("autoregressive")
                refs = {p: direct_one(model, p, args.max_tokens, ar)["text"] for p in PROMPTS}  # solo greedy
                report["sweep"] = await sweep(args, url, model_name, refs)
                report["transformers"] = hf_sweep(args, model)
                return report

            def body(p):
                return {"model": model_name, "prompt": p, "max_tokens": args.max_tokens, "temperature": 0, "stream": True,
                        "stream_options": {"include_usage": True}}

            await stream_one(client, url, body("Hello"), args.request_timeout)  # warm the connection

            # -- single client, interleaved with direct generation ---------------------------
            refs: dict[str, str] = {}
            d_total, d_ttft, s_total, s_ttft, ratios = [], [], [], [], []
            mismatches = 0
            for rep in range(args.single_reps):
                for p in prompts:
                    if time.monotonic() > deadline:
                        break
                    d = direct_one(model, p, args.max_tokens, draft)
                    refs.setdefault(p, d["text"])
                    s = await stream_one(client, url, body(p), args.request_timeout)
                    mismatches += s["text"] != refs[p]
                    d_total.append(d["total"]); d_ttft.append(d["ttft"])
                    s_total.append(s["total"]); s_ttft.append(s["ttft"])
                    ratios.append(s["total"] / d["total"])
            single = {
                "requests": len(s_total),
                "direct_p50_total_s": pct(d_total, 0.5), "server_p50_total_s": pct(s_total, 0.5),
                "direct_p50_ttft_s": pct(d_ttft, 0.5), "server_p50_ttft_s": pct(s_ttft, 0.5),
                "overhead_p50": pct(s_total, 0.5) / pct(d_total, 0.5) - 1,
                "paired_overhead_median": statistics.median(ratios) - 1 if ratios else float("nan"),
                "mismatches": mismatches,
            }
            report["single_client"] = single

            # -- N concurrent streaming clients ----------------------------------------------
            results: list[dict] = []
            errors: list[str] = []
            next_idx = [0]

            async def worker():
                while next_idx[0] < args.requests and time.monotonic() < deadline:
                    i = next_idx[0]
                    next_idx[0] += 1
                    p = prompts[i % len(prompts)]
                    try:
                        s = await stream_one(client, url, body(p), args.request_timeout)
                        s["match"] = s["text"] == refs.get(p)
                        results.append(s)
                    except Exception as e:  # counted, never fatal
                        errors.append(f"{type(e).__name__}: {e}")

            t0 = time.perf_counter()
            await asyncio.gather(*(worker() for _ in range(args.clients)))
            wall = time.perf_counter() - t0
            tokens = sum(r["tokens"] for r in results)
            load = {
                "requests": len(results) + len(errors), "completed": len(results), "errors": len(errors),
                "error_samples": errors[:5], "wall_s": wall,
                "throughput_req_s": len(results) / wall if wall else 0.0, "throughput_tok_s": tokens / wall if wall else 0.0,
                "ttft_p50_s": pct([r["ttft"] for r in results], 0.5), "ttft_p99_s": pct([r["ttft"] for r in results], 0.99),
                "latency_p50_s": pct([r["total"] for r in results], 0.5), "latency_p99_s": pct([r["total"] for r in results], 0.99),
                "mismatches": sum(not r["match"] for r in results),
                "unfinished_due_to_time_limit": max(args.requests - len(results) - len(errors), 0),
            }
            report["load"] = load
            metrics = (await client.get(url + "/metrics")).text
            report["server_acceptance_rate"] = next((float(ln.split()[-1]) for ln in metrics.splitlines()
                                                     if ln.startswith("selfspec_acceptance_rate ")), None)
    finally:
        stop_server(proc)
        log.close()
    report["server_log"] = str(log_path)
    return report


def main(argv=None) -> int:
    from selfspec.cli_args import add_draft_args, add_model_args

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap)
    add_draft_args(ap)
    ap.add_argument("--tiny", action="store_true", help="build and use a tiny random model (ignores --model)")
    ap.add_argument("--clients", type=int, default=4, help="concurrent streaming clients (default 4)")
    ap.add_argument("--requests", type=int, default=24, help="requests in the load phase (default 24, at most 1000)")
    ap.add_argument("--prompts", type=int, default=len(PROMPTS), help=f"distinct prompts used (default {len(PROMPTS)})")
    ap.add_argument("--max-tokens", type=int, default=64, help="max_tokens per request (default 64)")
    ap.add_argument("--single-reps", type=int, default=3, help="single-client repetitions per prompt (default 3)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads, here and in the server")
    ap.add_argument("--request-timeout", type=float, default=120.0, help="seconds per request (default 120)")
    ap.add_argument("--time-limit", type=float, default=900.0, help="seconds for the whole run (default 900)")
    ap.add_argument("--json", default=None, help="also write the report to this file")
    ap.add_argument("--sweep", action="store_true", help="sweep mode (module doc): strategies x client counts, openai client; "
                    "defaults: gemma-3-270m, bfloat16, 128 new tokens")
    ap.add_argument("--clients-list", default="1,4,8,16", help="sweep: client counts (default %(default)s)")
    ap.add_argument("--strategies", default="autoregressive,default", help="sweep: strategies; default = the server's (default %(default)s)")
    ap.add_argument("--rounds", type=int, default=1, help="sweep: requests per client (default %(default)s)")
    ap.add_argument("--repeats", type=int, default=1, help="sweep: runs of each cell, strategies taking turns (default %(default)s)")
    ap.add_argument("--hf-clients", default="1,8", help="sweep: request counts for transformers' generate_batch on the same prompts ('' = none; default %(default)s)")
    ap.add_argument("--max-batch", type=int, default=None, help="the server's --max-batch (default: its own)")
    ap.add_argument("--prefill-chunk", type=int, default=None, help="the server's --prefill-chunk (default: its own)")
    args = ap.parse_args(argv)
    if not (1 <= args.clients <= 64 and 1 <= args.requests <= 1000 and 1 <= args.prompts <= len(PROMPTS)):
        ap.error("--clients must be in 1..64, --requests in 1..1000, --prompts in 1..%d" % len(PROMPTS))
    if not (1 <= args.rounds <= 100 and 1 <= args.repeats <= 20):
        ap.error("--rounds must be in 1..100 and --repeats in 1..20")
    raw = args.hf_clients
    try:
        args.hf_clients = [int(c) for c in raw.split(",") if c.strip()]  # parsed once, here
    except ValueError:
        args.hf_clients = None
    if args.hf_clients is None or any(not 1 <= c <= 64 for c in args.hf_clients):
        ap.error(f"--hf-clients must be request counts in 1..64, comma-separated, or '' for none (got {raw!r})")
    if args.sweep:
        args.dtype = args.dtype or "bfloat16"
        args.max_tokens = 128 if args.max_tokens == 64 else args.max_tokens
        args.single_reps = 0
    args.dtype = args.dtype or "float32"
    args.device = args.device or "cpu"
    report = asyncio.run(run(args))
    if args.sweep:
        return print_sweep(report, args)
    s, ld = report["single_client"], report["load"]
    print(f"model {report['model']}  strategy {report['strategy']['strategy']}  max_tokens {args.max_tokens}")
    print(f"single client ({s['requests']} requests, interleaved with direct generation):")
    print(f"  total latency p50: direct {s['direct_p50_total_s'] * 1000:.1f} ms, server {s['server_p50_total_s'] * 1000:.1f} ms "
          f"-> overhead {s['overhead_p50']:+.1%} (paired median {s['paired_overhead_median']:+.1%}; target within 5%)")
    print(f"  time to first token p50: direct {s['direct_p50_ttft_s'] * 1000:.1f} ms, server {s['server_p50_ttft_s'] * 1000:.1f} ms")
    print(f"  outputs equal to direct generation: {s['requests'] - s['mismatches']}/{s['requests']}")
    print(f"load ({args.clients} concurrent streaming clients, {ld['requests']} requests):")
    print(f"  throughput {ld['throughput_req_s']:.2f} req/s, {ld['throughput_tok_s']:.1f} tok/s over {ld['wall_s']:.1f} s")
    print(f"  time to first token p50 {ld['ttft_p50_s'] * 1000:.0f} ms, p99 {ld['ttft_p99_s'] * 1000:.0f} ms")
    print(f"  total latency p50 {ld['latency_p50_s'] * 1000:.0f} ms, p99 {ld['latency_p99_s'] * 1000:.0f} ms")
    print(f"  errors {ld['errors']}, outputs differing from direct generation {ld['mismatches']}"
          + (f", not run (time limit) {ld['unfinished_due_to_time_limit']}" if ld["unfinished_due_to_time_limit"] else ""))
    if ld["error_samples"]:
        print("  e.g. " + "; ".join(ld["error_samples"]))
    if report.get("server_acceptance_rate") is not None:
        print(f"  server acceptance rate {report['server_acceptance_rate']:.1%}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    ok = ld["errors"] == 0 and ld["mismatches"] == 0 and s["mismatches"] == 0
    return 0 if ok else 1


def print_sweep(report: dict, args) -> int:
    rows = report["sweep"]
    print(f"model {report['model']} ({args.dtype}), greedy, {args.max_tokens} new tokens, openai client over loopback; "
          f"load average {os.getloadavg()[0]:.1f}")
    plain = {r["clients"]: r["tok_s"] for r in rows if r["strategy"] == "autoregressive"}
    print("| strategy | clients | tok/s | x 1 client | x autoregressive | TTFT p50 (ms) | TTFT x 1 client | longest stall (ms) | identical to solo |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        base = next(b for b in rows if b["strategy"] == r["strategy"])
        vs = f"{r['tok_s'] / plain[r['clients']]:.2f}" if r["clients"] in plain else ""
        print(f"| {r['strategy']} | {r['clients']} | {r['tok_s']:.1f} | {r['tok_s'] / base['tok_s']:.2f} | {vs} | {r['ttft_p50_s'] * 1000:.0f} | "
              f"{r['ttft_p50_s'] / base['ttft_p50_s']:.2f} | {r['longest_stall_s'] * 1000:.0f} | {r['identical']}/{r['requests']} |")
    hf = report.get("transformers") or []
    if hf:
        print("\n| transformers `generate_batch` | requests | tok/s | x 1 request |\n|---|---|---|---|")
        for r in hf:
            print(f"| same prompts, {args.max_tokens} new tokens | {r['clients']} | {r['tok_s']:.1f} | {r['tok_s'] / hf[0]['tok_s']:.2f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0 if all(r["identical"] == r["requests"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
