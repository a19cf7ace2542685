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
Where the test fails (t* maybe outside: about the share 1 - top_p of rows, plus a margin band;
a top-p boundary exactly on a token always) the full head decides. Not screened: processed rows
(penalties, min_p, bias, grammar: engine.py passes them as full rows), rows whose bounds are not
finite, and rows with more than CAP candidates (TRUNCATED_COLUMNS exact columns when truncated).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable

import torch

from selfspec import kernels
from selfspec.config import SamplingConfig
from selfspec.coupling import LazyRow, pick_entries
from selfspec.greedy_head import ScreenedHead
from selfspec.kernels.screen import act_residual, exact_columns, gumbel_reach, nucleus_tail, screen_bounds, screen_qgemm

ENABLED = os.environ.get("SELFSPEC_EXACT_PICKS") != "1"  # off: every sampled row is computed in full (benchmarks)
CAP = 4096  # candidates a row may have before the full head decides it
ROUND = 8  # candidates computed first (of largest upper score) when there are more
SCREEN_TRUNCATED = True  # top-k / top-p rows through the screen (off: the full head decides them)
TRUNCATED_COLUMNS = 1024  # exact columns a truncated row may take before the full head is cheaper
CUT = 20.0  # normaliser terms below exp(-CUT) of the largest are left out of its lower bound
REL = 2.0**-12  # relative margin > csrc/sampling.c's roundings of the masses (fp32 exps and block sums) and ours
_FLT_MAX = 3.4028234663852886e38


class HeadRows:
    """The head's logits of the rows of x [R, H] (the head's input), made only where needed: a
    row's Gumbel-max pick through the screen (HeadRow.gumbel), else full(x) -> [R, V] fp32,
    the logits as the runtime computes them."""

    def __init__(self, x: torch.Tensor, screen: ScreenedHead, full: Callable[[torch.Tensor], torch.Tensor]):
        self.x, self.screen, self._make_full = x, screen, full
        self.shape = torch.Size((x.shape[0], screen.head.shape[1]))
        self._a = self._full = None

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, i: int) -> HeadRow:
        return HeadRow(self, i)

    def full(self) -> torch.Tensor:
        """Every row's logits [R, V] (fp32), as Runtime.logits computes them."""
        if self._full is None:
            self._full = self._make_full(self.x)
            self.screen.pick_full += 1
        return self._full

    def screened(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(a [R, V], xn, dxn [R]): the int8 head's values of every row (one read of it) and the
        bound's activation norms."""
        if self._a is None:
            a = screen_qgemm(self.x, self.screen.qhead)
            xn, dxn = act_residual(self.x, round_bf16=self.screen.pairs)
            self._a = (a, xn, dxn)
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
    """Row i of HeadRows: what coupling.gumbel_token reads."""

    def __init__(self, rows: HeadRows, i: int):
        self.rows, self.i = rows, i

    def full(self) -> torch.Tensor:
        return self.rows.full()[self.i]

    def gumbel(self, cfg: SamplingConfig, key: int, pos: int) -> int | None:
        """The token coupling.gumbel_token picks from the full row under cfg with the noise of
        (key, pos), or None where the screen cannot decide it (module doc)."""
        v = self.rows.shape[1]
        top_k = cfg.top_k if cfg.top_k is not None and cfg.top_k < v else None
        top_p = cfg.top_p if cfg.top_p is not None and cfg.top_p < 1.0 else None
        if (top_k is not None or top_p is not None) and not SCREEN_TRUNCATED:
            return None
        a, xn, dxn = self.rows.screened()
        bounds = screen_bounds(a[self.i], self.rows.screen.ab, float(xn[self.i]), float(dxn[self.i]),
                               self.rows.x.dtype == torch.bfloat16)
        if bounds is None:
            return None
        self.rows.screen.picks += 1
        if top_k is None and top_p is None:
            return self._temperature(bounds, cfg.temperature, key, pos)
        return self._truncated(bounds, cfg.temperature, top_k, top_p, key, pos)

    def _temperature(self, bounds: tuple[torch.Tensor, torch.Tensor], temperature: float, key: int, pos: int) -> int | None:
        reach = gumbel_reach(*bounds, temperature, key, pos, CAP)  # every token whose upper score reaches the best lower one
        if reach is None:
            return None
        cand, s_up, _ = reach
        self.rows.screen.pick_candidates += len(cand)
        ids = cand.long()
        if len(cand) > ROUND:  # round 1: the ROUND of largest upper score; their best exact score prunes the rest
            first = s_up.topk(ROUND).indices.sort().values
            vals = self.rows.exact(self.i, cand[first])
            best = None if vals is None else _c_score(vals, temperature, ids[first], key, pos)
            if best is None:
                return None
            ids = ids[(s_up >= best).nonzero().flatten()]  # holds every token that can reach the best: the winner
        vals = self.rows.exact(self.i, ids.to(torch.int32))
        if vals is None:
            return None
        return int(ids[pick_entries(vals, ids, key, pos, temperature)])

    def _truncated(self, bounds: tuple[torch.Tensor, torch.Tensor], t: float, top_k: int | None, top_p: float | None,
                   key: int, pos: int) -> int | None:
        """The pick over the whole row (as _temperature) if it is surely inside the top-k / top-p
        support (module doc), else None."""
        lo, up = bounds
        reach = gumbel_reach(lo, up, t, key, pos, CAP)
        if reach is None:
            return None
        cand = reach[0]
        top = (up >= lo.max()).nonzero().flatten().to(torch.int32)  # holds the row's maximum: m exactly
        ids = torch.unique(torch.cat([cand, top]))  # int32 ascending
        if len(ids) > TRUNCATED_COLUMNS:
            return None
        self.rows.screen.pick_candidates += len(ids)
        vals = self.rows.exact(self.i, ids)
        if vals is None:
            return None
        x = vals / t  # x = fl(l / T), as csrc/sampling.c divides
        sub = torch.isin(ids, cand).nonzero().flatten()
        j = int(sub[pick_entries(vals[sub], ids[sub].long(), key, pos, t)])
        token, xt, m = int(ids[j]), float(x[j]), float(x.max())
        above = x > xt
        a_up, n_up, _ = nucleus_tail(lo, up, t, xt, m, CUT, ids, want_z=False)  # the rest of the row, from its bounds
        if top_k is not None and int(above.sum()) + n_up >= top_k:  # maybe k tokens strictly above: maybe outside
            return None
        if top_p is None:
            return token
        e = (x.double() - m).exp()
        a_up += float(e[above].sum())  # >= the mass strictly above the pick (the normaliser's unit: exp(m))
        if top_k is None:
            z_lo = float(e[x >= m - CUT].sum())  # <= Z: the exact terms first, the rest only where they must
            if not a_up * (1 + REL) < top_p * z_lo * (1 - REL):
                z_lo += nucleus_tail(lo, up, t, xt, m, CUT, ids)[2]
        else:  # Z of the top-k set >= the sum of the k largest lower terms (the i-th largest x >= the i-th largest lower x)
            xl = (lo / t).index_put_((ids.long(),), x)
            d = xl.topk(top_k).values.double() - m
            z_lo = float(d[d >= -CUT].exp().sum())
        return token if a_up * (1 + REL) < top_p * z_lo * (1 - REL) else None


def _c_score(xs: torch.Tensor, temperature: float, ids: torch.Tensor | None, key: int, pos: int) -> float | None:
    """The best score fl(fl(xs_j / T) + g) of xs [n] (entry j: token ids[j], or j), by csrc/gumbel.c's
    pick (its arithmetic); None if xs has no finite entry."""
    score = torch.empty(1, dtype=torch.float32)
    xs = xs.contiguous()
    j = kernels.sampling_functions()["pick"](xs.data_ptr(), len(xs), temperature, -_FLT_MAX,
                                             None if ids is None else ids.contiguous().data_ptr(), key, pos, score.data_ptr())
    return None if j < 0 else float(score)


def head_rows(runtime, h: torch.Tensor, screen: ScreenedHead | None) -> HeadRows | torch.Tensor:
    """Runtime.forward's rows for Gumbel-max picks: HeadRows where the head is screened, else the
    logits [R, V] themselves."""
    if screen is None or not ENABLED or not math.prod(h.shape):
        return runtime.logits(h)
    x = kernels.norm_rows(h, runtime.final_norm, runtime.spec.rms_norm_eps)  # as Runtime.logits (no softcap: screened)
    return HeadRows(x, screen, lambda x: runtime._mm(x, screen.head).float())
