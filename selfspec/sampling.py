"""Turning logits into a distribution and drawing from it.

Draft and target pass through the *same* transform, which is what makes speculative
sampling preserve the target distribution. Randomness always comes from an explicit
torch.Generator: every draw takes ONE uniform u in [0, 1) (fp64) from it and walks the
cumulative distribution in token-id order (inverse CDF).

The transform (the definition; `keep_mask` / `probs_from_logits` are its torch reference):
  1. temperature: x = logits / T (fp32 division, as torch computes it).
  2. top-k: keep x_i iff fewer than k tokens have x > x_i. Equivalently x_i >= the k-th
     largest value, so every token tied with the k-th largest is kept (k >= the number of
     finite logits: nothing is dropped).
  3. top-p, on the distribution renormalised over what top-k kept: keep x_i iff the
     probability mass of the tokens with x > x_i (strictly greater) is < top_p. The top-1
     token always stays (nothing is above it), and tied tokens share the mass above them,
     so ties are kept or dropped together: no rule here depends on the order of a sort.
  4. p_i = exp(x_i - m) / Z over the kept tokens (m = max x); -inf logits never are kept.
Both truncations are thresholds: the kept set is {x >= tau} for one value tau per row.

A row's distribution is a small object (`Dist`), so that speculative acceptance needs only
p(x), q(x) and, on a rejection, one draw from norm(max(p - q, 0)):
  * Explicit(ids, probs): a truncated support of at most CAP tokens (top-k 40, a nucleus
    of a few hundred), ids ascending.
  * Softmax(row, T, tau, m, Z): the row itself, with everything needed to evaluate p at a
    token in O(1) and to draw with one fused C pass (temperature only, or a huge nucleus).
  * PointMass(token): prompt lookup's deterministic draft.
  * DenseProbs(probs): a full probability vector, the torch fallback (CUDA tensors, or no
    C library: `selfspec.kernels.available()` false, e.g. SELFSPEC_NO_KERNELS=1).
Gumbel-max coupling (SamplingConfig.coupling "gumbel", the default) picks a row's token as the
argmax of x plus noise keyed by seed, position and token instead of drawing it: coupling.py.
The C side (csrc/sampling.c) finds tau without sorting the vocabulary. Top-k: one pass that
keeps the entries at or above a running threshold (the k-th largest so far), then a
quickselect. Top-p: one pass for the max, one for exp-sums in blocks plus counts and masses
above a ladder of thresholds (finer ladders inside the right band when it is crowded), then
a weighted quickselect over the candidates above the right rung.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Sequence

import numpy as np
import torch

from selfspec import kernels
from selfspec.config import SamplingConfig
from selfspec.errors import SelfSpecError

CAP = 4096  # supports up to this many tokens are kept explicit (ids + probabilities)
_SB = 1024  # entries per block of the C passes (SB in csrc/sampling.c)


# ---- the definition (torch, sort-based: the reference and the fallback) -------------------


def mass_strictly_above(s: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """s [..., V] sorted descending, w [..., V] their weights -> for each entry, the total
    weight of the entries with a strictly greater value (ties share one value)."""
    cum0 = torch.nn.functional.pad(w.cumsum(-1), (1, 0))
    neg = (-s).contiguous()  # ascending
    first = torch.searchsorted(neg, neg, right=False)  # entries strictly greater than s_i
    return cum0.gather(-1, first)


def keep_mask(x: torch.Tensor, top_k: int | None, top_p: float | None) -> torch.Tensor:
    """x [..., V] (logits / T) -> bool [..., V]: the tokens the transform keeps (module doc)."""
    keep = x > float("-inf")
    V = x.shape[-1]
    if top_k is not None and top_k < V:
        kth = torch.topk(x, top_k, dim=-1).values[..., -1:]
        keep &= x >= kth
    if top_p is not None and top_p < 1.0:
        s, order = torch.sort(x.masked_fill(~keep, float("-inf")), dim=-1, descending=True)
        w = s.double().softmax(-1)
        keep_sorted = mass_strictly_above(s, w) < top_p
        keep &= torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    return keep


def probs_from_logits(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """logits [..., V] (fp32) -> probabilities [..., V] after temperature, top-k and top-p
    (x in the logits' dtype, the softmax summed in fp64: fp32 sums over 262k terms drift by
    ~1e-5)."""
    x = logits / cfg.temperature
    x = x.masked_fill(~keep_mask(x, cfg.top_k, cfg.top_p), float("-inf"))
    return x.double().softmax(-1).to(logits.dtype)


# ---- draws ---------------------------------------------------------------------------------


def uniforms(rng: torch.Generator, n: int) -> list[float]:
    """n uniforms in [0, 1), fp64, from rng."""
    return torch.rand(n, generator=rng, dtype=torch.float64, device=rng.device).tolist()


def inverse_cdf(w: torch.Tensor, u: float) -> int:
    """The index i with W(< i) <= u * W < W(<= i) over weights w [n] >= 0 (a zero weight is
    never chosen); -1 when the total is 0."""
    cum = w.double().cumsum(0)
    total = float(cum[-1]) if len(cum) else 0.0
    if not total > 0.0:
        return -1
    i = int(torch.searchsorted(cum, torch.tensor([u * total], dtype=torch.float64, device=cum.device), right=True))
    if i >= len(w):  # rounding walked past the end: the last token with weight
        i = int(torch.nonzero(w > 0)[-1])
    return i


def sample(probs: torch.Tensor, rng: torch.Generator) -> int:
    """One draw from probs [V] (any non-negative weights)."""
    i = inverse_cdf(probs, uniforms(rng, 1)[0])
    if i < 0:
        raise SelfSpecError("cannot sample from an all-zero distribution")
    return i


def make_rng(seed: int | None, device="cpu") -> torch.Generator:
    g = torch.Generator(device=device)
    if seed is None:
        g.seed()
    else:
        g.manual_seed(seed)
    return g


# ---- one row's distribution ----------------------------------------------------------------


class SubVocab:
    """A restricted draft vocabulary: entry j of a draft row is token ids[j]. Read-only, so
    the drafters of one model share one per vocabulary (DraftResources.sub_vocab)."""

    def __init__(self, ids: torch.Tensor, vocab_size: int):
        self.ids = ids.long().contiguous()
        self.index = torch.full((vocab_size,), -1, dtype=torch.long, device=ids.device)  # token -> entry, -1 outside
        self.index[self.ids] = torch.arange(len(self.ids), device=ids.device)
        self.tokens: list[int] = self.ids.tolist()  # entry -> token without a torch op


class Dist:
    """One row's distribution over token ids (after the transform)."""

    def prob(self, token: int) -> float:
        raise NotImplementedError

    def probs_at(self, tokens: torch.Tensor) -> torch.Tensor:
        """p at tokens [n] (int64) -> [n] fp64."""
        raise NotImplementedError

    def top_prob(self) -> float:
        """The largest probability (the draft-threshold rule's confidence)."""
        raise NotImplementedError

    def pick(self, u: float) -> int:
        """The token at uniform u (inverse CDF in token-id order)."""
        raise NotImplementedError

    def dense(self, size: int) -> torch.Tensor:
        """The full probability vector [size] (fp64): tests and the generic fallback."""
        raise NotImplementedError

    def draw(self, rng: torch.Generator) -> int:
        return self.pick(uniforms(rng, 1)[0])


class PointMass(Dist):
    def __init__(self, token: int):
        self.token = int(token)

    def prob(self, token):
        return 1.0 if token == self.token else 0.0

    def probs_at(self, tokens):
        return (tokens == self.token).double()

    def top_prob(self):
        return 1.0

    def pick(self, u):
        return self.token

    def dense(self, size):
        d = torch.zeros(size, dtype=torch.float64)
        d[self.token] = 1.0
        return d


class Explicit(Dist):
    """ids [n] ascending token ids, probs [n] fp64 summing to 1; xs [n] fp32 their x = logit / T
    (what Gumbel-max adds noise to, coupling.py; None: log probs)."""

    def __init__(self, ids: torch.Tensor, probs: torch.Tensor, xs: torch.Tensor | None = None):
        self.ids, self.probs, self.xs = ids, probs, xs

    def prob(self, token):
        i = int(torch.searchsorted(self.ids, token))
        return float(self.probs[i]) if i < len(self.ids) and int(self.ids[i]) == token else 0.0

    def probs_at(self, tokens):
        i = torch.searchsorted(self.ids, tokens).clamp(max=len(self.ids) - 1)
        return torch.where(self.ids[i] == tokens, self.probs[i], 0.0)

    def top_prob(self):
        return float(self.probs.max())

    def pick(self, u):
        return int(self.ids[inverse_cdf(self.probs, u)])

    def dense(self, size):
        return torch.zeros(size, dtype=torch.float64, device=self.ids.device).index_put_((self.ids,), self.probs)


class Softmax(Dist):
    """p_j = exp(x_j - m) / z on {x_j >= tau}, x = row / temperature (fp32), for the entries
    of `row` [N] (fp32, CPU); entry j is token j, or vocab.ids[j]. `blocks`: the C pass's
    block sums of exp(x - m) (no truncation only), so a plain draw reads ~N/1024 numbers
    and one block."""

    def __init__(self, row: torch.Tensor, temperature: float, tau: float, m: float, z: float,
                 blocks: torch.Tensor | None = None, vocab: SubVocab | None = None):
        self.row, self.temperature, self.tau, self.m, self.z = row, temperature, tau, m, z
        self.blocks, self.vocab = blocks, vocab
        self._t32 = np.float32(temperature)

    def _entry(self, token: int) -> int:
        return token if self.vocab is None else int(self.vocab.index[token])

    def prob(self, token):
        j = self._entry(token)
        if j < 0 or j >= len(self.row):
            return 0.0
        x = np.float32(self.row[j].item()) / self._t32  # the fp32 division the C passes made
        return math.exp(float(x) - self.m) / self.z if x >= self.tau else 0.0

    def probs_at(self, tokens):
        j = tokens if self.vocab is None else self.vocab.index[tokens]
        x = self.row[j.clamp(min=0)] / self.temperature
        ok = (j >= 0) & (x >= self.tau)
        return torch.where(ok, (x.double() - self.m).exp() / self.z, 0.0)

    def top_prob(self):
        return 1.0 / self.z

    def pick(self, u):
        return self._token(_c_draw(self, None, u)[0])

    def _token(self, j: int) -> int:
        return j if self.vocab is None else int(self.vocab.ids[j])

    def dense(self, size):
        x = self.row / self.temperature
        p = torch.where(x >= self.tau, (x.double() - self.m).exp() / self.z, 0.0)
        if self.vocab is None:
            return p
        return torch.zeros(size, dtype=torch.float64).index_put_((self.vocab.ids,), p)


class DenseProbs(Dist):
    """A full probability vector [V] (any device): the torch fallback. x [V] (fp32, -inf off the
    support): what Gumbel-max adds noise to (coupling.py; None: log probs)."""

    def __init__(self, probs: torch.Tensor, x: torch.Tensor | None = None):
        self.probs, self.x = probs, x

    def prob(self, token):
        return float(self.probs[token])

    def probs_at(self, tokens):
        return self.probs[tokens.to(self.probs.device)].double()

    def top_prob(self):
        return float(self.probs.max())

    def pick(self, u):
        return inverse_cdf(self.probs, u)

    def dense(self, size):
        return self.probs.double()


def truncating(cfg: SamplingConfig, n: int) -> bool:
    """cfg's top-k or top-p may drop tokens of a row of n."""
    return (cfg.top_k is not None and cfg.top_k < n) or (cfg.top_p is not None and cfg.top_p < 1.0)


def c_ready(t: torch.Tensor) -> bool:
    """The C sampling functions can take t (a CPU tensor, the library loaded)."""
    return t.device.type == "cpu" and kernels.sampling_functions() is not None


def distribution(logits: torch.Tensor, cfg: SamplingConfig, vocab: SubVocab | None = None, cap: int | None = None) -> Dist:
    """logits [N] (one row; entry j is token j, or vocab.ids[j]) -> its Dist under cfg: Explicit
    when the support has at most `cap` (default CAP) tokens, else Softmax (DenseProbs without
    the C library or off the CPU)."""
    cap = CAP if cap is None else cap
    if not c_ready(logits):
        x = logits.float() / cfg.temperature
        if not bool(x.max() > float("-inf")) or bool(x.max() == float("inf")):  # as the C pass: no silent token 0
            raise SelfSpecError("sampling: the logits have no finite value, or +inf")
        x = x.masked_fill(~keep_mask(x, cfg.top_k, cfg.top_p), float("-inf"))
        p = x.double().softmax(-1).float()  # = probs_from_logits
        if vocab is not None:
            ids = vocab.ids.to(p.device)
            p = torch.zeros(len(vocab.index), dtype=p.dtype, device=p.device).index_put_((ids,), p)
            x = torch.full((len(vocab.index),), float("-inf"), device=x.device).index_put_((ids,), x)
        return DenseProbs(p, x)
    row = logits.detach().float().contiguous()
    n = row.shape[0]
    trunc = truncating(cfg, n)
    cap = min(cap, n)
    ids = torch.empty(cap, dtype=torch.long)
    probs = torch.empty(cap, dtype=torch.float64)
    blocks = None if trunc else torch.empty((n + _SB - 1) // _SB, dtype=torch.float64)
    out = (ctypes.c_double * 5)()
    rc = kernels.sampling_functions()["dist"](
        row.data_ptr(), n, cfg.temperature, cfg.top_k or 0, 1.0 if cfg.top_p is None else cfg.top_p, cap,
        ids.data_ptr(), probs.data_ptr(), None if blocks is None else blocks.data_ptr(), out)
    if rc != 0:
        raise SelfSpecError("sampling: the logits have no finite value, or +inf" if rc == -1 else f"sampling: C error {rc}")
    m, tau, z, size, written = out
    if written > 0:
        k = int(written)
        ids, probs = ids[:k], probs[:k]
        xs = row[ids] / cfg.temperature  # the C passes' fp32 division
        if vocab is not None:
            ids, order = vocab.ids[ids].sort()
            probs, xs = probs[order], xs[order]
        return Explicit(ids, probs, xs)
    return Softmax(row, cfg.temperature, tau, m, z, blocks, vocab)


def _c_draw(p: Softmax, q: Dist | None, u: float) -> tuple[int, float]:
    """One C pass: (index into p.row, total residual mass) of a draw from max(p - q, 0)."""
    ql = qids = qprobs = None
    qn, qT, qtau, qm, qz = 0, 1.0, 0.0, 0.0, 1.0
    keep = []
    if isinstance(q, PointMass):
        qids, qprobs = torch.tensor([q.token]), torch.ones(1, dtype=torch.float64)
    elif isinstance(q, Explicit):
        qids, qprobs = q.ids, q.probs
    elif isinstance(q, Softmax):
        ql, qT, qtau, qm, qz = q.row, q.temperature, q.tau, q.m, q.z
        qids = None if q.vocab is None else q.vocab.ids
        qn = len(q.row)
    elif q is not None:
        raise TypeError(f"no C draw against {type(q).__name__}")
    if qids is not None:
        keep.append(qids)
        qn = len(qids)
    total = ctypes.c_double()
    ptr = lambda t: None if t is None else t.data_ptr()  # noqa: E731
    j = kernels.sampling_functions()["draw"](
        p.row.data_ptr(), len(p.row), p.temperature, p.tau, p.m, p.z, ptr(p.blocks),
        ptr(ql), ptr(qids), qn, qT, qtau, qm, qz, ptr(qprobs), u, ctypes.byref(total))
    if j == -2:
        raise MemoryError("sampling: C draw out of memory")
    return int(j), total.value


def residual_draw(p: Dist, q: Dist, rng: torch.Generator) -> int:
    """One draw from norm(max(p - q, 0)) (p itself when p <= q everywhere: a rejection then
    has probability 0). Works over p's support only: the residual is zero outside it."""
    u = uniforms(rng, 1)[0]
    if isinstance(p, Explicit):
        i = inverse_cdf((p.probs - q.probs_at(p.ids)).clamp_min(0.0), u)
        return p.pick(u) if i < 0 else int(p.ids[i])
    if isinstance(p, Softmax) and p.vocab is None and isinstance(q, (PointMass, Explicit, Softmax)) and \
            (not isinstance(q, Softmax) or q.vocab is not None or len(q.row) == len(p.row)):
        j, _ = _c_draw(p, q, u)
        return p.pick(u) if j < 0 else j
    size = max(_size(p), _size(q))
    pd = p.dense(size)
    i = inverse_cdf((pd - q.dense(size).to(pd.device)).clamp_min(0.0), u)
    return p.pick(u) if i < 0 else i


def _size(d: Dist) -> int:
    """A vocabulary size that holds every token of d."""
    if isinstance(d, DenseProbs):
        return len(d.probs)
    if isinstance(d, Softmax):
        return len(d.vocab.index) if d.vocab is not None else len(d.row)
    if isinstance(d, Explicit):
        return int(d.ids.max()) + 1 if len(d.ids) else 0
    return d.token + 1


class Rows(Sequence):
    """The distributions of the rows of logits [R, V] under cfg, each made on first use
    (speculative acceptance stops at the first rejection: later rows are never built)."""

    def __init__(self, logits: torch.Tensor, cfg: SamplingConfig):
        self.logits, self.cfg = logits, cfg
        self._rows: dict[int, Dist] = {}

    def __len__(self):
        return self.logits.shape[0]

    def __getitem__(self, i):
        if i not in self._rows:
            self._rows[i] = distribution(self.logits[i], self.cfg)
        return self._rows[i]


def as_rows(x: torch.Tensor | Sequence[Dist]) -> Sequence[Dist]:
    """Probability rows [R, V] -> their Dists (DenseProbs); a sequence of Dists unchanged."""
    return [DenseProbs(r) for r in x] if isinstance(x, torch.Tensor) else x
