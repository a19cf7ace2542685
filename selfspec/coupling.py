"""Gumbel-max coupling: a seed is one text (SamplingConfig.coupling "gumbel", the default).

Daliri, Musco, Suresh 2024, "Coupling without communication and drafter-invariant speculative
decoding". A token is not drawn with a uniform from a generator but picked as

    argmax_t (x_t + g(key, pos, t))   over the row's support (sampling.py's transform: x = logits / T)

with g standard Gumbel noise keyed by the generation's key (its seed), the absolute position
the token takes and its id. That is exactly a draw from p (the argmax of log p_t + g_t, and x_t
differs from log p_t by a constant), and a draft made with the same noise over its own
distribution is the target's pick iff it is accepted (verification.coupled_accept): the text
depends on the key and the target alone, not on the draft, the threads or the batch.

The noise (csrc/gumbel.c is the definition; gumbel_noise_torch spells out the same bits):
Philox4x32-10 of the counter (t / 4, pos lo, pos hi, NOISE_DOMAIN) under the key (seed lo, seed
hi), word t % 4; then w = (b + 1/2) 2^-32, E = -log(1 - w), g = -log(E) in fp32 without fused
multiply-adds. One row's pick is exact and cheap on a whole vocabulary (csrc/gumbel.c screens:
only tokens that can still win get noise, and logarithms only where their bits leave a chance).
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence

import numpy as np
import torch

from selfspec import kernels
from selfspec.config import SamplingConfig
from selfspec.errors import SelfSpecError
from selfspec.sampling import DenseProbs, Dist, Explicit, PointMass, Softmax, SubVocab, c_ready, truncating, distribution

_FLT_MAX = float(np.finfo(np.float32).max)
_M32 = 0xFFFFFFFF
_PHILOX_M = (0xD2511F53, 0xCD9E8D57)
_PHILOX_W = (0x9E3779B9, 0xBB67AE85)
NOISE_DOMAIN = 0x47756D62  # counter word 3 of the Gumbel noise's Philox counters


def noise_key(sampling: SamplingConfig) -> int | None:
    """The key of a generation's Gumbel noise: its seed (mod 2^64), or 64 fresh random bits
    when it has none; None when it draws from a torch.Generator instead (greedy, or the
    rejection coupling)."""
    if not sampling.gumbel:
        return None
    return secrets.randbits(64) if sampling.seed is None else sampling.seed % (1 << 64)


def gumbel_noise(key: int, pos: int, tokens: torch.Tensor) -> torch.Tensor:
    """g(key, pos, t) for token ids [n] (int64): fp32 [n], on tokens' device (module doc)."""
    tokens = tokens.long()
    if not c_ready(tokens):
        return gumbel_noise_torch(key, pos, tokens)
    tokens = tokens.contiguous()
    g = torch.empty(len(tokens), dtype=torch.float32)
    kernels.sampling_functions()["noise"](key, pos, tokens.data_ptr(), len(tokens), g.data_ptr())
    return g


def _mulhilo(m: int, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(hi, lo) 32-bit words of m * c, c [n] int64 in [0, 2^32): in 16-bit halves, so no
    intermediate leaves int64."""
    a, b = m * (c & 0xFFFF), m * (c >> 16)  # < 2^48 each
    s = a + ((b & 0xFFFF) << 16)
    return (b >> 16) + (s >> 32), s & _M32


def philox4x32(ctr: list[torch.Tensor], key: tuple[int, int]) -> list[torch.Tensor]:
    """Philox4x32-10 of counters (4 int64 tensors of 32-bit words) under key (two words)."""
    c0, c1, c2, c3 = ctr
    k0, k1 = key
    for _ in range(10):
        hi0, lo0 = _mulhilo(_PHILOX_M[0], c0)
        hi1, lo1 = _mulhilo(_PHILOX_M[1], c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0, k1 = (k0 + _PHILOX_W[0]) & _M32, (k1 + _PHILOX_W[1]) & _M32
    return [c0, c1, c2, c3]


def _log32(y: torch.Tensor) -> torch.Tensor:
    """csrc/gumbel.c's log_v, operation for operation (Cephes logf; fp32, y normal > 0)."""
    f32 = lambda v: torch.tensor(v, dtype=torch.float32, device=y.device)  # noqa: E731
    bits = y.view(torch.int32)
    e = ((bits >> 23) & 0xFF) - 126
    m = ((bits & 0x007FFFFF) | 0x3F000000).view(torch.float32)
    low = m < f32(0.707106781186547524)
    f = torch.where(low, (m + m) - f32(1.0), m - f32(1.0))
    fe = (e - low.int()).float()
    z = f * f
    p = f32(7.0376836292e-2)
    for c in (-1.1514610310e-1, 1.1676998740e-1, -1.2420140846e-1, 1.4249322787e-1, -1.6668057665e-1,
              2.0000714765e-1, -2.4999993993e-1, 3.3333331174e-1):
        p = p * f + f32(c)
    p = p * f * z
    p = p + fe * f32(-2.12194440e-4)
    p = p + f32(-0.5) * z
    return (f + p) + fe * f32(0.693359375)


def gumbel_noise_torch(key: int, pos: int, tokens: torch.Tensor) -> torch.Tensor:
    """gumbel_noise in torch operations (any device): the same bits as csrc/gumbel.c."""
    t = tokens.long()
    f32 = lambda v: torch.tensor(v, dtype=torch.float32, device=t.device)  # noqa: E731
    zero = torch.zeros_like(t)
    out = philox4x32([t >> 2, zero + (pos & _M32), zero + ((pos >> 32) & _M32), zero + NOISE_DOMAIN],
                     (key & _M32, (key >> 32) & _M32))
    word = t & 3
    b = torch.where(word == 0, out[0], torch.where(word == 1, out[1], torch.where(word == 2, out[2], out[3])))
    w = (b >> 8).float() * f32(2.0**-24) + ((b & 0xFF).float() + f32(0.5)) * f32(2.0**-32)
    top = f32(1.0 - 2.0**-24)
    w = torch.where(w < top, w, top)
    s = f32(0.125)
    for c in (1 / 7, 1 / 6, 0.2, 0.25, 1 / 3, 0.5, 1.0):
        s = s * w + f32(c)
    e = torch.where(w < f32(0.0625), s * w, -_log32(f32(1.0) - w))
    return -_log32(e)


# ---- one row's pick ---------------------------------------------------------------------------


def _c_pick(row: torch.Tensor, temperature: float, tau: float, ids: torch.Tensor | None, key: int, pos: int) -> int:
    """csrc/gumbel.c's pick over row [N] (fp32, CPU): the entry."""
    j = kernels.sampling_functions()["pick"](row.data_ptr(), len(row), temperature, tau,
                                             None if ids is None else ids.data_ptr(), key, pos, None)
    if j < 0:
        raise MemoryError("sampling: C Gumbel pick out of memory") if j == -2 else SelfSpecError("sampling: an empty support")
    return int(j)


def _torch_pick(x: torch.Tensor, tokens: torch.Tensor, key: int, pos: int) -> int:
    """argmax of x + g(key, pos, tokens) over finite x (first index on ties), in torch."""
    score = x.float() + gumbel_noise_torch(key, pos, tokens.to(x.device))
    score = score.masked_fill(~torch.isfinite(x), float("-inf"))
    return int(score.argmax())


def gumbel_max(d: Dist, key: int, pos: int) -> int:
    """The token t of d's support maximising x_t + g(key, pos, t) (ties: the lowest id): a draw
    from d with the noise of (key, pos) (module doc)."""
    if isinstance(d, PointMass):
        return d.token  # log q is 0 at the token, -inf elsewhere
    if isinstance(d, Explicit):
        xs = d.xs if d.xs is not None else d.probs.log().float()
        if c_ready(xs):
            return int(d.ids[_c_pick(xs.contiguous(), 1.0, -_FLT_MAX, d.ids, key, pos)])
        return int(d.ids[_torch_pick(xs, d.ids, key, pos)])
    if isinstance(d, Softmax):
        j = _c_pick(d.row, d.temperature, d.tau, None if d.vocab is None else d.vocab.ids, key, pos)
        return j if d.vocab is None else d.vocab.tokens[j]
    if isinstance(d, DenseProbs):
        x = d.x if d.x is not None else d.probs.float().log()
        if c_ready(x):
            return _c_pick(x.contiguous(), 1.0, -_FLT_MAX, None, key, pos)
        return _torch_pick(x, torch.arange(len(x), device=x.device), key, pos)
    raise TypeError(f"no Gumbel-max pick of {type(d).__name__}")


def pick_entries(xs: torch.Tensor, ids: torch.Tensor, key: int, pos: int, temperature: float = 1.0) -> int:
    """The entry j of xs [n] (fp32, CPU; entry j is token ids[j], ids int64 ascending) maximising
    fl(xs_j / T + g(key, pos, ids[j])) over its finite entries (ties: the lowest): the pick of
    an Explicit row (T 1) or of a Softmax one, restricted to these entries."""
    return _c_pick(xs.contiguous(), temperature, -_FLT_MAX, ids.contiguous(), key, pos)


class LazyRow:
    """One row of logits [V] not computed yet (sampled_head.HeadRows): gumbel_token asks it for
    its pick first and reads full() only where it cannot decide (None)."""

    def gumbel(self, cfg: SamplingConfig, key: int, pos: int) -> int | None:
        raise NotImplementedError

    def full(self) -> torch.Tensor:
        raise NotImplementedError


def gumbel_token(logits: torch.Tensor | LazyRow, cfg: SamplingConfig, key: int, pos: int, vocab: SubVocab | None = None) -> int:
    """The Gumbel-max token of one row of logits [N] (entry j is token j, or vocab.ids[j]) under
    cfg with the noise of (key, pos): gumbel_max(distribution(logits, cfg, vocab), key, pos), the
    distribution unbuilt when nothing is truncated (an argmax needs no normaliser). A LazyRow
    picks it itself where it can (the same token: sampled_head.py)."""
    if isinstance(logits, LazyRow):
        token = logits.gumbel(cfg, key, pos) if vocab is None else None
        if token is not None:
            return token
        logits = logits.full()
    if c_ready(logits) and not truncating(cfg, logits.shape[0]):
        row = logits.detach().float().contiguous()
        j = _c_pick(row, cfg.temperature, -_FLT_MAX, None if vocab is None else vocab.ids, key, pos)
        return j if vocab is None else vocab.tokens[j]
    return gumbel_max(distribution(logits, cfg, vocab), key, pos)


class GumbelPicks(Sequence):
    """The Gumbel-max tokens of the rows of logits [R, V] under cfg, row i's with the noise of
    (key, pos + i), each made on first use (coupled acceptance stops at the first mismatch).
    dists: the rows' distributions when they are kept for other uses (processors.ProcessedRows.
    dists: the logprobs read them); a truncated row's pick is made over it then."""

    def __init__(self, logits: torch.Tensor, cfg: SamplingConfig, key: int, pos: int, dists: Sequence[Dist] | None = None):
        self.logits, self.cfg, self.key, self.pos, self.dists = logits, cfg, key, pos, dists
        self._picks: dict[int, int] = {}

    def __len__(self):
        return self.logits.shape[0]

    def __getitem__(self, i):
        if i not in self._picks:
            if self.dists is not None and truncating(self.cfg, self.logits.shape[1]):  # = gumbel_token's own path
                self._picks[i] = gumbel_max(self.dists[i], self.key, self.pos + i)
            else:
                self._picks[i] = gumbel_token(self.logits[i], self.cfg, self.key, self.pos + i)
        return self._picks[i]
