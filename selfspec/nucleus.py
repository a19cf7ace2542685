"""The top-p nucleus of a row known by bounds and some exact columns (sampled_head.py's screened
picks): which tokens are surely in it, surely out of it or unsure, and the Gumbel-max pick over it
when the bounds prove it (nucleus_pick; sampled_head.py's module doc states the screen's bounds)."""

from __future__ import annotations

import torch

from selfspec import kernels
from selfspec.coupling import pick_entries
from selfspec.kernels.screen import nucleus_tail

CUT = 20.0  # normaliser terms below exp(-CUT) of the largest are left out of its lower bound
REL = 2.0**-12  # relative margin > csrc/sampling.c's roundings of the masses (fp32 exps and block sums) and ours
_FLT_MAX = 3.4028234663852886e38


def nucleus_pick(ids: torch.Tensor, vals: torch.Tensor, bounds: tuple[torch.Tensor, torch.Tensor], level: float, thr: float,
                 t: float, top_p: float, key: int, pos: int) -> int | None:
    """The Gumbel-max pick over the top-p nucleus N = {j : A_j < top_p Z} (A_j: the mass strictly
    above x_j), or None where the bounds cannot prove it. vals: the exact (processed) logits of
    E = ids (int32 ascending), which holds {up >= level} (level <= max lo: the row's maximum m is
    in E) and every token whose upper score reaches thr (gumbel_reach's); bounds (lo, up) elsewhere.
    Outside E, x_j <= xL = fl(level / T), so with R_up >= sum of exp(x_j - m) there >= R_lo
    (nucleus_tail) and Z_E, A_i^E the exact sums over E:
      Z in [Z_E + R_lo, Z_E + R_up];  i in E: A_i in [A_i^E, A_i^E + (R_up where x_i < xL, else 0)];
    i is surely in (A_i's upper end < top_p Z's lower), surely out (lower >= upper), or unsure,
    each side widened by REL as in _pick. The pick over the surely-in tokens is the pick over N
    when no unsure token would beat it (the pick over both is the same token) and no token outside
    E could: their scores are below thr, and thr <= its score; or they are surely out (the mass of
    E above xL >= top_p Z already)."""
    x = vals / t
    finite = x > float("-inf")
    if not bool(finite.any()):
        return None
    m = float(x.max())
    e = (x.double() - m).exp()  # 0 where x is -inf
    xl = float(torch.tensor(level, dtype=torch.float32) / t)
    r_up, _, r_lo = nucleus_tail(*bounds, t, float("-inf"), m, CUT, ids)
    z_lo, z_up = float(e.sum()) + r_lo, float(e.sum()) + r_up
    xs, order = x.sort(descending=True, stable=True)
    excl = e[order].cumsum(0) - e[order]  # the mass before each entry in that order
    a = torch.empty_like(e)
    a[order] = excl[torch.searchsorted(-xs, -xs, side="left")]  # ties: the mass strictly above
    keep = ((a + (x < xl).double() * r_up) * (1 + REL) < top_p * z_lo * (1 - REL)) & finite
    unsure = ~keep & finite & ~(a * (1 - REL) >= top_p * z_up * (1 + REL))
    if not bool(keep.any()):
        return None
    j = keep.nonzero().flatten()
    best = best_pick(vals[j], t, ids[j].long(), key, pos)
    if best is None:
        return None
    token = int(ids[j[best[0]]])
    if not best[1] >= thr and not float(e[x > xl].sum()) * (1 - REL) >= top_p * z_up * (1 + REL):
        return None  # a token outside E may be in the nucleus and win
    if bool(unsure.any()):
        j = (keep | unsure).nonzero().flatten()
        if int(ids[j[pick_entries(vals[j], ids[j].long(), key, pos, t)]]) != token:
            return None  # an unsure token would win if it is in
    return token


def best_pick(xs: torch.Tensor, temperature: float, ids: torch.Tensor | None, key: int, pos: int) -> tuple[int, float] | None:
    """(j, score): the pick of xs [n] (entry j: token ids[j], or j; pick_entries' entry) and its score
    fl(fl(xs_j / T) + g), by csrc/gumbel.c's pick (its arithmetic); None if xs has no finite entry."""
    score = torch.empty(1, dtype=torch.float32)
    xs = xs.contiguous()
    j = kernels.sampling_functions()["pick"](xs.data_ptr(), len(xs), temperature, -_FLT_MAX,
                                             None if ids is None else ids.contiguous().data_ptr(), key, pos, score.data_ptr())
    return None if j < 0 else (j, float(score))
