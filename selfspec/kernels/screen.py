"""csrc/screen.c and quant.c's selfspec_act_residual: the pieces of the int8-screened exact
greedy head (selfspec/greedy_head.py explains the bound)."""

from __future__ import annotations

import ctypes

import torch

from selfspec.kernels import build
from selfspec.kernels import pool as _pool
from selfspec.kernels.weights import PackedWeight, QuantizedWeight


def _dll():
    if not build.available():
        raise RuntimeError(f"the kernels are not available ({build.load_error() or 'disabled'})")
    return build._blocks["dll"]


def screen_qgemm(x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    """The screen's values a = x @ w for the int8 copy w, fp32 [M, N] whatever x's dtype
    (csrc/screen.c: quant.c's int8 matmul)."""
    x = x.contiguous()
    y = torch.empty(x.shape[0], w.out_features, dtype=torch.float32)
    rc = _dll().selfspec_screen_qgemm(x.shape[0], x.data_ptr(), x.dtype == torch.bfloat16, ctypes.addressof(w.desc), y.data_ptr(),
                                      _pool.threads())
    if rc:
        raise RuntimeError(f"kernels.screen_qgemm: returned {rc}")
    return y


def quant_block() -> int:
    """quant.c's activation block QB (k per int8 block of the screen's matmul)."""
    return int(_dll().selfspec_quant_block())


def act_residual(x: torch.Tensor, round_bf16: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (bf16/fp32) -> (||x'||, ||x' - xhat||) per row, float64 [M] (x' = x, or x rounded
    to bf16; xhat the activations screen_qgemm multiplies)."""
    x = x.contiguous()
    m, k = x.shape
    xn, dxn = torch.empty(m, dtype=torch.float64), torch.empty(m, dtype=torch.float64)
    rc = _dll().selfspec_act_residual(m, k, x.data_ptr(), x.dtype == torch.bfloat16, int(round_bf16),
                                                   xn.data_ptr(), dxn.data_ptr())
    if rc:
        raise RuntimeError(f"kernels.act_residual: returned {rc}")
    return xn, dxn


def screen_candidates(a: torch.Tensor, ab: torch.Tensor, xn: torch.Tensor, dxn: torch.Tensor, cap: int,
                      round_out: bool, threads: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """a [M, V] fp32, ab [2, V] fp32 (alpha, beta), xn / dxn float64 [M] -> (cand int32 [M, cap],
    count int64 [M]): count > cap means too many candidates, -1 a row that cannot be screened.
    round_out: the head's logits are rounded to bf16 (its input is bf16)."""
    a, ab = a.contiguous(), ab.contiguous()
    m, v = a.shape
    cand = torch.empty(m, cap, dtype=torch.int32)
    count = torch.empty(m, dtype=torch.int64)
    nt = _pool.threads() if threads is None else threads
    rc = _dll().selfspec_screen_candidates(m, v, a.data_ptr(), ab.data_ptr(), xn.data_ptr(), dxn.data_ptr(),
                                                        int(round_out), cand.data_ptr(), cap, count.data_ptr(), nt)
    if rc:
        raise RuntimeError(f"kernels.screen_candidates: returned {rc}")
    return cand, count


def exact_columns(x: torch.Tensor, w: PackedWeight | torch.Tensor, cand: torch.Tensor, count: torch.Tensor,
                  threads: int | None = None) -> torch.Tensor:
    """The logits matmul(x, w).float() has at the candidate columns, bit for bit: x [M, K]
    (bf16/fp32; bf16 x gives bf16-rounded values, as matmul does), w the head (plain [K, N] or
    packed), cand/count from screen_candidates -> fp32 [M, cap] (entries past a row's count, or
    of rows not screened, undefined)."""
    xf = x.float().contiguous()
    m, k = xf.shape
    packed = isinstance(w, PackedWeight)
    data = (w.data if packed else w).contiguous()
    layout = 2 if packed and w.pairs else int(packed)
    n = w.shape[1]
    cap = cand.shape[1]
    out = torch.empty(m, cap, dtype=torch.float32)
    nt = _pool.threads() if threads is None else threads
    rc = _dll().selfspec_exact_columns(m, k, n, xf.data_ptr(), data.data_ptr(), data.dtype == torch.bfloat16,
                                                    layout, int(x.dtype == torch.bfloat16), cand.data_ptr(), count.data_ptr(), cap, out.data_ptr(), nt)
    if rc:
        raise RuntimeError(f"kernels.exact_columns: returned {rc}")
    return out


def screen_pick(x: torch.Tensor, w: PackedWeight | torch.Tensor, cand: torch.Tensor, count: torch.Tensor,
                a: torch.Tensor, ab: torch.Tensor, xn: torch.Tensor, dxn: torch.Tensor,
                threads: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The full head's argmax of each row from its candidates (screen_candidates of a, ab, xn,
    dxn), computing exactly only those that can still reach the best of the SC_GROUP largest
    (csrc/screen.c explains why nothing else can win or tie). -> (best int64 [M]: the column,
    -1 where the screen cannot decide; computed int64 [M]: columns computed exactly)."""
    xf = x.float().contiguous()
    m, k = xf.shape
    packed = isinstance(w, PackedWeight)
    data = (w.data if packed else w).contiguous()
    layout = 2 if packed and w.pairs else int(packed)
    best, computed = torch.empty(m, dtype=torch.int64), torch.empty(m, dtype=torch.int64)
    nt = _pool.threads() if threads is None else threads
    rc = _dll().selfspec_screen_pick(m, k, w.shape[1], xf.data_ptr(), data.data_ptr(), data.dtype == torch.bfloat16, layout,
                                     int(x.dtype == torch.bfloat16), cand.data_ptr(), count.data_ptr(), cand.shape[1],
                                     a.data_ptr(), ab.data_ptr(), xn.data_ptr(), dxn.data_ptr(), best.data_ptr(),
                                     computed.data_ptr(), nt)
    if rc:
        raise RuntimeError(f"kernels.screen_pick: returned {rc}")
    return best, computed


def screen_quantize(w: PackedWeight | torch.Tensor, g_k: float, g_b: float) -> tuple[QuantizedWeight, torch.Tensor] | None:
    """The screen's int8 copy of a head w [K, N] (plain or packed, bf16/fp32) with its bound
    coefficients ab [2, N] (csrc/screen.c selfspec_screen_quantize); None if a weight is not
    finite."""
    packed = isinstance(w, PackedWeight)
    data = (w.data if packed else w).contiguous()
    layout = 2 if packed and w.pairs else int(packed)
    k, n = w.shape
    q = torch.empty((n + 63) // 64, (k + 3) // 4, 64, 4, dtype=torch.uint8)
    scale, ab = torch.empty(n, dtype=torch.float32), torch.empty(2, n, dtype=torch.float32)
    rc = _dll().selfspec_screen_quantize(k, n, data.data_ptr(), data.dtype == torch.bfloat16, layout, g_k, g_b,
                                                      q.data_ptr(), scale.data_ptr(), ab.data_ptr(), _pool.threads())
    if rc == 3:
        return None
    if rc:
        raise RuntimeError(f"kernels.screen_quantize: returned {rc}")
    return QuantizedWeight(q, scale, None, k, n, bits=8), ab


def screen_bounds(a: torch.Tensor, ab: torch.Tensor, xn: float, dxn: float, round_out: bool,
                  threads: int | None = None) -> tuple[torch.Tensor, torch.Tensor, float] | None:
    """One row's interval bounds on the head's logits: a [V] fp32 (screen_qgemm's row), ab [2, V]
    (alpha, beta), xn / dxn its act_residual -> (lo, up, max lo): fp32 [V] with lo <= logit <= up
    for every column (bf16-rounded logits when round_out), and lo's largest entry; None when a
    bound is not finite."""
    a, ab = a.contiguous(), ab.contiguous()
    v = a.shape[0]
    lo, up = torch.empty(v, dtype=torch.float32), torch.empty(v, dtype=torch.float32)
    lo_max = ctypes.c_float()
    rc = _dll().selfspec_screen_bounds(v, a.data_ptr(), ab.data_ptr(), xn, dxn, int(round_out), lo.data_ptr(), up.data_ptr(),
                                       ctypes.byref(lo_max), _pool.threads() if threads is None else threads)
    return None if rc else (lo, up, lo_max.value)


def at_least(x: torch.Tensor, thr: float, cap: int, threads: int | None = None) -> torch.Tensor | None:
    """The entries of x [V] fp32 with x >= thr, int32 ascending ((x >= thr).nonzero(), one
    pass on the pool's threads); None when there are more than cap."""
    x = x.contiguous()
    nt = _pool.threads() if threads is None else threads
    dll = _dll()
    out = torch.empty(dll.selfspec_at_least_space(cap, nt), dtype=torch.int32)
    n = dll.selfspec_at_least(x.data_ptr(), len(x), thr, out.data_ptr(), cap, nt)
    return None if n > cap else out[:n]


def gumbel_reach(lo: torch.Tensor, up: torch.Tensor, temperature: float, key: int, pos: int, cap: int,
                 threads: int | None = None) -> tuple[torch.Tensor, torch.Tensor, float] | None:
    """The screened Gumbel-max pick's candidates from bounds lo <= logits <= up ([V] fp32; entry j
    is token j; csrc/gumbel.c selfspec_gumbel_reach): (entries int32 ascending, their upper
    scores fl(fl(up / T) + g) fp32, thr = the best lower score); every entry whose upper score
    reaches thr is there. None when there are more than cap, or lo has no finite entry."""
    out, us, thr = torch.empty(cap, dtype=torch.int32), torch.empty(cap, dtype=torch.float32), torch.empty(1, dtype=torch.float32)
    n = _dll().selfspec_gumbel_reach(lo.data_ptr(), up.data_ptr(), lo.shape[0], temperature, key, pos, out.data_ptr(),
                                     us.data_ptr(), cap, thr.data_ptr(), _pool.threads() if threads is None else threads)
    if n == -2:
        raise MemoryError("kernels.gumbel_reach: out of memory")
    return None if n < 0 or n > cap else (out[:n], us[:n], float(thr))


def nucleus_tail(lo: torch.Tensor, up: torch.Tensor, temperature: float, xt: float, m: float, cut: float,
                 skip: torch.Tensor, want_z: bool = True) -> tuple[float, int, float]:
    """Over the entries of bounds lo <= logits <= up ([V] fp32) outside skip (int32 ascending), with
    xu = fl(up / T), xl = fl(lo / T) (csrc/gumbel.c selfspec_nucleus_tail): (an upper bound of
    the sum of exp(xu - m) over xu > xt, how many, a lower bound of the sum of exp(xl - m) over
    xl >= m - cut; 0 unless want_z), fp64."""
    fn = _dll().selfspec_nucleus_tail
    if fn.argtypes is None:
        fn.restype = None
        fn.argtypes = ([ctypes.c_void_p] * 2 + [ctypes.c_long] + [ctypes.c_float] * 4
                       + [ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_void_p])
    skip = skip.contiguous()
    out = (ctypes.c_double * 3)()
    fn(lo.data_ptr(), up.data_ptr(), lo.shape[0], temperature, xt, m, cut, skip.data_ptr(), len(skip), int(want_z), out)
    return out[0], int(out[1]), out[2]


def exp_bound(y: torch.Tensor) -> torch.Tensor:
    """csrc/gumbel.c's exp_bound_v of y [n] fp32 (tests)."""
    y = y.float().contiguous()
    out = torch.empty_like(y)
    fn = _dll().selfspec_exp_bound
    fn.restype, fn.argtypes = None, [ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p]
    fn(y.data_ptr(), len(y), out.data_ptr())
    return out
