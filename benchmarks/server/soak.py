"""Soak test of `selfspec serve` (loopback only, bounded in count and time).

    python benchmarks/server/soak.py                          # gemma-3-270m, bfloat16, 1000 requests, 8 clients
    python benchmarks/server/soak.py --tiny --requests 60     # a tiny random model built on the fly

Starts `selfspec serve` (port 0, an API key) as a subprocess, loads the same model here for
direct generation, then sends --requests requests from --clients concurrent clients, a
deterministic mix (seeded):

    stream      greedy completion or chat, streamed with the `openai` client; text compared
    plain       greedy completion or chat, not streamed; text compared
    leave       streamed, the client disconnects after its first chunk
    malformed   a body that is not JSON, or JSON of the wrong shape (expect 400)
    oversized   a text prompt over the character bound (400), or a body over the byte limit (413)
    bad_key     a wrong API key (expect 401)

and reports: 5xx count (target 0), unexpected statuses, outputs equal to direct generation,
the server's RSS before/after (target within 5%), p50/p99 latency per kind, and whether any
admission slot leaked (/health in_progress and waiting back to 0). A JSON report and a
printed table; exit status 1 when any target is missed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import openai
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks/: common.py
from common import stop_server  # noqa: E402

HOST = "127.0.0.1"  # loopback only, by design
KEY = "soak-key"
NAME = "soak"
PROMPTS = [
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "The three primary colours are",
    "Q: What is the capital of France?\nA:",
    "Once upon a time, in a small village by the sea,",
    "import numpy as np\n\ndef normalize(x):\n",
    "List three benefits of regular exercise:\n1.",
]
MIX = (("stream", 40), ("plain", 20), ("leave", 12), ("malformed", 10), ("oversized", 8), ("bad_key", 10))
EXPECTED = {"stream": {200}, "plain": {200}, "leave": {200}, "malformed": {400}, "oversized": {400, 413}, "bad_key": {401}}


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    k = (len(v) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


class Server:
    """`selfspec serve` in its own session on a port it picks itself (port 0)."""

    def __init__(self, model: str, extra: list[str], log_path: Path, startup_timeout: float = 600):
        self.log_path = log_path
        self._log = open(log_path, "w")
        cmd = [sys.executable, "-m", "selfspec", "serve", "--model", model, "--host", HOST, "--port", "0",
               "--served-model-name", NAME, "--api-key", KEY, *extra]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        deadline = time.monotonic() + startup_timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n{self.log()[-3000:]}")
            m = re.search(rf"running on http://{HOST}:(\d+)", self.log())
            if m:
                self.url = f"http://{HOST}:{m.group(1)}"
                break
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("the server did not start in time")
            time.sleep(0.2)

    def log(self) -> str:
        return self.log_path.read_text()

    def rss_mb(self) -> float:
        return psutil.Process(self.proc.pid).memory_info().rss / 2**20

    def stop(self) -> int:
        rc = stop_server(self.proc)
        self._log.close()
        return rc


def references(model, max_tokens: int) -> dict:
    """Direct greedy generation of every (prompt, chat) the soak sends."""
    refs = {}
    for p in PROMPTS:
        for chat in (False, True):
            if chat and not model.chat_template:
                continue
            refs[(p, chat)] = model.generate(p, max_new_tokens=max_tokens, temperature=0.0, chat=chat).text
    return refs


def plan(n: int, seed: int, chat_ok: bool) -> list[tuple[str, str, bool]]:
    """n (kind, prompt, chat) in a seeded order."""
    rng = random.Random(seed)
    kinds = [k for k, w in MIX for _ in range(w)]
    return [(rng.choice(kinds), rng.choice(PROMPTS), chat_ok and rng.random() < 0.4) for _ in range(n)]


async def _generate(ai: openai.AsyncOpenAI, kind: str, prompt: str, chat: bool, max_tokens: int) -> tuple[int, str | None]:
    kw = dict(model=NAME, max_tokens=max_tokens, temperature=0)
    if kind == "plain":
        if chat:
            r = await ai.chat.completions.create(messages=[{"role": "user", "content": prompt}], **kw)
            return 200, r.choices[0].message.content
        r = await ai.completions.create(prompt=prompt, **kw)
        return 200, r.choices[0].text
    if chat:
        stream = await ai.chat.completions.create(messages=[{"role": "user", "content": prompt}], stream=True, **kw)
    else:
        stream = await ai.completions.create(prompt=prompt, stream=True, **kw)
    parts = []
    async for c in stream:
        if c.choices:
            parts.append((c.choices[0].delta.content if chat else c.choices[0].text) or "")
        if kind == "leave":
            await stream.close()  # mid-stream: the client goes away
            return 200, None
    return 200, "".join(parts)


async def _raw(http: httpx.AsyncClient, url: str, kind: str, i: int, limits: dict) -> int:
    headers = {"Authorization": f"Bearer {KEY}", "content-type": "application/json"}
    if kind == "bad_key":
        body = json.dumps({"model": NAME, "prompt": "Hi", "max_tokens": 2}).encode()
        headers["Authorization"] = "Bearer wrong-key" if i % 2 else "Basic " + KEY
    elif kind == "malformed":
        body = [b"{not json", b"", b"[1, 2]", json.dumps({"model": NAME, "prompt": 42}).encode(),
                json.dumps({"model": NAME, "prompt": "Hi", "max_tokens": "ten"}).encode()][i % 5]
    elif i % 4:  # over the character bound, under the byte limit: refused before tokenizing
        body = json.dumps({"model": NAME, "prompt": "word " * (limits["max_prompt_chars"] // 5 + 2)}).encode()
    else:  # over the byte limit
        body = b'{"model": "' + NAME.encode() + b'", "prompt": "' + b"x" * limits["max_request_bytes"] + b'"}'
    r = await http.post(url + "/v1/completions", content=body, headers=headers)
    if "error" not in r.json():
        raise AssertionError(f"no OpenAI-style error in {r.text[:200]}")
    return r.status_code


async def soak(url: str, refs: dict, n: int, clients: int, max_tokens: int, seed: int, limits: dict) -> dict:
    chat_ok = any(chat for _, chat in refs)
    todo = plan(n, seed, chat_ok)
    results: list[dict] = []
    queue: asyncio.Queue = asyncio.Queue()
    for i, item in enumerate(todo):
        queue.put_nowait((i, *item))
    async with httpx.AsyncClient(timeout=300) as http:
        ai = openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=300, http_client=http)

        async def client():
            while not queue.empty():
                i, kind, prompt, chat = queue.get_nowait()
                t0 = time.perf_counter()
                text = None
                try:
                    if kind in ("stream", "plain", "leave"):
                        status, text = await _generate(ai, kind, prompt, chat, max_tokens)
                    else:
                        status = await _raw(http, url, kind, i, limits)
                except openai.APIStatusError as e:
                    status = e.status_code
                except (openai.APIConnectionError, httpx.HTTPError) as e:
                    status = f"connection error: {type(e).__name__}"
                equal = None if text is None else text == refs[(prompt, chat)]
                results.append({"kind": kind, "status": status, "latency_s": time.perf_counter() - t0, "equal": equal})

        await asyncio.gather(*(client() for _ in range(clients)))
    return summarize(results)


def summarize(results: list[dict]) -> dict:
    by_kind = {}
    for kind, _ in MIX:
        rs = [r for r in results if r["kind"] == kind]
        lat = [r["latency_s"] for r in rs]
        by_kind[kind] = {"requests": len(rs), "p50_s": pct(lat, 0.5), "p99_s": pct(lat, 0.99),
                         "unexpected": sorted({str(r["status"]) for r in rs if r["status"] not in EXPECTED[kind]})}
    compared = [r for r in results if r["equal"] is not None]
    lat = [r["latency_s"] for r in results if r["kind"] in ("stream", "plain")]
    return {
        "requests": len(results),
        "5xx": sum(1 for r in results if isinstance(r["status"], int) and r["status"] >= 500),
        "unexpected_status": sum(1 for r in results if r["status"] not in EXPECTED[r["kind"]]),
        "outputs_compared": len(compared),
        "outputs_equal": sum(1 for r in compared if r["equal"]),
        "generation_p50_s": pct(lat, 0.5),
        "generation_p99_s": pct(lat, 0.99),
        "all_p50_s": pct([r["latency_s"] for r in results], 0.5),
        "all_p99_s": pct([r["latency_s"] for r in results], 0.99),
        "by_kind": by_kind,
    }


def settle(url: str, timeout: float = 60) -> dict:
    """/health once every admitted request has ended (a leaked slot never gets there)."""
    deadline = time.monotonic() + timeout
    while True:
        h = httpx.get(url + "/health", timeout=30).json()
        if (h["in_progress"] == 0 and h["waiting"] == 0) or time.monotonic() > deadline:
            return h
        time.sleep(0.2)


def run(model, model_src: str, serve_args: list[str], n: int, clients: int, max_tokens: int, seed: int, log_path: Path) -> dict:
    """The whole soak against a fresh server; `model` is the same model loaded here."""
    refs = references(model, max_tokens)
    srv = Server(model_src, serve_args, log_path)
    try:
        card = httpx.get(srv.url + "/health", timeout=30).json()
        limits = {"max_prompt_chars": 0, "max_request_bytes": 8 * 1024 * 1024}
        limits["max_prompt_chars"] = card["max_prompt_tokens"] * max(len(t) for t in model.tokenizer.get_vocab())
        warm = min(n // 10, 50)  # allocator and caches reach steady state before RSS is read
        asyncio.run(soak(srv.url, refs, warm, clients, max_tokens, seed + 1, limits))
        settle(srv.url)
        rss0 = srv.rss_mb()
        t0 = time.perf_counter()
        report = asyncio.run(soak(srv.url, refs, n, clients, max_tokens, seed, limits))
        report["wall_s"] = time.perf_counter() - t0
        health = settle(srv.url)
        report["rss_before_mb"], report["rss_after_mb"] = rss0, srv.rss_mb()
        report["rss_change"] = report["rss_after_mb"] / rss0 - 1
        report["leaked_slots"] = health["in_progress"] + health["waiting"]
        report["health_outcomes"] = health.get("outcomes")
        report["clients"], report["max_tokens"], report["warmup_requests"] = clients, max_tokens, warm
    finally:
        code = srv.stop()
    report["server_exit"] = code
    report["server_tracebacks"] = srv.log().count("Traceback")
    return report


def ok(report: dict) -> bool:
    return (report["5xx"] == 0 and report["unexpected_status"] == 0 and report["outputs_equal"] == report["outputs_compared"]
            and report["leaked_slots"] == 0 and abs(report["rss_change"]) <= 0.05 and report["server_tracebacks"] == 0)


def print_table(r: dict) -> None:
    print(f"{r['requests']} requests, {r['clients']} clients, max_tokens {r['max_tokens']}, {r['wall_s']:.1f} s")
    print(f"  5xx {r['5xx']}   unexpected statuses {r['unexpected_status']}   outputs equal {r['outputs_equal']}/{r['outputs_compared']}"
          f"   leaked slots {r['leaked_slots']}   tracebacks in the log {r['server_tracebacks']}")
    print(f"  server RSS {r['rss_before_mb']:.0f} MB -> {r['rss_after_mb']:.0f} MB ({r['rss_change']:+.1%})")
    print(f"  {'kind':<10} {'requests':>8} {'p50 s':>8} {'p99 s':>8}  unexpected")
    for kind, k in r["by_kind"].items():
        fmt = lambda v: f"{v:8.3f}" if v is not None else f"{'-':>8}"  # noqa: E731
        print(f"  {kind:<10} {k['requests']:>8} {fmt(k['p50_s'])} {fmt(k['p99_s'])}  {', '.join(k['unexpected']) or '-'}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gemma-3-270m")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--tiny", action="store_true", help="a tiny random model built here (smoke run)")
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None, help="torch threads of the server")
    ap.add_argument("--json", default=None, help="also write the report to this file")
    args = ap.parse_args(argv)
    import selfspec  # after argument parsing: --help stays instant

    tmp = Path(tempfile.mkdtemp(prefix="selfspec-soak-"))
    model_src = args.model
    if args.tiny:
        sys.path.insert(0, str(Path(__file__).parent))
        from server_load import build_tiny

        model_src = str(build_tiny(tmp / "tiny"))
        args.dtype = "float32"
    model = selfspec.load(model_src, dtype=args.dtype, device="cpu")
    serve_args = ["--dtype", args.dtype, "--device", "cpu", "--max-concurrency", str(max(16, args.clients))]
    if args.threads:
        serve_args += ["--threads", str(args.threads)]
    report = run(model, model_src, serve_args, args.requests, args.clients, args.max_tokens, args.seed, tmp / "server.log")
    report.update(model=args.model if not args.tiny else "tiny", dtype=args.dtype, server_log=str(tmp / "server.log"))
    print_table(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0 if ok(report) else 1


if __name__ == "__main__":
    sys.exit(main())
