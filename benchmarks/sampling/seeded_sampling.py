"""A seed is one text (issue 44). On the default model (bf16), prompts of the built-in sets,
temperature 0.8, top_p 0.95, one seed per prompt:

  1. identity: for each coupling (gumbel, the default; rejection, for contrast) the seeded text
     of every strategy on 1 and on 2 threads, of generate_batch (all prompts at once), and of
     `selfspec serve` under 8 concurrent clients, against seeded autoregressive sampling on 1
     thread: how many are identical (gumbel: all, by construction; rejection: its text depends
     on the draft), and whether a strategy's 1- and 2-thread texts agree, and the server's
     texts its solo ones (rejection: not always, the int8 draft's kernels' bits depend on the
     thread count);
  2. speed, side by side: the default strategy (auto) sampled with gumbel and with rejection,
     and sampled autoregressive decoding with each, alternating prompt by prompt (--repeats
     rounds); tok/s over all tokens of an arm, and the ratios;
  3. acceptance per strategy under both rules (accepted / drafted, from part 1's 2-thread runs).

    python benchmarks/sampling/seeded_sampling.py                          # the full run (~10 min on 2 cores)
    python benchmarks/sampling/seeded_sampling.py --per-set 1 --no-server  # quicker
    python benchmarks/sampling/seeded_sampling.py --json out.json

Exit status 1 when any gumbel text differs (the guarantee broken).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks/: common.py
from common import stop_server  # noqa: E402

HOST = "127.0.0.1"
COUPLINGS = ("gumbel", "rejection")


def strategies(model) -> dict:
    """label -> DraftConfig: the default and the self-drafts that need nothing trained."""
    from selfspec.config import DraftConfig

    return {
        "auto (default)": model.draft_config(),
        "quantized int8 K5 (profile's)": DraftConfig("quantized", num_speculations=5, draft_vocab=16384),
        "quantized int4 K4": DraftConfig("quantized", draft_bits=4, num_speculations=4),
        "quantized int8 K5 + lookup": DraftConfig("quantized", num_speculations=5, draft_vocab=16384, lookup_first=True),
        "early-exit E14 K3": DraftConfig("early-exit", exit_layer=14, num_speculations=3),
        "layer-skip mlp 8,10 K3": DraftConfig("layer-skip", skip_mlp=(8, 10), num_speculations=3),
        "prompt-lookup K4": DraftConfig("prompt-lookup"),
    }


def prompts_of(args) -> list[tuple[str, list[int]]]:
    from selfspec.tools.datasets import load_dataset

    out = []
    for name in ("code", "text", "summarize"):
        for s in load_dataset(name, args.per_set, seed=0).samples:
            out.append((s.id, s.prompt))
    return out


def gen(model, ids, seed, args, coupling, draft, n_threads=None):
    if n_threads is not None:
        torch.set_num_threads(n_threads)
    return model.generate(ids, max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                          seed=seed, coupling=coupling, draft=draft)


def identity(model, prompts, args) -> dict:
    from selfspec.config import DraftConfig

    ar = DraftConfig("autoregressive")
    report = {}
    for coupling in COUPLINGS:
        refs = [gen(model, ids, 1000 + i, args, coupling, ar, 1) for i, (_, ids) in enumerate(prompts)]
        rows = {}
        for label, cfg in strategies(model).items():
            row, by_threads = {}, {}
            for n in (1, 2):
                outs = by_threads[n] = [gen(model, ids, 1000 + i, args, coupling, cfg, n) for i, (_, ids) in enumerate(prompts)]
                row[f"threads_{n}"] = sum(o.token_ids == r.token_ids for o, r in zip(outs, refs))
                if n == 2:
                    row["drafted"] = sum(o.stats.drafted for o in outs)
                    row["accepted"] = sum(o.stats.accepted for o in outs)
            # the issue's own observation: the same strategy and seed on 1 and on 2 threads
            row["threads_1_vs_2"] = sum(a.token_ids == b.token_ids for a, b in zip(by_threads[1], by_threads[2]))
            rows[label] = row
            if label == "auto (default)":
                solo_default = [o.text for o in by_threads[2]]
            print(f"  {coupling:9s} {label:32s} identical 1 thread {row['threads_1']}/{len(prompts)}, 2 threads "
                  f"{row['threads_2']}/{len(prompts)}, 1 vs 2 threads {row['threads_1_vs_2']}/{len(prompts)}, "
                  f"acceptance {row['accepted'] / max(row['drafted'], 1):.3f}", file=sys.stderr, flush=True)
        torch.set_num_threads(2)
        batch = model.generate_batch([ids for _, ids in prompts], max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                     top_p=args.top_p, seed=[1000 + i for i in range(len(prompts))], coupling=coupling)
        rows["generate_batch (auto, 2 threads)"] = {"threads_2": sum(o.token_ids == r.token_ids for o, r in zip(batch, refs))}
        # what the server is compared with: the reference, and the default strategy's own solo text (2 threads)
        report[coupling] = {"rows": rows, "refs": [r.text for r in refs], "solo_default": solo_default}
    return report


def speed(model, prompts, args) -> dict:
    from selfspec.config import DraftConfig

    torch.set_num_threads(args.speed_threads)
    arms = {f"{s} {c}": (DraftConfig("autoregressive") if s == "autoregressive" else model.draft_config(), c)
            for s in ("auto", "autoregressive") for c in COUPLINGS}
    tokens = {a: 0 for a in arms}
    seconds = {a: 0.0 for a in arms}
    stats = {a: {"verify_steps": 0, "drafted": 0, "accepted": 0, "draft_s": 0.0, "verify_s": 0.0} for a in arms}
    for (_, ids), i in zip(prompts[:1], range(1)):  # warm-up of every arm
        for cfg, c in arms.values():
            gen(model, ids, 1, args, c, cfg)
    for rep in range(args.repeats):
        for i, (_, ids) in enumerate(prompts):
            order = list(arms) if (rep + i) % 2 == 0 else list(reversed(arms))  # alternate who goes first
            for a in order:
                cfg, c = arms[a]
                t = time.perf_counter()
                out = gen(model, ids, 2000 + 31 * rep + i, args, c, cfg)
                seconds[a] += time.perf_counter() - t
                tokens[a] += len(out.token_ids)
                st = stats[a]
                st["verify_steps"] += out.stats.verify_steps
                st["drafted"] += out.stats.drafted
                st["accepted"] += out.stats.accepted
                st["draft_s"] += out.stats.time_draft_s
                st["verify_s"] += out.stats.time_verify_s
    tps = {a: tokens[a] / seconds[a] for a in arms}
    for a, st in stats.items():
        st["acceptance"] = st["accepted"] / st["drafted"] if st["drafted"] else 0.0
        st["tokens_per_step"] = (st["accepted"] + st["verify_steps"]) / st["verify_steps"]
        st["ms_per_step"] = 1e3 * (st["draft_s"] + st["verify_s"]) / st["verify_steps"]
    return {"tok_s": tps, "tokens": tokens, "steps": stats,
            "gumbel_over_rejection": tps["auto gumbel"] / tps["auto rejection"],
            "gumbel_over_ar_gumbel": tps["auto gumbel"] / tps["autoregressive gumbel"],
            "gumbel_over_ar_rejection": tps["auto gumbel"] / tps["autoregressive rejection"],
            "ar_gumbel_over_ar_rejection": tps["autoregressive gumbel"] / tps["autoregressive rejection"]}


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


async def _serve_requests(url: str, model_name: str, jobs: list[dict], clients: int, timeout: float) -> list[dict]:
    import httpx

    results: list[dict | None] = [None] * len(jobs)
    nxt = [0]

    async def client_loop(client):
        while nxt[0] < len(jobs):
            j = nxt[0]
            nxt[0] += 1
            r = await client.post(url + "/v1/completions", json={"model": model_name, **jobs[j]}, timeout=timeout)
            body = r.json()
            results[j] = {"status": r.status_code, "text": body["choices"][0]["text"] if r.status_code == 200 else None,
                          "fingerprint": body.get("system_fingerprint")}

    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=clients + 2)) as client:
        await asyncio.gather(*(client_loop(client) for _ in range(clients)))
    return results


def server(model, prompts, ident: dict, args) -> dict:
    """`selfspec serve` (default strategy, 2 threads) under args.clients concurrent clients: every
    prompt with its seed, under both couplings, args.server_rounds times, in an interleaved order;
    each text against the reference (seeded autoregressive sampling) and against the default
    strategy's solo `generate` in this process (2 threads)."""
    import httpx

    port = free_port()
    url = f"http://{HOST}:{port}"
    log = tempfile.NamedTemporaryFile("w", prefix="selfspec-seeded-serve-", suffix=".log", delete=False)
    cmd = [sys.executable, "-m", "selfspec", "serve", "--model", "gemma-3-270m", "--dtype", "bfloat16", "--host", HOST,
           "--port", str(port), "--threads", "2", "--max-concurrency", str(4 * args.clients), "--log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start; log: {log.name}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        name = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        jobs, want = [], []
        for rnd in range(args.server_rounds):
            for i, (_, ids) in enumerate(prompts):
                for c in COUPLINGS:
                    jobs.append({"prompt": ids, "max_tokens": args.max_new_tokens, "temperature": args.temperature,
                                 "top_p": args.top_p, "seed": 1000 + i, "selfspec": {"coupling": c}})
                    want.append((c, ident[c]["refs"][i], ident[c]["solo_default"][i]))
        order = list(range(len(jobs)))
        order = order[::2] + order[1::2]  # the couplings apart: each round's requests mixed across the batch
        got = asyncio.run(_serve_requests(url, name, [jobs[j] for j in order], args.clients, 600))
        out = {c: {"identical": 0, "same_as_solo": 0, "requests": 0} for c in COUPLINGS}
        fps = set()
        for j, g in zip(order, got):
            c, ref, solo = want[j]
            out[c]["requests"] += 1
            out[c]["identical"] += g["status"] == 200 and g["text"] == ref
            out[c]["same_as_solo"] += g["status"] == 200 and g["text"] == solo
            fps.add(g["fingerprint"])
        out["fingerprints"] = sorted(fp for fp in fps if fp)
        return out
    finally:
        stop_server(proc)
        log.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--per-set", type=int, default=2, help="prompts from each built-in set (code, text, summarize)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--repeats", type=int, default=3, help="rounds of the speed comparison")
    ap.add_argument("--speed-threads", type=int, default=2, help="threads of the speed comparison")
    ap.add_argument("--clients", type=int, default=8, help="concurrent clients of the server")
    ap.add_argument("--server-rounds", type=int, default=2)
    ap.add_argument("--no-server", action="store_true")
    ap.add_argument("--no-identity", action="store_true")
    ap.add_argument("--no-speed", action="store_true")
    ap.add_argument("--json", default=None, help="write the report here")
    args = ap.parse_args(argv)

    import selfspec

    model = selfspec.load("gemma-3-270m", dtype="bfloat16")
    prompts = [(pid, model.encode(p, False)) for pid, p in prompts_of(args)]
    report: dict = {"model": "gemma-3-270m bf16", "numerics": model.runtime.numerics, "prompts": [p for p, _ in prompts],
                    "sampling": {"temperature": args.temperature, "top_p": args.top_p, "max_new_tokens": args.max_new_tokens}}
    print(f"{len(prompts)} prompts; numerics {model.runtime.numerics}", file=sys.stderr, flush=True)
    ok = True
    if not args.no_identity:
        ident = identity(model, prompts, args)
        report["identity"] = {c: v["rows"] for c, v in ident.items()}
        ok = all(r.get(f"threads_{n}", len(prompts)) == len(prompts) for r in ident["gumbel"]["rows"].values() for n in (1, 2))
        if not args.no_server:
            report["server"] = server(model, prompts, ident, args)
            s = report["server"]["gumbel"]
            ok = ok and s["identical"] == s["requests"]
            print(f"  server: {report['server']}", file=sys.stderr, flush=True)
    if not args.no_speed:
        report["speed"] = speed(model, prompts, args)
    n = len(prompts)
    print(f"\nmodel gemma-3-270m bf16 ({model.runtime.numerics}), {n} prompts (code, text, summarize), T {args.temperature}, "
          f"top_p {args.top_p}, {args.max_new_tokens} new tokens; references: seeded autoregressive sampling, 1 thread")
    if "identity" in report:
        print("identical to the reference (1t, 2t: that strategy on 1 / 2 threads; 1t=2t: its two runs agree)")
        print(f"{'':34s}" + "".join(f"{c + ' 1t':>14s}{c + ' 2t':>14s}{c[:3] + ' 1t=2t':>11s}{'acc. ' + c:>16s}" for c in COUPLINGS))
        for label in report["identity"]["gumbel"]:
            line = f"{label:34s}"
            for c in COUPLINGS:
                r = report["identity"][c][label]
                acc = f"{r['accepted'] / r['drafted']:.3f}" if r.get("drafted") else "-"
                same = f"{r['threads_1_vs_2']}/{n}" if "threads_1_vs_2" in r else "-"
                line += (f"{(str(r['threads_1']) + '/' + str(n)) if 'threads_1' in r else '-':>14s}"
                         f"{str(r['threads_2']) + '/' + str(n):>14s}{same:>11s}{acc:>16s}")
            print(line)
        if "server" in report:
            s = report["server"]
            print(f"selfspec serve, {args.clients} clients, identical to the reference / to solo generate (default strategy, "
                  "2 threads): " + ", ".join(f"{c} {s[c]['identical']}/{s[c]['requests']} / {s[c]['same_as_solo']}/{s[c]['requests']}"
                                             for c in COUPLINGS) + f"; fingerprints {s['fingerprints']}")
    sp = report.get("speed")
    if sp is None:
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=1))
        return 0 if ok else 1
    print(f"speed ({args.speed_threads} threads; tok/s, all tokens of an arm, alternating): " + ", ".join(f"{a} {v:.1f}" for a, v in sp["tok_s"].items()))
    print("per verify step: " + "; ".join(f"{a}: acceptance {st['acceptance']:.3f}, {st['tokens_per_step']:.2f} tokens, "
                                           f"{st['ms_per_step']:.1f} ms" for a, st in sp["steps"].items()))
    print(f"auto gumbel / auto rejection {sp['gumbel_over_rejection']:.3f}x; auto gumbel / autoregressive gumbel "
          f"{sp['gumbel_over_ar_gumbel']:.2f}x (/ autoregressive rejection {sp['gumbel_over_ar_rejection']:.2f}x); "
          f"autoregressive gumbel / rejection {sp['ar_gumbel_over_ar_rejection']:.3f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
