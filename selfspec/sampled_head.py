"""Seeded sampling for the head's bytes of greedy: the Gumbel-max pick through the int8 screen.

With Gumbel-max coupling (coupling.py) a sampled token is an argmax too: of the score
s_v = fl(x_v + g_v), x_v = fl(l_v / T), over the row's support, first token on ties, where l is
what the head computes and g the noise of (key, pos, v). greedy_head.py bounds every logit from
the int8 copy; here those bounds carry through the score, because every step of it is monotone
(fp32 division by T > 0 and addition round to nearest):

    lo_v <= l_v <= up_v                  (kernels.screen_bounds: the greedy screen's bound, outward)
    thr  = max_v fl(fl(lo_v / T) + g_v)  <= max_v s_v
    cand = { v : fl(fl(up_v / T) + g_v) >= thr }   holds every v with s_v = max s
    (both in one pass, csrc/gumbel.c selfspec_gumbel_reach: noise only where a score can reach thr)
    the pick over cand's exact logits (the very chains of the head) = the pick over all V

A token outside cand has s_v <= fl(fl(up_v / T) + g_v) < thr <= max s: it can neither win nor
tie, so the token is the unscreened pick's, bit for bit (not a tolerance: a proof).
top-k and top-p (sampling.py: a threshold on x, decided over the exact x): the pick over the
support is t*, the pick over the whole row, whenever t* is in the support (it is the first maximum
over a superset). So: t* as above, over exact columns that also hold {up >= max lo} (the row's
maximum, so m = max x exactly), then from the bounds for the rest of the row (xu = fl(up / T)
>= x, xl = fl(lo / T) <= x; csrc/gumbel.c selfspec_nucleus_tail):
    top-k: fewer than k tokens can be strictly above x_t* (exact ones, plus xu > x_t* elsewhere);
    top-p: A = the mass strictly above x_t* <= sum over exact x > x_t* and over xu > x_t* of
           exp(. - m); Z >= sum of exact terms and of exp(xl - m) (terms under exp(-CUT) left out;
           top-k first: the k largest of those); t* is kept iff A < top_p Z as csrc/sampling.c
           sums them (fp32 exps, fp32 block sums, fp64 across), so A (1 + REL) < top_p Z (1 - REL)
           with REL above every rounding of both sides proves it.
Where the test fails (t* maybe outside: about the share 1 - top_p of rows, plus a margin band)
top-p picks over the nucleus itself: exact columns of the tokens of largest upper bound prove
which tokens are in it and which cannot matter (nucleus.py: nucleus_pick); where even that cannot tell (a
boundary exactly on a token, a nucleus wider than the columns) the full head decides.
Processed rows (processors.ProcessedRow: greedy or sampled, no logprobs recorded). Every processor
but min_p (logit_bias, the penalties, a grammar's -inf) maps each token's logit to a new value by
fp32 operations that depend on the token and that value alone and never decrease with it
(processors.Processing.edit), so applied to lo and up it gives bounds on the processed row, and
applied to the exact columns of some tokens, their processed values bit for bit (the same
operations on the same floats; a +100 bias or a penalty that lifts a token the raw screen would
leave out moves its bounds with it). min_p keeps x >= f = fl(max x + fl(ln min_p)) (one
expression, processors.min_p_floor): max x is exact from the columns of {up >= max lo}; then lo
is set to -inf where fl(lo / T) < f (only tokens surely kept give the threshold) and up where
fl(up / T) < f (surely dropped), and a candidate is kept by its exact x: the pick over the kept
set, which top-k / top-p then test as above over the min_p'd row (its Z: kept tokens only). When
{up >= max lo} is too large (a flat row) and no truncation needs max x, f is bounded by the
floors of max lo and max up and the row decided if no candidate falls between them. A grammar
that allows at most FEW tokens is decided from their exact columns alone (no screen; top-k then
exact too). Greedy processed rows: the argmax over {up >= max lo}, largest up first (HeadRow.argmax).
Not screened: rows that record logprobs or draw with the rejection coupling (full rows), rows
whose bounds are not finite, rows with more than CAP candidates (TRUNCATED_COLUMNS exact columns
when truncated or under min_p).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable

import torch

from selfspec import kernels
from selfspec.config import SamplingConfig
from selfspec.coupling import LazyRow, gumbel_token, pick_entries
from selfspec.greedy_head import ScreenedHead
from selfspec.nucleus import CUT, REL, best_pick, nucleus_pick
from selfspec.processors import min_p_floor
from selfspec.sampling import truncating
from selfspec.kernels.screen import act_residual, at_least, exact_columns, gumbel_reach, nucleus_tail, screen_bounds, screen_qgemm

ENABLED = os.environ.get("SELFSPEC_EXACT_PICKS") != "1"  # off: every sampled row is computed in full (benchmarks)
CAP = 4096  # candidates a row may have before the full head decides it
ROUND = 8  # candidates computed first (of largest upper score) when there are more
SCREEN_TRUNCATED = True  # top-k / top-p rows through the screen (off: the full head decides them)
TRUNCATED_COLUMNS = 1024  # exact columns a truncated row may take before the full head is cheaper
NUCLEUS_COLUMNS = (256, 768)  # exact columns tried, in turn, for a top-p nucleus the pick may fall outside
FEW = 512  # a grammar allowing at most this many tokens: their exact columns alone decide the row


class HeadRows:
    """The head's logits of the rows of x [R, H] (the head's input), made only where needed: a
    row's Gumbel-max pick through the screen (HeadRow.gumbel), else full(x) -> [R, V] fp32,
    the logits as the runtime computes them."""

    def __init__(self, x: torch.Tensor, screen: ScreenedHead, full: Callable[[torch.Tensor], torch.Tensor]):
        self.x, self.screen, self._make_full = x, screen, full
        self.shape = torch.Size((x.shape[0], screen.head.shape[1]))
        self._a = self._full = self._one = None  # _one: (i, row i's logits), the first row asked for alone
        self._given: set[int] = set()  # rows the screen left to the full head (counted in screen.pick_full)
        self._whole: bool | None = None  # the pass's picks through the full head instead (screen.costs), from its first pick

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, i: int) -> HeadRow:
        return HeadRow(self, i)

    def full(self) -> torch.Tensor:
        """Every row's logits [R, V] (fp32), as Runtime.logits computes them."""
        if self._full is None:
            t0 = time.perf_counter()
            self._full = self._make_full(self.x)
            self.screen.costs.saw_matmul(True, len(self), time.perf_counter() - t0)
        return self._full

    def whole(self, truncated: bool) -> bool:
        """Whether this pass's unprocessed picks read the full head (greedy_head.PassCosts), decided
        at its first pick and kept for its rows."""
        if self._whole is None:
            self._whole = self._a is None and self.screen.costs.whole(len(self), truncated)
        return self._whole

    def full_row(self, i: int) -> torch.Tensor:
        """Row i's logits [V] (fp32), full()[i] bit for bit (the head is row-invariant): the first
        row the screen leaves undecided is computed alone (a verify pass rarely has a second one:
        top-p's undecided rows are about the share 1 - top_p), the others together once a second
        one is asked for."""
        if i not in self._given:
            self._given.add(i)
            self.screen.pick_full += 1
        if self._full is not None:
            return self._full[i]
        if self._one is None:
            self._one = (i, self._make_full(self.x[i : i + 1])[0])
        return self._one[1] if self._one[0] == i else self.full()[i]

    def screened(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(a [R, V], xn, dxn [R]): the int8 head's values of every row (one read of it) and the
        bound's activation norms."""
        if self._a is None:
            t0 = time.perf_counter()
            a = screen_qgemm(self.x, self.screen.qhead)
            xn, dxn = act_residual(self.x, round_bf16=self.screen.pairs)
            self._a = (a, xn, dxn)
            self.screen.costs.saw_matmul(False, len(self), time.perf_counter() - t0)
        return self._a

    def exact(self, i: int, cols: torch.Tensor) -> torch.Tensor | None:
        """The logits of row i at columns cols [n] (int32 ascending), bit for bit the full row's;
        None if one is not finite (the full head decides then)."""
        if len(cols) == 0:
            return None
        vals = exact_columns(self.x[i : i + 1], self.screen.head, cols.view(1, -1), torch.tensor([len(cols)]))[0]
        self.screen.pick_computed += len(cols)
        return vals if bool(torch.isfinite(vals).all()) else None


class HeadRow(LazyRow):
    """Row i of HeadRows: what coupling.gumbel_token and processors.ProcessedRow read. `edit`: the
    row's processors (processors.ProcessedRow; None: none), module doc."""

    def __init__(self, rows: HeadRows, i: int):
        self.rows, self.i = rows, i

    def full(self) -> torch.Tensor:
        return self.rows.full_row(self.i)

    # ---- the pieces: bounds and exact values of the (processed) row ---------------------------

    def _bounds(self, edit) -> tuple[torch.Tensor, torch.Tensor, float] | None:
        """(lo, up, max lo): fp32 [V], lo <= z <= up for every token's (processed) logit z; None
        when the screen's bounds are not finite."""
        a, xn, dxn = self.rows.screened()
        bounds = screen_bounds(a[self.i], self.rows.screen.ab, float(xn[self.i]), float(dxn[self.i]),
                               self.rows.x.dtype == torch.bfloat16)
        if bounds is None or edit is None:
            return bounds
        lo, up, _ = bounds
        for b in (lo, up):  # monotone, token by token: bounds of the processed row
            edit.edit(b)
        return lo, up, float(lo.max())

    def _exact(self, ids: torch.Tensor, edit) -> torch.Tensor | None:
        """The (processed) logits at tokens ids [n] (ascending), bit for bit the full row's; None
        where a logit is not finite."""
        vals = self.rows.exact(self.i, ids.to(torch.int32))
        if vals is not None and edit is not None:
            edit.edit(vals, ids.long())
        return vals

    def _exact_with(self, ids: torch.Tensor, known: tuple[torch.Tensor, torch.Tensor], edit) -> torch.Tensor | None:
        """_exact(ids, edit), taking the values of the tokens in known = (ids', their _exact values;
        ascending) from it and computing only the others."""
        k_ids, k_vals = known
        ids = ids.to(k_ids.dtype)
        have = torch.isin(ids, k_ids)
        vals = torch.empty(len(ids), dtype=torch.float32)
        vals[have] = k_vals[torch.searchsorted(k_ids, ids[have])]
        if not bool(have.all()):
            rest = self._exact(ids[~have], edit)
            if rest is None:
                return None
            vals[~have] = rest
        return vals

    def _few(self, edit) -> torch.Tensor | None:
        """The tokens a grammar allows here when they are at most FEW (int32 ascending): their exact
        columns decide, with no screen. None otherwise."""
        allowed = None if edit is None else edit.allowed()
        if allowed is None or not 0 < int(allowed.sum()) <= FEW:
            return None
        return allowed.nonzero().flatten().to(torch.int32)

    # ---- greedy --------------------------------------------------------------------------------

    def argmax(self, edit=None) -> int | None:
        """The (processed) row's argmax, first index on ties, or None where the screen cannot
        decide it. Every token with up < max lo is strictly below the maximum; of the rest, those
        of largest up are computed first and prune the others (up < an exact value)."""
        ids, known = self._few(edit), None
        if ids is None:
            bounds = self._bounds(edit)
            if bounds is None:
                return None
            lo, up, lo_max = bounds
            ids = at_least(up, lo_max, CAP)
            if ids is None:
                return None
            ids = ids.long()
            if len(ids) > ROUND:
                first = up[ids].topk(ROUND).indices.sort().values
                vals = self._exact(ids[first], edit)
                if vals is None:
                    return None
                known = (ids[first], vals)
                ids = ids[up[ids] >= vals.max()]
        self.rows.screen.picks += 1
        self.rows.screen.pick_candidates += len(ids)
        vals = self._exact(ids, edit) if known is None else self._exact_with(ids, known, edit)
        if vals is None or not bool(vals.max() > float("-inf")):
            return None
        return int(ids[vals.argmax()])

    # ---- Gumbel-max ----------------------------------------------------------------------------

    def gumbel(self, cfg: SamplingConfig, key: int, pos: int, edit=None) -> int | None:
        """The token coupling.gumbel_token picks from the full (processed) row under cfg with the
        noise of (key, pos): through the screen (_screened_gumbel), or over the whole row where the
        pass reads the full head (HeadRows.whole); each way timed for the choice."""
        truncated = truncating(cfg, self.rows.shape[1])
        whole = edit is None and self.rows.whole(truncated)
        row = self.rows.full()[self.i] if whole else None
        if edit is None and not whole:
            self.rows.screened()  # the pass's matmul, timed apart from the row's pick
        t0 = time.perf_counter()
        token = gumbel_token(row, cfg, key, pos) if whole else self._screened_gumbel(cfg, key, pos, edit)
        if edit is None and token is not None:
            self.rows.screen.costs.saw_pick(whole, truncated, time.perf_counter() - t0)
        return token

    def _screened_gumbel(self, cfg: SamplingConfig, key: int, pos: int, edit) -> int | None:
        """The pick through the screen, or None where it cannot decide it (module doc)."""
        v = self.rows.shape[1]
        t = cfg.temperature
        top_k = cfg.top_k if cfg.top_k is not None and cfg.top_k < v else None
        top_p = cfg.top_p if cfg.top_p is not None and cfg.top_p < 1.0 else None
        truncated = top_k is not None or top_p is not None
        if truncated and not SCREEN_TRUNCATED:
            return None
        min_p = 0.0 if edit is None else edit.min_p
        few = self._few(edit)
        if few is not None:  # every token that can be in the support, exactly
            vals = self._exact(few, edit)
            if vals is None:
                return None
            self.rows.screen.picks += 1
            self.rows.screen.pick_candidates += len(few)
            tau = (min_p_floor((vals / t).max(), min_p),) * 2 if min_p else None
            return self._pick(few, vals, few, None, t, tau, top_k, top_p, key, pos)
        bounds = self._bounds(edit)
        if bounds is None:
            return None
        lo, up, lo_max = bounds
        self.rows.screen.picks += 1
        tau = top = None
        if min_p or truncated:
            top = at_least(up, lo_max, TRUNCATED_COLUMNS)  # holds the row's maximum
            if top is None:  # more than TRUNCATED_COLUMNS
                if truncated:
                    return None
                # min_p alone: its floor between those of max lo and of max up
        if top is not None:
            vt = self._exact(top, edit)
            if vt is None:
                return None
            lo[top.long()], up[top.long()] = vt, vt  # known exactly now
            if min_p:
                tau = (min_p_floor((vt / t).max(), min_p),) * 2  # the full row's: its max x is among top's
        elif min_p:
            tau = (min_p_floor(lo.max() / t, min_p), min_p_floor(up.max() / t, min_p))  # fp32 division is monotone
        if tau is not None:
            lo.masked_fill_(lo / t < tau[1], float("-inf"))  # lo: only tokens surely kept (x >= lo / T >= the floor)
            up.masked_fill_(up / t < tau[0], float("-inf"))  # up: tokens surely dropped are out
        if not truncated:
            return self._temperature(lo, up, t, tau, key, pos, edit)
        reach = gumbel_reach(lo, up, t, key, pos, CAP)
        if reach is None:
            return None
        cand = reach[0]
        ids = torch.unique(torch.cat([cand, top]))  # int32 ascending
        if len(ids) > TRUNCATED_COLUMNS:
            return None
        self.rows.screen.pick_candidates += len(ids)
        vals = self._exact_with(ids, (top, vt), edit)
        if vals is None:
            return None
        token = self._pick(ids, vals, cand, (lo, up), t, tau, top_k, top_p, key, pos)
        if token is None and top_k is None and tau is None:  # top-p: the pick may be outside the nucleus
            return self._nucleus(lo, up, lo_max, cand, reach[2], (ids, vals), t, top_p, key, pos, edit)
        return token

    def _nucleus(self, lo: torch.Tensor, up: torch.Tensor, lo_max: float, cand: torch.Tensor, thr: float,
                 known: tuple[torch.Tensor, torch.Tensor], t: float, top_p: float, key: int, pos: int, edit) -> int | None:
        """The top-p pick over the nucleus itself (the unrestricted pick may fall outside it), from
        exact columns of cand and of the NUCLEUS_COLUMNS tokens of largest upper bound, tried in
        turn (nucleus_pick; known: columns computed already); None where the bounds cannot prove it."""
        for k in NUCLEUS_COLUMNS:
            level = min(float(up.topk(min(k, len(up))).values[-1]), lo_max)  # <= max lo: E holds the row's maximum
            top = at_least(up, level, TRUNCATED_COLUMNS)
            if top is None:
                return None
            ids = torch.unique(torch.cat([top, cand]))
            vals = self._exact_with(ids, known, edit)
            if vals is None:
                return None
            known = (ids, vals)
            self.rows.screen.pick_candidates += len(ids)
            token = nucleus_pick(ids, vals, (lo, up), level, thr, t, top_p, key, pos)
            if token is not None:
                return token
        return None

    def _temperature(self, lo: torch.Tensor, up: torch.Tensor, temperature: float, tau: tuple | None, key: int,
                     pos: int, edit) -> int | None:
        """The untruncated pick over the support {x >= min_p's floor} (every finite token with tau
        None; tau: bounds on the floor, (lo, hi))."""
        reach = gumbel_reach(lo, up, temperature, key, pos, CAP)  # every token whose upper score reaches the best lower one
        if reach is None:
            return None
        cand, s_up, _ = reach
        self.rows.screen.pick_candidates += len(cand)
        ids, known = cand.long(), None
        if len(cand) > ROUND:  # round 1: the ROUND of largest upper score; their best exact score prunes the rest
            first = s_up.topk(ROUND).indices.sort().values
            vals = self._exact(ids[first], edit)
            if vals is None:
                return None
            known = (ids[first], vals)
            best = best_pick(_kept(vals, temperature, tau), temperature, ids[first], key, pos)
            if best is not None:  # (None: none of them surely in the support, nothing pruned)
                ids = ids[(s_up >= best[1]).nonzero().flatten()]  # holds every token that can reach the best: the winner
        vals = self._exact(ids, edit) if known is None else self._exact_with(ids, known, edit)
        if vals is None:
            return None
        if tau is not None and bool(((vals / temperature >= tau[0]) & (vals / temperature < tau[1])).any()):
            return None  # a candidate between the floor's bounds: kept or not, the bounds cannot tell
        vals = _kept(vals, temperature, tau)
        if not bool(vals.max() > float("-inf")):
            return None
        return int(ids[pick_entries(vals, ids, key, pos, temperature)])

    def _pick(self, ids: torch.Tensor, vals: torch.Tensor, cand: torch.Tensor, bounds: tuple[torch.Tensor, torch.Tensor] | None,
              t: float, tau: tuple | None, top_k: int | None, top_p: float | None, key: int, pos: int) -> int | None:
        """From the exact (processed) logits vals of tokens ids (int32 ascending), which hold cand
        (every token that can win) and the row's maximum, and bounds for the rest of the row (None:
        the rest is -inf): the pick over {x >= min_p's floor} (tau: the floor twice, exact) if it is
        surely inside the top-k / top-p support (module doc), else None."""
        vals = _kept(vals, t, tau)
        x = vals / t  # x = fl(l / T), as csrc/sampling.c divides
        if bounds is None and top_k is not None:  # every token known: the top-k set exactly (x >= the k-th largest x)
            if top_k < len(x):
                vals = vals.masked_fill(x < x.topk(top_k).values[-1], float("-inf"))
                x = vals / t
            top_k = None
        sub = torch.isin(ids, cand).nonzero().flatten()
        if not bool(vals[sub].max() > float("-inf")):
            return None
        j = int(sub[pick_entries(vals[sub], ids[sub].long(), key, pos, t)])
        token, xt, m = int(ids[j]), float(x[j]), float(x.max())
        if top_k is None and top_p is None:
            return token
        above = x > xt
        a_up, n_up = 0.0, 0
        if bounds is not None:
            a_up, n_up, _ = nucleus_tail(*bounds, t, xt, m, CUT, ids, want_z=False)  # the rest of the row, from its bounds
        if top_k is not None and int(above.sum()) + n_up >= top_k:  # maybe k tokens strictly above: maybe outside
            return None
        if top_p is None:
            return token
        e = (x.double() - m).exp()
        a_up += float(e[above].sum())  # >= the mass strictly above the pick (the normaliser's unit: exp(m))
        if top_k is None:
            z_lo = float(e[x >= m - CUT].sum())  # <= Z: the exact terms first, the rest only where they must
            if not a_up * (1 + REL) < top_p * z_lo * (1 - REL) and bounds is not None:
                z_lo += nucleus_tail(*bounds, t, xt, m, CUT, ids)[2]
        else:  # Z of the top-k set >= the sum of the k largest lower terms (the i-th largest x >= the i-th largest lower x)
            xl = x if bounds is None else (bounds[0] / t).index_put_((ids.long(),), x)
            d = xl.topk(min(top_k, len(xl))).values.double() - m
            z_lo = float(d[d >= -CUT].exp().sum())
        return token if a_up * (1 + REL) < top_p * z_lo * (1 - REL) else None


def _kept(vals: torch.Tensor, t: float, tau: tuple | None) -> torch.Tensor:
    """vals with -inf where min_p may drop the token (x = vals / T < the floor's upper bound tau[1],
    as processors.py compares)."""
    return vals if tau is None else vals.masked_fill(vals / t < tau[1], float("-inf"))


def head_rows(runtime, h: torch.Tensor, screen: ScreenedHead | None) -> HeadRows | torch.Tensor:
    """Runtime.forward's rows for Gumbel-max picks: HeadRows where the head is screened, else the
    logits [R, V] themselves."""
    if screen is None or not ENABLED or not math.prod(h.shape):
        return runtime.logits(h)
    x = kernels.norm_rows(h, runtime.final_norm, runtime.spec.rms_norm_eps)  # as Runtime.logits (no softcap: screened)
    return HeadRows(x, screen, lambda x: runtime._mm(x, screen.head).float())
