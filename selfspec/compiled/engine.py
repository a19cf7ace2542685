"""The compiled backend's engine: prefill each sequence, then run one compiled step per
speculative step over the whole batch, reading back [B, K + 2] values once per step.

A step is compiled once per (plan, greedy or sampled, batch bucket, capacity) with
torch.compile(fullgraph=True, dynamic=False): on CUDA in mode "reduce-overhead" (CUDA graphs;
the state tensors are marked static so the graph reads and writes them in place), elsewhere
the default mode. `compile_backend` picks torch.compile's backend ("inductor"; tests also use
"aot_eager" to trace every bucket cheaply, and None runs the step uncompiled).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable

import torch
import torch._dynamo

from selfspec.compiled import forward as fw
from selfspec.compiled.noise import key_words, picks
from selfspec.compiled.step import Plan, StepState, run_step
from selfspec.compiled.weights import StaticWeights, rope_tables, static_weights
from selfspec.config import GenerationConfig
from selfspec.engine import GenerationResult, GenerationStats, _Output
from selfspec.runtime import Runtime

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32)
_MIN_CAPACITY = 256


def batch_bucket(n: int) -> int:
    for b in BATCH_BUCKETS:
        if n <= b:
            return b
    raise ValueError(f"a batch of {n} sequences is past the largest batch bucket ({BATCH_BUCKETS[-1]})")


def capacity_for(tokens: int) -> int:
    """A power of two >= tokens (and >= 256): few capacities, so few compiled steps."""
    c = _MIN_CAPACITY
    while c < tokens:
        c *= 2
    return c


class CompiledEngine:
    def __init__(self, runtime: Runtime, compile_backend: str | None = "inductor", mode: str | None = None):
        self.rt = runtime
        self.compile_backend = compile_backend
        self.mode = mode if mode is not None else ("reduce-overhead" if runtime.device.type == "cuda" else None)
        self._weights: StaticWeights | None = None
        self._steps: dict[tuple, Callable[[StepState], torch.Tensor]] = {}
        # every step variant recompiles run_step's code: room for all of them
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 256)
        torch._dynamo.config.accumulated_recompile_limit = max(torch._dynamo.config.accumulated_recompile_limit, 4096)

    def weights(self, capacity: int) -> StaticWeights:
        """The weights with rotary tables for `capacity` positions (the matrices made once)."""
        w = self._weights
        if w is None:
            w = self._weights = static_weights(self.rt, capacity)
        elif next(iter(w.rope.values()))[0].shape[0] < capacity:
            w = self._weights = dataclasses.replace(w, rope=rope_tables(self.rt, capacity, w.device))
        return w

    def step(self, plan: Plan, sampled: bool, batch: int, capacity: int) -> Callable[[StepState], torch.Tensor]:
        """The step for this plan and shape bucket: compiled on first use, then kept."""
        key = (plan, sampled, batch, capacity)
        fn = self._steps.get(key)
        if fn is None:
            fn = functools.partial(run_step, self.weights(capacity), plan, sampled)
            if self.compile_backend is not None:
                fn = torch.compile(fn, fullgraph=True, dynamic=False, backend=self.compile_backend, mode=self.mode)
            self._steps[key] = fn
        return fn

    def new_state(self, batch: int, capacity: int, keys: list[int | None], temperature: float) -> StepState:
        w, dev = self.weights(capacity), self.rt.device
        words = [key_words(k or 0) for k in keys] + [(0, 0)] * (batch - len(keys))
        st = StepState(fw.StaticCache.new(w, batch, capacity), torch.zeros(batch, dtype=torch.long, device=dev),
                       torch.zeros(batch, dtype=torch.long, device=dev), torch.zeros(batch, dtype=torch.bool, device=dev),
                       torch.tensor(words, dtype=torch.long, device=dev),
                       torch.full((batch,), max(temperature, 1e-30), dtype=torch.float32, device=dev))
        if dev.type == "cuda":
            for t in (st.cache.k, st.cache.v, st.pending, st.pos, st.active, st.key, st.temperature):
                torch._dynamo.mark_static_address(t)
        return st

    def prefill(self, st: StepState, b: int, ids: list[int], sampled: bool) -> None:
        """Sequence b's prompt through the model (eagerly: one pass per prompt); its first new
        token becomes pending at position len(ids)."""
        w, dev = self._weights, self.rt.device
        T = len(ids)
        P = torch.arange(T, device=dev)[None]
        h = fw.layers(w, fw.embed(w, torch.tensor([ids], device=dev)), P, st.cache.rows(b), 0, w.num_layers)
        lg = fw.logits(w, h[:, -1:])
        tok = picks(lg, torch.full((1, 1), T, device=dev), st.key[b : b + 1] if sampled else None, st.temperature[b : b + 1])
        st.pending[b] = tok[0, 0]
        st.pos[b] = T
        st.active[b] = True

    def generate(self, prompts: list[list[int]], gens: list[GenerationConfig], plan: Plan, keys: list[int | None] | None,
                 temperature: float, tokenizer=None, eos_ids: tuple[int, ...] = ()) -> list[GenerationResult]:
        """Every prompt's generation, all in one batch. keys: the Gumbel noise keys (sampling),
        None for greedy."""
        t0 = time.perf_counter()
        n, sampled = len(prompts), keys is not None
        B = batch_bucket(n)
        cap = capacity_for(max(len(p) + g.max_new_tokens for p, g in zip(prompts, gens)) + fw.ROWS + 2)
        outs = [_Output(tokenizer, g, eos_ids, None) for g in gens]
        stats = [GenerationStats(prompt_tokens=len(p), per_position_drafted=[0] * plan.k, per_position_accepted=[0] * plan.k)
                 for p in prompts]
        with torch.inference_mode():
            st = self.new_state(B, cap, keys or [None] * n, temperature)
            for b, ids in enumerate(prompts):
                self.prefill(st, b, ids, sampled)
            first = st.pending.tolist()
            t_prefill = time.perf_counter() - t0
            for b in range(n):
                outs[b].push([first[b]], [False])
            self._decode(st, plan, sampled, outs, stats)
        elapsed = time.perf_counter() - t0
        results = []
        for o, s, p in zip(outs, stats, prompts):
            s.time_s, s.time_prefill_s, s.time_to_first_token_s, s.new_tokens = elapsed, t_prefill, t_prefill, len(o.ids)
            s.draft = {"label": f"{plan.strategy} K={plan.k} (compiled)", "backend": "compiled"}
            results.append(GenerationResult(o.final_text(), o.ids, len(p), o.finish, s, o.drafted))
        return results

    def _decode(self, st: StepState, plan: Plan, sampled: bool, outs: list[_Output], stats: list[GenerationStats]) -> None:
        """Steps until every sequence finished; one read of the step's output per step."""
        step = self.step(plan, sampled, st.pos.shape[0], st.cache.capacity)
        for b, o in enumerate(outs):
            if o.finish is not None:
                st.active[b] = False
        while any(o.finish is None for o in outs):
            rows = step(st).tolist()  # the step's one host read
            for b, o in enumerate(outs):
                if o.finish is not None:
                    continue
                n = rows[b][0]
                o.push(rows[b][1 : n + 2], [True] * n + [False])
                stats[b].count_step(plan.k, n)
                if o.finish is not None:
                    st.active[b] = False

