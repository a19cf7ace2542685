"""Speculation that knows the batch: how many tokens each sequence drafts this step.

One batched step costs the draft forwards plus ONE verify pass over every row of every
sequence (pending token + drafts) and the prefill rows riding along. Rows are nearly free
while a pass is bound by streaming the weights and cost their arithmetic once it is bound
by compute, so the same draft that pays for one sequence may not pay in a batch of 16
(llama.cpp: lookup decoding 1.10x at 1 slot, 0.77x at 8). The planner maximises the batch's
expected tokens per second

    sum_i E[N](alpha_i, k_i) / (t_draft(k) + t_verify(P + sum_i (k_i + 1)))

over k_i in 0..cap_i, greedily: starting from k = 0, repeatedly grant the one extra draft
token that raises the objective most, until none does. E[N] grows by alpha_i^(k_i+1) per
token; t_verify comes from BatchCosts measured over total row counts (the per-sequence
predictor.costs stops at 17 rows), and a self-draft's extra token costs the rows it adds
to its group's draft forwards. Decisions never change output (every draft is verified);
they are used for greedy decoding only (module sequence.py says why not when sampling).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from selfspec.cache import SegmentTable
from selfspec.runtime import _nbytes

ROWS = (1, 2, 4, 8, 16, 32, 64, 128)


@dataclass
class BatchCosts:
    """Seconds of a batched pass at each total row count (ROWS; others interpolate)."""

    layers: dict[int, float]  # all layers over R rows (spread over several sequences)
    head: dict[int, float]  # final norm + full LM head over R rows
    overhead: float = 2e-4  # per forward call (Python, tables)
    _draft_cache: dict = field(default_factory=dict)

    @classmethod
    def measure(cls, rt, repeats: int = 2, context: int = 64) -> "BatchCosts":
        clock, layers, head = time.perf_counter, {}, {}
        H, gen = rt.spec.hidden_size, torch.Generator().manual_seed(0)
        caches = [rt.new_cache(context + 2 * max(ROWS)) for _ in range(8)]

        def timed(fn) -> float:
            fn()
            ts = []
            for _ in range(repeats):
                t0 = clock()
                fn()
                ts.append(clock() - t0)
            return statistics.median(ts)

        with torch.inference_mode():
            for r in ROWS:
                n = min(r, len(caches))  # r rows over n sequences, as a decoding batch has them
                sizes = [r // n + (i < r % n) for i in range(n)]
                table = SegmentTable([(c, context, s) for c, s in zip(caches, sizes)])
                h = (torch.randn(r, H, generator=gen) * 0.1).to(rt.device, rt.dtype)
                layers[r] = timed(lambda: rt.run_layers_batch(h, 0, rt.num_layers, table))
                head[r] = timed(lambda: rt.logits(h))
        for table in (layers, head):  # more rows never cost less (noise must not say otherwise)
            for a, b in zip(ROWS, ROWS[1:]):
                table[b] = max(table[b], table[a])
        return cls(layers, head)

    @staticmethod
    def _interp(table: dict[int, float], rows: float) -> float:
        if rows <= 0:
            return 0.0
        xs = sorted(table)
        if rows > xs[-1]:  # beyond the table: linear in rows from the last two points
            a, b = xs[-2], xs[-1]
            return table[b] + (rows - b) * (table[b] - table[a]) / (b - a)
        return float(np.interp(rows, xs, [table[x] for x in xs]))

    def verify(self, rows: int, logit_rows: int | None = None) -> float:
        """A pass over `rows` rows with logits for `logit_rows` of them (default all)."""
        if rows <= 0:
            return 0.0
        lr = rows if logit_rows is None else logit_rows
        return self.overhead + self._interp(self.layers, rows) + self._interp(self.head, lr)

    def draft_step(self, rt, draft_rt, exit_layer: int, head, rows: int) -> float:
        """One batched draft forward of `rows` sequences: layers 0..exit-1 of the draft runtime
        (a quantized copy scaled by its bytes) and its draft head (scaled by bytes)."""
        if rows <= 0:
            return 0.0
        key = (id(draft_rt), exit_layer, id(head))
        if key not in self._draft_cache:
            lb = sum(_nbytes(t) for L in draft_rt.layers for t in L.values()) / max(1, sum(_nbytes(t) for L in rt.layers for t in L.values()))
            hb = _nbytes(head if head is not None else draft_rt.head) / max(1, _nbytes(rt.head))
            self._draft_cache[key] = (lb * exit_layer / rt.num_layers, hb)
        lf, hf = self._draft_cache[key]
        return self.overhead + lf * self._interp(self.layers, rows) + hf * self._interp(self.head, rows)


def expected_gain(alpha: float, k: int) -> float:
    """E[N](alpha, k+1) - E[N](alpha, k): the (k+1)-th draft token is worth alpha^(k+1)."""
    return alpha ** (k + 1)


def plan(costs: BatchCosts, rt, seqs: list, caps: list[int], groups: list, prefill_rows: int, prefill_logits: int) -> list[int]:
    """Draft lengths k_i (0..caps[i]) maximising expected tokens per second of this step.
    groups[i]: None (free drafts) or the draft signature (draft_rt, exit, head, skips...) of sequence i.
    Each round grants the run of m >= 1 extra tokens to one sequence that raises the objective
    most (a run, not one token: a self-draft's first token pays a whole draft forward)."""
    n = len(seqs)
    k = [0] * n
    gain, rows, t_draft = float(n), prefill_rows + n, 0.0  # every sequence gets its verifier token
    per_group: dict = {}  # signature -> number of sequences drafting at each draft step j

    def t_verify(r: int) -> float:
        return costs.verify(r, r - prefill_rows + prefill_logits)

    def step_delta(g, j: int) -> float:
        steps = per_group.get(g, [])
        r = steps[j] if j < len(steps) else 0
        return costs.draft_step(rt, *g[:3], r + 1) - costs.draft_step(rt, *g[:3], r)

    value = gain / (t_draft + t_verify(rows))
    while True:
        best, best_v = None, value * 1.0001
        for i in range(n):
            dg, dt = 0.0, 0.0
            for m in range(1, caps[i] - k[i] + 1):
                j = k[i] + m - 1
                dg += expected_gain(seqs[i].alpha, j)
                dt += 0.0 if groups[i] is None else step_delta(groups[i], j)
                v = (gain + dg) / (t_draft + dt + t_verify(rows + m))
                if v > best_v:
                    best, best_v = (i, m, dg, dt), v
        if best is None:
            return k
        i, m, dg, dt = best
        if groups[i] is not None:
            steps = per_group.setdefault(groups[i], [])
            for j in range(k[i], k[i] + m):
                while len(steps) <= j:
                    steps.append(0)
                steps[j] += 1
        k[i] += m
        gain, rows, t_draft, value = gain + dg, rows + m, t_draft + dt, best_v
