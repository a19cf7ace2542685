"""The exact greedy argmax of the LM head for half its bytes: an int8 copy screens, exact chains decide.

Greedy decoding (and greedy verification) needs only argmax_v l[v] of each row, where l is what
the bf16 (or fp32) head computes (csrc/gemm.c's chain). Reading that head is most of a decode
step on a small model (Gemma 3 270M: 335 MB of its 536 MB). So:

    a[v] = the int8 head's value (csrc/quant.c, activations quantized too)  -- half the bytes
    |l[v] - a[v]| <= E[v] = ||x'|| alpha[v] + ||x' - xhat|| beta[v]        -- for every v, proven
    candidates = { v : a[v] + E[v] >= max_u (a[u] - E[u]) }                -- holds every maximum
    b          = max of l over the 8 candidates of largest a  (the very chains of gemm.c)
    argmax     = over l of the candidates with a[v] + E[v] >= b, first index on ties

The bound is Cauchy-Schwarz on w.x' - what.xhat = (w - what).x' + what.(x' - xhat) plus the
rounding of both fp32 chains (csrc/screen.c has the derivation). Every column that can be the
maximum, ties included, is a candidate; b is a value some column has, so a candidate with
a[v] + E[v] < b is strictly below the maximum too (bf16 outputs: the same two-step slack).
So the argmax of the computed columns, first index on ties, is the argmax of the full head,
token for token: greedy output does not change, only its cost (on the default model's
decode states ~20-100 candidates a row, of which ~6-20 are computed, each a column of 1280
bytes spread over 320 cache lines; a row with more than CAP candidates, or with non-finite
values, is computed by the full head instead).

It gives argmax ids only (Runtime.argmax). Seeded (Gumbel-max) sampling is an argmax too and
reads the same int8 copy through sampled_head.py, top-k, top-p and the logits processors included,
and so do greedy rows with processors (sampled_head.HeadRow.argmax); what reads whole
distributions (logprobs, rejection sampling) uses the full head.
"""

from __future__ import annotations

import os
import threading

import torch

from selfspec import kernels
from selfspec.kernels.screen import (act_residual, exact_columns, quant_block, screen_candidates, screen_pick, screen_qgemm,
                                     screen_quantize)

CAP = 4096  # candidates a row may have before it is computed in full
MIN_WEIGHTS = 1 << 22  # smaller heads stay in cache, where the screen's fixed costs outweigh the bytes saved
_U = 2.0**-24  # fp32 unit roundoff


def _gamma(n: int) -> float:
    """gamma_n = n u / (1 - n u): the relative error bound of an n-term fp32 chain."""
    return n * _U / (1 - n * _U)


class ScreenedHead:
    """The int8 copy of a head (0.5x its bf16 bytes) and the per-column bound coefficients."""

    def __init__(self, head, qhead: kernels.QuantizedWeight, ab: torch.Tensor):
        self.head, self.qhead, self.ab = head, qhead, ab  # ab [2, V] fp32: alpha, beta (rounded up)
        self.pairs = isinstance(head, kernels.PackedWeight) and head.pairs
        self.rows = self.candidates = self.computed = self.full_rows = 0  # counters: what screening did (computed: exactly)
        self.picks = self.pick_candidates = self.pick_computed = self.pick_full = 0  # the same for sampled_head.py's picks
        self.costs = PassCosts()  # which way a several-row pass of seeded picks is cheaper here (sampled_head.HeadRows.whole)

    @classmethod
    def make(cls, head) -> ScreenedHead | None:
        """From a runtime's head (plain [K, V] or packed, bf16 or fp32): its absmax int8 copy and
        bound coefficients in one pass (csrc/screen.c); None if its weights are not all finite
        (the bound needs them to be)."""
        k = head.shape[0]
        nblk = -(-k // quant_block())  # the int8 chain sums one term per activation block
        made = screen_quantize(head, _gamma(k), _gamma(nblk + 2))  # the exact chain; the int8 chain (blocks + scale)
        return None if made is None else cls(head, *made)

    @property
    def nbytes(self) -> int:
        return self.qhead.nbytes + self.ab.numel() * 4

    def screen(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [M, K]: the head's input (after the final norm). -> (cand int32 [M, CAP], count
        int64 [M], vals fp32 [M, CAP]): row m's candidate columns in increasing order (the first
        count[m] entries) and their exact logits; count[m] outside 1..CAP: a row the screen
        cannot decide (too many candidates, or non-finite inputs)."""
        a = screen_qgemm(x, self.qhead)  # [M, V]
        xn, dxn = act_residual(x, round_bf16=self.pairs)
        cand, count = screen_candidates(a, self.ab, xn, dxn, CAP, round_out=x.dtype == torch.bfloat16)
        return cand, count, exact_columns(x, self.head, cand, count)

    def argmax(self, x: torch.Tensor, full) -> list[int]:
        """The full head's argmax of each row of x [M, K] (first index on ties), from the
        candidates alone: every other column is strictly below the row's maximum (module doc);
        of the candidates, only those that can still reach the best of the few with the largest
        int8 values are computed (kernels.screen_pick). full(rows) -> the full head's logits of
        those rows, for rows the screen cannot decide."""
        a = screen_qgemm(x, self.qhead)  # [M, V]
        xn, dxn = act_residual(x, round_bf16=self.pairs)
        cand, count = screen_candidates(a, self.ab, xn, dxn, CAP, round_out=x.dtype == torch.bfloat16)
        best, computed = screen_pick(x, self.head, cand, count, a, self.ab, xn, dxn)
        bad = (best < 0).nonzero().flatten()
        if len(bad):
            best[bad] = full(bad).argmax(-1)
        self.rows += x.shape[0]
        self.candidates += int(count.clamp(0, CAP).sum())
        self.computed += int(computed.sum())
        self.full_rows += len(bad)
        return best.tolist()


class PassCosts:
    """Which way a verify pass's seeded picks are cheaper on this machine, learnt from the passes
    themselves: through the screen (its int8 matmul over the pass's rows, then each row's screened
    pick, sampled_head.HeadRow.gumbel) or through the full head (one matmul of all the rows, then
    each row's pick over its whole row). Either way a row's pick is the same token (sampled_head.py
    proves the screened one exact), so the choice changes time only; which side wins depends on the
    CPU (where bf16 pairs make several rows of the full head cost about one row's bytes) and on the
    truncation (a top-p row's screened pick also proves its nucleus). Each cost is an exponentially
    weighted average of what was observed (per row count and per kind of pick); a side never
    observed at a row count is tried once. One-row passes (autoregressive decoding) always read the
    screen: half the head's bytes."""

    DECAY = 0.8  # weight of the past in each average
    MARGIN = 0.85  # the full head is taken only where predicted at most this share of the screen's cost

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self.matmul_s: dict[tuple[bool, int], float] = {}  # (full head?, rows) -> seconds of the pass's matmul
        self.pick_s: dict[tuple[bool, bool], float] = {}  # (full head?, truncated?) -> seconds of one row's pick

    def _saw(self, table: dict, key, seconds: float) -> None:
        old = table.get(key)
        table[key] = seconds if old is None else self.DECAY * old + (1 - self.DECAY) * seconds

    def saw_matmul(self, full: bool, rows: int, seconds: float) -> None:
        self._saw(self.matmul_s, (full, rows), seconds)

    def saw_pick(self, full: bool, truncated: bool, seconds: float) -> None:
        self._saw(self.pick_s, (full, truncated), seconds)

    def whole(self, rows: int, truncated: bool) -> bool:
        """Whether a pass of `rows` rows of picks (truncated: top-k / top-p) should read the full head."""
        if not self.enabled or rows < 2:
            return False
        screen = [self.matmul_s.get((False, rows)), self.pick_s.get((False, truncated))]
        full = [self.matmul_s.get((True, rows)), self.pick_s.get((True, truncated))]
        if None in screen:
            return False  # the screen first: the usual side
        if None in full:
            return True  # tried once
        return full[0] + rows * full[1] < self.MARGIN * (screen[0] + rows * screen[1])


_lock = threading.Lock()
_UNMADE = object()


def screened_head(runtime) -> ScreenedHead | None:
    """The runtime's screened head, made on first use (None where it does not apply: no kernels,
    a soft-capped head, a head under MIN_WEIGHTS, non-finite weights, or SELFSPEC_EXACT_HEAD=1)."""
    made = getattr(runtime, "_screened", _UNMADE)  # every greedy head call asks: no lock once made
    if made is not _UNMADE:
        return made
    with _lock:
        if not hasattr(runtime, "_screened"):
            k, v = runtime.head.shape
            ok = (runtime.uses_kernels and not runtime.spec.final_logit_softcap and k * v >= MIN_WEIGHTS
                  and os.environ.get("SELFSPEC_EXACT_HEAD") != "1")
            runtime._screened = ScreenedHead.make(runtime.head) if ok else None
        return runtime._screened
