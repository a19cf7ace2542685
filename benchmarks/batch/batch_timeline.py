"""Where a batch's time to first token goes: the engine alone, step by step.

    python benchmarks/batch/batch_timeline.py                        # 8 clients x 2 rounds, the default strategy
    python benchmarks/batch/batch_timeline.py --clients 8 --rounds 1 --strategy autoregressive --steps 12

Runs server_load.py's sweep without the server: one thread steps a `BatchEngine` (as the
server's engine thread does), N client threads each submit --rounds greedy requests one after
another (server_load.py's prompts, 128 new tokens), so round 1 arrives together and later
rounds join running streams. Prints, for the first --steps steps of the N-client run, each
step's start, duration, decoding sequences, prompt rows still to prefill and the planner's
draft lengths; then every request's arrival, round, prompt length and time to first token;
then p50 TTFT against a 1-client run in the same process. HTTP is not measured here
(server_load.py is the end-to-end figure); this shows which requests wait for what.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[1] / "server")]  # common.py, server_load.py

import selfspec  # noqa: E402
from selfspec.batch import BatchEngine  # noqa: E402
from selfspec.config import GenerationConfig, SamplingConfig  # noqa: E402
from selfspec.errors import SelfSpecError  # noqa: E402
from selfspec.request import Request  # noqa: E402
from selfspec.server.worker import warmup  # noqa: E402

from server_load import PROMPTS  # noqa: E402


class TimedEngine(BatchEngine):
    """A BatchEngine that records each step: (start, seconds, decoding, prompt rows left, plan);
    plan None: a pass over newcomers' prompts alone (BatchEngine._first_prompts)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.log: list[tuple[float, float, int, int, list[int]]] = []

    def _step(self) -> None:
        t = time.perf_counter()
        left = sum(max(0, len(s.req.prompt_ids) - s.prefilled) for s in self._active)
        decoding = sum(s.decoding for s in self._active)
        super()._step()
        self.log.append((t, time.perf_counter() - t, decoding, left, list(self.last_plan)))

    def _prefill(self, prefill) -> None:
        t = time.perf_counter()
        left = sum(max(0, len(s.req.prompt_ids) - s.prefilled) for s in self._active)
        decoding = sum(s.decoding for s in self._active)
        super()._prefill(prefill)
        self.log.append((t, time.perf_counter() - t, decoding, left, None))


def run(model, draft, clients: int, rounds: int, max_new: int, chunk: int | None) -> tuple[TimedEngine, list[dict], float]:
    engine = TimedEngine(model, max_batch=max(16, clients), prefill_chunk=chunk)
    stop = threading.Event()

    def drive():
        while not stop.is_set():
            with model.computing():
                busy = engine.step()
            if not busy:
                time.sleep(0.0005)

    driver = threading.Thread(target=drive, daemon=True)
    driver.start()
    requests: list[dict] = []
    lock = threading.Lock()

    def client(i: int):
        for r in range(rounds):
            ids = model.encode(PROMPTS[(i * rounds + r) % len(PROMPTS)])
            first: list[float] = []
            t0 = time.perf_counter()
            handle = engine.submit(Request(ids, GenerationConfig(max_new_tokens=max_new), SamplingConfig(temperature=0.0),
                                           draft, lambda ev: first.append(time.perf_counter()) if not first else None))
            handle.wait()
            with lock:
                requests.append({"round": r, "prompt": len(ids), "t0": t0, "ttft": (first[0] - t0) if first else float("nan")})

    t_start = time.perf_counter()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    driver.join()
    return engine, requests, t_start


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gemma-3-270m")
    ap.add_argument("--strategy", default=None, help="a strategy name (default: the model's default, auto)")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--prefill-chunk", type=int, default=None, help="the engine's prefill chunk (default: its own)")
    ap.add_argument("--steps", type=int, default=10, help="steps of the timeline to print (default %(default)s)")
    args = ap.parse_args(argv)
    if args.clients < 1 or args.rounds < 1 or args.max_new_tokens < 1:
        print("error: --clients, --rounds and --max-new-tokens must be positive", file=sys.stderr)
        return 2
    try:
        model = selfspec.load(args.model, dtype="bfloat16")
        draft = model.draft_config(args.strategy) if args.strategy else model.draft_config()
    except SelfSpecError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    warmup(model, draft)
    _, solo, _ = run(model, draft, 1, args.rounds, args.max_new_tokens, args.prefill_chunk)
    engine, reqs, t_start = run(model, draft, args.clients, args.rounds, args.max_new_tokens, args.prefill_chunk)
    ms = lambda s: s * 1000  # noqa: E731
    print(f"{args.model} bf16, {args.strategy or 'default'} strategy, {args.clients} clients x {args.rounds} rounds, "
          f"prefill chunk {engine.prefill_chunk}")
    print("first steps (ms from the first submission):")
    for t, dt, dec, left, plan in engine.log[: args.steps]:
        what = f"drafts {plan}" if plan is not None else "newcomers' prompts alone"
        print(f"  at {ms(t - t_start):7.1f}: {ms(dt):5.1f} ms, decoding {dec}, prompt rows left {left:3d}, {what}")
    print("requests (by arrival):")
    for r in sorted(reqs, key=lambda r: r["t0"]):
        print(f"  round {r['round']} prompt {r['prompt']:3d} tokens, arrives {ms(r['t0'] - t_start):7.1f}, first token after {ms(r['ttft']):6.1f}")
    p1 = statistics.median(r["ttft"] for r in solo)
    pn = statistics.median(r["ttft"] for r in reqs)
    by_round = {k: statistics.median(r["ttft"] for r in reqs if r["round"] == k) for k in range(args.rounds)}
    print(f"TTFT p50: 1 client {ms(p1):.1f} ms, {args.clients} clients {ms(pn):.1f} ms ({pn / p1:.2f}x); by round: "
          + ", ".join(f"{k + 1}: {ms(v):.1f} ms" for k, v in by_round.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
