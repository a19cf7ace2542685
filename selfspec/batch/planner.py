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
to its group's draft forwards (timed per draft signature on first use: measure_draft). Decisions never change output (every draft is verified);
they are used for greedy decoding only (module sequence.py says why not when sampling).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

import numpy as np
import torch

from selfspec.cache import SegmentTable
from selfspec.predictor.costs import time_call

ROWS = (1, 2, 4, 8, 16, 32, 64, 128)


@dataclass
class BatchCosts:
    """Seconds of a batched pass at each total row count (ROWS; others interpolate)."""

    layers: dict[int, float]  # all layers over R rows (spread over several sequences)
    head: dict[int, float]  # final norm + LM head over R rows, argmax only (the planner plans greedy rows)
    overhead: float = 2e-4  # per forward call (Python, tables)
    _draft_cache: dict = field(default_factory=dict)
    _memo: dict = field(default_factory=dict)  # (what, rows...) -> seconds: the planner asks the same often

    @classmethod
    def measure(cls, rt, repeats: int = 2, context: int = 64) -> "BatchCosts":
        layers, head = {}, {}
        H, gen = rt.spec.hidden_size, torch.Generator().manual_seed(0)
        caches = [rt.new_cache(context + 2 * max(ROWS)) for _ in range(8)]
        with torch.inference_mode():
            for r in ROWS:
                table = _spread(caches, r, context)
                h = (torch.randn(r, H, generator=gen) * 0.1).to(rt.device, rt.dtype)
                layers[r] = time_call(lambda: rt.run_layers_batch(h, 0, rt.num_layers, table), repeats, statistics.median)
                head[r] = time_call(lambda: rt.argmax(h), repeats, statistics.median)
        return cls(_monotone(layers), _monotone(head))

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
        t = self._memo.get((rows, lr))
        if t is None:
            t = self._memo[(rows, lr)] = self.overhead + self._interp(self.layers, rows) + self._interp(self.head, lr)
        return t

    def draft_step(self, signature: tuple, rows: int) -> float:
        """One batched draft forward of `rows` sequences with this draft signature (draft
        runtime, exit layer, draft head, skip sets; batch.passes.signature), timed on first
        use at DRAFT_ROWS, the very calls draft_depth makes. Measured, not scaled by bytes:
        a quantized copy that reads half the bytes of bf16 is as dear per row once several
        rows make its kernel compute-bound (about 2 ms a row for the int8 copy of the
        default model on the 2-core reference machine, 4x the bytes-scaled estimate at 8 rows)."""
        if rows <= 0:
            return 0.0
        key = tuple(id(x) if not isinstance(x, (int, frozenset, tuple)) else x for x in signature)
        t = self._memo.get((key, rows))
        if t is None:
            if key not in self._draft_cache:
                self._draft_cache[key] = measure_draft(*signature)
            t = self._memo[(key, rows)] = self.overhead + self._interp(self._draft_cache[key], rows)
        return t


DRAFT_ROWS = (1, 2, 4, 8, 16, 32)


def measure_draft(draft_rt, exit_layer: int, head, skip_attn=frozenset(), skip_mlp=frozenset(),
                  repeats: int = 2, context: int = 64) -> dict[int, float]:
    """Seconds of one batched draft forward at each DRAFT_ROWS row count (one row per
    sequence, rows spread over up to 8 caches as passes.draft_depth spreads them)."""
    out = {}
    caches = [draft_rt.new_cache(context + max(DRAFT_ROWS)) for _ in range(8)]
    with torch.inference_mode():
        for r in DRAFT_ROWS:
            table = _spread(caches, r, context)
            toks = torch.arange(r, device=draft_rt.device) % max(1, draft_rt.spec.vocab_size)

            def fn():
                h = draft_rt.run_layers_batch(draft_rt.embed(toks), 0, exit_layer, table, skip_attn, skip_mlp)
                draft_rt.logits(h, head=head)

            out[r] = time_call(fn, repeats, statistics.median)
    return _monotone(out)


def _spread(caches: list, rows: int, context: int) -> SegmentTable:
    """`rows` rows over min(rows, len(caches)) sequences at position `context`, as a decoding
    batch has them."""
    n = min(rows, len(caches))
    sizes = [rows // n + (i < rows % n) for i in range(n)]
    return SegmentTable([(c, context, s) for c, s in zip(caches, sizes)])


def _monotone(table: dict[int, float]) -> dict[int, float]:
    """More rows never cost less (noise must not say otherwise)."""
    xs = sorted(table)
    for a, b in zip(xs, xs[1:]):
        table[b] = max(table[b], table[a])
    return table


def expected_gain(alpha: float, k: int) -> float:
    """E[N](alpha, k+1) - E[N](alpha, k): the (k+1)-th draft token is worth alpha^(k+1)."""
    return alpha ** (k + 1)


def plan(costs: BatchCosts, seqs: list, caps: list[int], groups: list, prefill_rows: int, prefill_logits: int) -> list[int]:
    """Draft lengths k_i (0..caps[i]) maximising expected tokens per second of this step."""
    return plan_with_probes(costs, seqs, caps, groups, prefill_rows, prefill_logits)[0]


def plan_with_probes(costs: BatchCosts, seqs: list, caps: list[int], groups: list, prefill_rows: int,
                     prefill_logits: int) -> tuple[list[int], list[bool]]:
    """(k, worth_probing): draft lengths k_i (0..caps[i]) maximising expected tokens per second
    of this step, and for each sequence whether one draft token would pay if it were surely
    accepted. A sequence kept at 0 only because rows are dear (a compute-bound step: a big
    batch, a prefill chunk riding along) has nothing to learn from a probe; one kept at 0 for
    its low acceptance does.
    groups[i]: None (free drafts) or the draft signature (draft_rt, exit, head, skips...) of sequence i.
    Each round grants the run of m >= 1 extra tokens to one sequence that raises the objective
    most (a run, not one token: a self-draft's first token pays a whole draft forward)."""
    n = len(seqs)
    k = [0] * n
    gain, rows, t_draft = float(n), prefill_rows + n, 0.0  # every sequence gets its verifier token
    per_group: dict = {}  # signature -> number of sequences drafting at each draft step j

    # The prefill chunk riding along is paid whatever is drafted: decoding is charged only
    # what its rows add to the pass. Charging the whole pass would make every draft token
    # look cheap next to it and the batch would draft hard exactly when rows are dearest
    # (measured: 16 sequences drafted ~30 tokens a step during prefill, then finished
    # unevenly and decoded the tail at low occupancy; 0.85x autoregressive).
    base = costs.verify(prefill_rows, prefill_logits) if prefill_rows else 0.0

    def t_verify(r: int) -> float:  # floored: a noisy flat table must not make decode rows free (or divide by 0)
        return max(costs.verify(r, r - prefill_rows + prefill_logits) - base, 1e-6)

    def step_delta(g, j: int) -> float:
        steps = per_group.get(g, [])
        r = steps[j] if j < len(steps) else 0
        return costs.draft_step(g, r + 1) - costs.draft_step(g, r)

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
            worth = [caps[i] > 0 and (gain + 1.0) / (t_draft + (0.0 if groups[i] is None else step_delta(groups[i], k[i]))
                                                      + t_verify(rows + 1)) > value * 1.0001 for i in range(n)]
            return k, worth
        i, m, dg, dt = best
        if groups[i] is not None:
            steps = per_group.setdefault(groups[i], [])
            for j in range(k[i], k[i] + m):
                while len(steps) <= j:
                    steps.append(0)
                steps[j] += 1
        k[i] += m
        gain, rows, t_draft, value = gain + dg, rows + m, t_draft + dt, best_v
