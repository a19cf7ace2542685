"""Sampling: the logits transform, the speculative acceptance rules, and end to end
distribution preservation (speculative sampling must sample exactly the autoregressive
distribution, with either coupling), plus seed reproducibility.

All statistical tests use fixed seeds, so they are deterministic; each asserts a
chi-square p-value > 0.001 against the *exact* target distribution.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from scipy.stats import binomtest, chisquare

import selfspec
from selfspec.architectures import ModelSpec
from selfspec.config import COUPLINGS, DraftConfig, GenerationConfig, SamplingConfig
from selfspec.drafters import AutoDrafter, make_drafter
from selfspec.engine import generate
from selfspec.errors import SelfSpecError
from selfspec.runtime import Runtime
from selfspec.predictor.costs import CostModel
from selfspec import kernels
from selfspec import sampling as sampling_mod
from selfspec.sampling import (CAP, DenseProbs, Explicit, PointMass, Rows, Softmax, SubVocab, distribution, keep_mask,
                               make_rng, probs_from_logits, residual_draw, sample)
from selfspec.verification import residual_distribution, speculative_accept

from helpers import build_hf, prompts

P_MIN = 0.001


def chi2_pvalue(counts: np.ndarray, probs: np.ndarray, min_expected: float = 5.0) -> float:
    """Goodness of fit of `counts` to `probs`; cells with a small expected count are pooled.
    Cells of probability 0 must be empty (checked here, not left to the statistic)."""
    counts, probs = np.asarray(counts, float).ravel(), np.asarray(probs, float).ravel()
    n = counts.sum()
    zero = probs <= 1e-12
    assert counts[zero].sum() == 0, f"{int(counts[zero].sum())} samples fell on probability-0 outcomes"
    probs = probs / probs.sum()
    exp = probs * n
    big = exp >= min_expected
    obs_b, exp_b = list(counts[big]), list(exp[big])
    small = ~big & ~zero
    if small.any():
        obs_b.append(counts[small].sum())
        exp_b.append(exp[small].sum())
    if len(obs_b) < 2:
        return 1.0
    return float(chisquare(obs_b, exp_b).pvalue)


# ---- probs_from_logits --------------------------------------------------------------------


def _probs(logits, **kw):
    return probs_from_logits(torch.tensor(logits, dtype=torch.float32), SamplingConfig(**kw))


def test_temperature_exact():
    logits = [1.0, 2.0, 3.0, -1.0]
    for t in (0.5, 1.0, 2.0, 7.0):
        exp = torch.softmax(torch.tensor(logits) / t, -1)
        assert torch.allclose(_probs(logits, temperature=t), exp, atol=1e-7)
    assert torch.allclose(_probs(logits, temperature=1.0).sum(), torch.tensor(1.0))


def test_top_k_exact():
    logits = [0.5, 3.0, -2.0, 1.5, 2.5]
    p = _probs(logits, temperature=1.0, top_k=2)
    exp = torch.zeros(5)
    exp[[1, 4]] = torch.softmax(torch.tensor([3.0, 2.5]), -1)
    assert torch.allclose(p, exp, atol=1e-7)
    assert (p[[0, 2, 3]] == 0).all()
    # top_k = 1: a point mass; top_k >= V: unchanged
    assert torch.equal(_probs(logits, temperature=1.0, top_k=1), torch.tensor([0.0, 1, 0, 0, 0]))
    full = torch.softmax(torch.tensor(logits), -1)
    assert torch.allclose(_probs(logits, temperature=1.0, top_k=5), full)
    assert torch.allclose(_probs(logits, temperature=1.0, top_k=50), full)
    # temperature applies before top-k: same support, sharper distribution
    p2 = _probs(logits, temperature=0.5, top_k=2)
    exp2 = torch.zeros(5)
    exp2[[1, 4]] = torch.softmax(torch.tensor([6.0, 5.0]), -1)
    assert torch.allclose(p2, exp2, atol=1e-7)


def test_top_p_exact():
    base = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = base.log().tolist()
    # keep the smallest prefix (by rank) whose mass reaches top_p
    assert torch.allclose(_probs(logits, temperature=1.0, top_p=0.75), torch.tensor([0.625, 0.375, 0, 0]), atol=1e-6)
    assert torch.allclose(_probs(logits, temperature=1.0, top_p=0.9), torch.tensor([0.5, 0.3, 0.15, 0]) / 0.95, atol=1e-6)
    assert torch.allclose(_probs(logits, temperature=1.0, top_p=0.3), torch.tensor([1.0, 0, 0, 0]), atol=1e-6)
    assert torch.allclose(_probs(logits, temperature=1.0, top_p=1.0), base, atol=1e-6)
    # order unchanged when the ranks are shuffled
    perm = [2, 0, 3, 1]
    shuffled = _probs([logits[i] for i in perm], temperature=1.0, top_p=0.75)
    assert torch.allclose(shuffled, torch.tensor([0, 0.625, 0, 0.375]), atol=1e-6)


def test_top_k_then_top_p():
    """transformers' order: temperature, top-k, then top-p on the renormalised top-k set."""
    logits = torch.tensor([0.4, 0.3, 0.2, 0.1]).log().tolist()
    # after top-3: [4/9, 3/9, 2/9]; mass above rank 2 = 7/9 >= 0.72 -> dropped
    assert torch.allclose(_probs(logits, temperature=1.0, top_k=3, top_p=0.72), torch.tensor([4 / 7, 3 / 7, 0, 0]), atol=1e-6)
    # without top-k, the mass above rank 2 is 0.7 < 0.72 -> kept
    assert torch.allclose(_probs(logits, temperature=1.0, top_p=0.72), torch.tensor([4 / 9, 3 / 9, 2 / 9, 0]), atol=1e-6)


def test_matches_transformers_warpers():
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    g = torch.Generator().manual_seed(0)
    for trial in range(60):
        V = [5, 17, 64, 300][trial % 4]
        logits = torch.randn(3, V, generator=g) * (1 + trial % 3)
        t = [0.3, 0.7, 1.0, 1.6][trial % 4]
        k = [None, 1, 3, 10][(trial // 4) % 4]
        p = [None, 0.2, 0.6, 0.95][(trial // 16) % 4]
        ref = TemperatureLogitsWarper(t)(None, logits.clone())
        if k is not None:
            ref = TopKLogitsWarper(k)(None, ref)
        if p is not None:
            ref = TopPLogitsWarper(p)(None, ref)
        ref = ref.softmax(-1)
        ours = probs_from_logits(logits, SamplingConfig(temperature=t, top_k=k, top_p=p))
        assert torch.equal(ours > 0, ref > 0), (t, k, p)
        assert torch.allclose(ours, ref, atol=1e-6), (t, k, p)


@pytest.mark.parametrize(
    "kw", [dict(temperature=-0.1), dict(temperature=float("nan")), dict(top_k=0), dict(top_k=2.5), dict(top_p=0.0),
           dict(top_p=1.5), dict(top_p=-0.2)]
)
def test_bad_sampling_config(kw):
    with pytest.raises(SelfSpecError):
        SamplingConfig(**kw)


def test_sample_and_rng():
    probs = torch.tensor([0.0, 0.25, 0.75, 0.0])
    a = [sample(probs, make_rng(3)) for _ in range(3)]
    assert len(set(a)) == 1  # same seed, same draw
    rng = make_rng(0)
    draws = [sample(probs, rng) for _ in range(4000)]
    counts = np.bincount(draws, minlength=4)
    assert counts[0] == counts[3] == 0
    assert chi2_pvalue(counts, probs.numpy()) > P_MIN


# ---- fast sampling: distribution() against the sort-based definition -----------------------
#
# The reference here is independent of selfspec/sampling.py: numpy, a full sort, fp64. A top-p
# decision within BOUNDARY of top_p may go either way in fp32 arithmetic, so the support must
# lie between the reference with top_p - BOUNDARY and with top_p + BOUNDARY (equal to both
# whenever no mass lies that close to the boundary, which is the usual case).

BOUNDARY = 1e-5
P_STRICT = 1e-6  # significance level of the new chi-square tests (fixed seeds: deterministic)


def ref_support(logits: torch.Tensor, cfg: SamplingConfig, slack: float = 0.0) -> np.ndarray:
    """bool [V]: tokens kept by temperature, top-k (ties with the k-th largest kept), then
    top-p (mass strictly above < top_p + slack over the renormalised top-k set)."""
    x = (logits / cfg.temperature).numpy()  # the fp32 division of the definition
    keep = x > -np.inf
    desc = -np.sort(-x[keep])
    if cfg.top_k is not None:
        above = np.searchsorted(-desc, -x, side="left")  # how many are strictly greater
        keep &= above < cfg.top_k
    if cfg.top_p is not None and cfg.top_p < 1.0:
        xk = x[keep].astype(np.float64)
        w = np.exp(xk - xk.max())
        order = np.argsort(-xk, kind="stable")
        cum0 = np.concatenate([[0.0], np.cumsum(w[order])]) / w.sum()
        above = cum0[np.searchsorted(-xk[order], -x.astype(np.float64), side="left")]
        keep &= above < cfg.top_p + slack
    return keep


def ref_probs(logits: torch.Tensor, cfg: SamplingConfig, keep: np.ndarray) -> np.ndarray:
    x = (logits / cfg.temperature).numpy().astype(np.float64)
    p = np.where(keep, np.exp(x - x[keep].max()), 0.0)
    return p / p.sum()


def support_of(d, logits: torch.Tensor, cfg: SamplingConfig, V: int) -> np.ndarray:
    """The tokens a Dist keeps (by its rule, not by probability > 0: exps underflow)."""
    if isinstance(d, Explicit):
        s = np.zeros(V, bool)
        s[d.ids.numpy()] = True
        return s
    if isinstance(d, Softmax):
        x = (logits / cfg.temperature).numpy()
        return (x >= d.tau) & (x > -np.inf)
    return keep_mask(logits / cfg.temperature, cfg.top_k, cfg.top_p).numpy()  # DenseProbs: the torch rule


def _logits(kind: str, V: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(V, generator=g) * 3
    if kind == "bf16":  # what the model's head gives: many exact ties
        x = x.bfloat16().float()
    elif kind == "int":  # very many ties
        x = torch.randint(-4, 5, (V,), generator=g).float()
    elif kind == "neginf":
        x[torch.rand(V, generator=g) < 0.4] = float("-inf")
        x[int(torch.randint(V, (1,), generator=g))] = 2.0  # at least one finite
    elif kind == "peaked":  # real-model-like: a few candidates far above a low bulk
        x = (x - 14).bfloat16().float()
        x[torch.randint(V, (20,), generator=g)] += 30
    elif kind == "flat":
        x = torch.zeros(V)
    return x


SUPPORT_CASES = [
    (kind, V, T, k, p)
    for i, (kind, V) in enumerate([("normal", 7), ("bf16", 1000), ("int", 3000), ("neginf", 500), ("peaked", 262144),
                                    ("bf16", 70000), ("flat", 300), ("normal", 20000)])
    for T, k, p in [(0.8, None, None), (1e-3, None, 0.95), (0.8, 40, None), (0.8, None, 0.95), (1.0, 40, 0.95),
                    (50.0, None, 0.3), (1e4, None, 0.999999), (0.8, None, 1e-6), (0.8, 1, None), (2.0, V - 1, 0.9),
                    (0.8, V, 0.5), (0.8, V + 10, None), (0.7, 3, 0.999999)][i % 3 :: 3]
]


def _close_enough(d, logits, cfg, V):
    strict, loose = ref_support(logits, cfg, -BOUNDARY), ref_support(logits, cfg, BOUNDARY)
    got = support_of(d, logits, cfg, V)
    assert not (strict & ~got).any(), f"dropped {np.flatnonzero(strict & ~got)[:5]}"
    assert not (got & ~loose).any(), f"kept {np.flatnonzero(got & ~loose)[:5]}"
    ref = ref_probs(logits, cfg, got)  # renormalised over the support found
    dense = d.dense(V).double().cpu().numpy()
    np.testing.assert_allclose(dense, ref, rtol=2e-5, atol=1e-9)
    return strict, got


@pytest.mark.parametrize("backend", ["c", "torch"])
@pytest.mark.parametrize("kind,V,T,k,p", SUPPORT_CASES, ids=[f"{c[0]}-{c[1]}-T{c[2]}-k{c[3]}-p{c[4]}" for c in SUPPORT_CASES])
def test_support_and_probs_match_sort_reference(kind, V, T, k, p, backend, monkeypatch):
    if backend == "torch":
        monkeypatch.setenv("SELFSPEC_NO_KERNELS", "1")
    elif not kernels.available():
        pytest.skip("C kernels not available")
    logits = _logits(kind, V, seed=V)
    cfg = SamplingConfig(temperature=T, top_k=k, top_p=p)
    d = distribution(logits, cfg)
    assert isinstance(d, DenseProbs) == (backend == "torch")
    strict, got = _close_enough(d, logits, cfg, V)
    if backend == "c":
        assert isinstance(d, Explicit) == (got.sum() <= CAP)
        assert d.top_prob() == pytest.approx(float(ref_probs(logits, cfg, got).max()), rel=2e-5)
        dense = distribution(logits, cfg, cap=0)  # the same row as a dense Softmax
        assert isinstance(dense, Softmax)
        assert (support_of(dense, logits, cfg, V) == got).all()
        np.testing.assert_allclose(dense.dense(V).numpy(), d.dense(V).numpy(), rtol=2e-5, atol=1e-9)


def test_ties_are_kept_or_dropped_together():
    # four tokens tied at the top-k boundary: all kept; a tie at the top-p boundary: all kept
    x = torch.tensor([3.0, 2.0, 2.0, 2.0, 2.0, 0.0, -1.0])
    for backend_cap in (None, 0):
        d = distribution(x, SamplingConfig(temperature=1.0, top_k=2), cap=backend_cap)
        assert (support_of(d, x, SamplingConfig(temperature=1.0, top_k=2), 7) == [1, 1, 1, 1, 1, 0, 0]).all()
        cfg = SamplingConfig(temperature=1.0, top_p=0.5)  # p(top-1) ~ 0.39 < 0.5: the tied group joins, whole
        d = distribution(x, cfg, cap=backend_cap)
        assert (support_of(d, x, cfg, 7) == [1, 1, 1, 1, 1, 0, 0]).all()
    assert (keep_mask(x, 2, None) == torch.tensor([1, 1, 1, 1, 1, 0, 0], dtype=torch.bool)).all()
    assert (keep_mask(x, None, 0.5) == torch.tensor([1, 1, 1, 1, 1, 0, 0], dtype=torch.bool)).all()


def test_hand_examples_through_every_backend(monkeypatch):
    """The exact examples above, through distribution() (C explicit, C dense, torch)."""
    cases = [
        ([0.5, 3.0, -2.0, 1.5, 2.5], dict(temperature=1.0, top_k=2), [0, 0.6224593, 0, 0, 0.3775407]),
        ([0.5, 3.0, -2.0, 1.5, 2.5], dict(temperature=1.0, top_k=1), [0, 1, 0, 0, 0]),
        (torch.tensor([0.5, 0.3, 0.15, 0.05]).log().tolist(), dict(temperature=1.0, top_p=0.75), [0.625, 0.375, 0, 0]),
        (torch.tensor([0.5, 0.3, 0.15, 0.05]).log().tolist(), dict(temperature=1.0, top_p=0.9), [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0]),
        (torch.tensor([0.4, 0.3, 0.2, 0.1]).log().tolist(), dict(temperature=1.0, top_k=3, top_p=0.72), [4 / 7, 3 / 7, 0, 0]),
        (torch.tensor([0.4, 0.3, 0.2, 0.1]).log().tolist(), dict(temperature=1.0, top_p=0.72), [4 / 9, 3 / 9, 2 / 9, 0]),
        ([1.0, 2.0, 3.0, -1.0], dict(temperature=2.0), torch.softmax(torch.tensor([1.0, 2.0, 3.0, -1.0]) / 2, -1).tolist()),
    ]
    for logits, kw, expected in cases:
        for cap in (None, 0):
            d = distribution(torch.tensor(logits), SamplingConfig(**kw), cap=cap)
            np.testing.assert_allclose(d.dense(len(logits)).numpy(), expected, atol=1e-6, err_msg=str((kw, cap)))
    monkeypatch.setenv("SELFSPEC_NO_KERNELS", "1")
    for logits, kw, expected in cases:
        d = distribution(torch.tensor(logits), SamplingConfig(**kw))
        np.testing.assert_allclose(d.dense(len(logits)).numpy(), expected, atol=1e-6, err_msg=str(kw))


def test_restricted_vocabulary_distribution():
    V, N = 500, 60
    g = torch.Generator().manual_seed(3)
    ids = torch.randperm(V, generator=g)[:N]
    sub = SubVocab(ids, V)
    logits = torch.randn(N, generator=g) * 2
    for cfg in (SamplingConfig(temperature=0.9), SamplingConfig(temperature=0.9, top_k=7), SamplingConfig(temperature=0.9, top_p=0.8)):
        full = torch.full((V,), float("-inf"))
        full[ids] = logits
        want = probs_from_logits(full, cfg).double()
        for cap in (None, 0):
            d = distribution(logits, cfg, sub, cap=cap)
            assert torch.allclose(d.dense(V), want, atol=1e-7)
            tokens = torch.arange(V)
            assert torch.allclose(d.probs_at(tokens), want, atol=1e-7)
            for t in (int(ids[0]), int(ids[5]), int(torch.nonzero(sub.index < 0)[0])):
                assert d.prob(t) == pytest.approx(float(want[t]), abs=1e-7)
            assert d.top_prob() == pytest.approx(float(want.max()), rel=1e-5)
            rng = make_rng(0)
            assert all(sub.index[d.draw(rng)] >= 0 for _ in range(50))


def test_c_and_torch_fallback_agree(monkeypatch):
    if not kernels.available():
        pytest.skip("C kernels not available")
    V = 5000
    rows = [_logits("bf16", V, s) for s in range(3)] + [_logits("peaked", V, 9)]
    cfgs = [SamplingConfig(temperature=0.8), SamplingConfig(temperature=0.8, top_k=40),
            SamplingConfig(temperature=0.8, top_p=0.95), SamplingConfig(temperature=1.3, top_k=100, top_p=0.9)]
    us = np.random.default_rng(0).random(400).tolist()
    for cfg in cfgs:
        for x in rows:
            fast = [distribution(x, cfg), distribution(x, cfg, cap=0)]
            with monkeypatch.context() as mp:
                mp.setenv("SELFSPEC_NO_KERNELS", "1")
                slow = distribution(x, cfg)
            assert isinstance(slow, DenseProbs)
            for d in fast:
                assert torch.allclose(d.dense(V), slow.dense(V), rtol=2e-5, atol=1e-9)
                same = sum(d.pick(u) == slow.pick(u) for u in us)
                assert same >= len(us) - 2  # only a u within rounding of a CDF step may differ


# ---- fast sampling: draws follow the distribution -------------------------------------------


def _draw_counts(d, n: int, V: int, seed: int) -> np.ndarray:
    rng = make_rng(seed)
    return np.bincount([d.draw(rng) for _ in range(n)], minlength=V)


DRAW_CASES = [
    ("V40-T1", 40, SamplingConfig(temperature=1.0)),
    ("V40-k8", 40, SamplingConfig(temperature=0.7, top_k=8)),
    ("V40-p0.8", 40, SamplingConfig(temperature=1.2, top_p=0.8)),
    ("V3000-k40-p0.95", 3000, SamplingConfig(temperature=0.8, top_k=40, top_p=0.95)),
    ("V262144-T0.8", 262144, SamplingConfig(temperature=0.8)),
    ("V262144-p0.95", 262144, SamplingConfig(temperature=0.8, top_p=0.95)),
]


@pytest.mark.parametrize("rep", ["explicit", "dense", "torch"])
@pytest.mark.parametrize("name,V,cfg", DRAW_CASES, ids=[c[0] for c in DRAW_CASES])
def test_draws_follow_the_distribution(name, V, cfg, rep, monkeypatch):
    if rep == "torch":
        monkeypatch.setenv("SELFSPEC_NO_KERNELS", "1")
    logits = _logits("normal" if V < 100 else "peaked", V, seed=5)
    if V < 100:
        logits = logits / 2
    d = distribution(logits, cfg, cap=0 if rep == "dense" else None)
    want = probs_from_logits(logits, cfg).double().numpy()
    n = 20000 if V < 100000 else 4000
    counts = _draw_counts(d, n, V, seed=11)
    assert chi2_pvalue(counts, want) > P_STRICT


def test_same_seed_same_draws():
    x = _logits("bf16", 3000, 1)
    for cfg in (SamplingConfig(temperature=0.8), SamplingConfig(temperature=0.8, top_p=0.9)):
        for cap in (None, 0):
            a = [distribution(x, cfg, cap=cap).draw(make_rng(s)) for s in range(20)]
            b = [distribution(x, cfg, cap=cap).draw(make_rng(s)) for s in range(20)]
            assert a == b and len(set(a)) > 1


# ---- fast sampling: the residual norm(max(p - q, 0)) for every pair of representations -------

RV, RN = 40, 25  # vocabulary of the residual tests; size of the restricted draft vocabulary


def _dists(role: str, seed: int) -> dict:
    """Every representation of one row's distribution (p: target-like; q: draft-like)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(RV, generator=g) * 1.5
    cfg = SamplingConfig(temperature=0.9, top_p=0.97)
    temp = SamplingConfig(temperature=0.9)
    out = {
        "explicit": distribution(x, cfg),
        "softmax-truncated": distribution(x, cfg, cap=0),
        "softmax-blocks": distribution(x, temp, cap=0),
    }
    if role == "q":
        ids = torch.randperm(RV, generator=g)[:RN]
        sub = SubVocab(ids, RV)
        out["point-mass"] = PointMass(int(torch.argmax(x)))
        out["softmax-vocab"] = distribution(x[ids], temp, sub, cap=0)
        out["explicit-vocab"] = distribution(x[ids], cfg, sub)
    out["torch"] = DenseProbs(probs_from_logits(x, cfg))
    return out


P_KINDS = ["explicit", "softmax-truncated", "softmax-blocks", "torch"]
Q_KINDS = ["point-mass", "explicit", "softmax-truncated", "softmax-blocks", "softmax-vocab", "explicit-vocab", "torch"]


@pytest.mark.parametrize("q_kind", Q_KINDS)
@pytest.mark.parametrize("p_kind", P_KINDS)
def test_residual_draw_every_representation(p_kind, q_kind):
    p, q = _dists("p", 1)[p_kind], _dists("q", 2)[q_kind]
    want = residual_distribution(p.dense(RV), q.dense(RV)).numpy()
    rng = make_rng(3)
    counts = np.bincount([residual_draw(p, q, rng) for _ in range(6000)], minlength=RV)
    assert chi2_pvalue(counts, want) > P_STRICT


def test_residual_of_equal_distributions_falls_back_to_p():
    p = _dists("p", 4)["softmax-blocks"]
    rng = make_rng(0)
    counts = np.bincount([residual_draw(p, p, rng) for _ in range(3000)], minlength=RV)
    assert chi2_pvalue(counts, p.dense(RV).numpy()) > P_STRICT


@pytest.mark.parametrize("q_kind", ["point-mass", "explicit", "softmax-blocks", "softmax-vocab"])
def test_speculative_accept_with_dists_preserves_target(q_kind):
    """Context-free rows: output position i ~ p_i, whatever q_i each draft came from."""
    ps = [_dists("p", 10 + i) for i in range(3)]
    qs = [_dists("q", 20 + i)[q_kind] for i in range(2)]
    rng = make_rng(5)
    outs = []
    for t in range(6000):
        p_rows = [ps[0]["explicit"], ps[1]["softmax-truncated"], ps[2]["softmax-blocks"]]
        draft = [q.draw(rng) for q in qs]
        n, nxt = speculative_accept(draft, qs, p_rows, rng)
        outs.append(draft[:n] + [nxt])
    for i, p in enumerate([ps[0]["explicit"], ps[1]["softmax-truncated"], ps[2]["softmax-blocks"]]):
        toks = [o[i] for o in outs if len(o) > i]
        if len(toks) >= 300:
            assert chi2_pvalue(np.bincount(toks, minlength=RV), p.dense(RV).numpy()) > P_STRICT


def test_rows_are_built_lazily():
    logits = torch.randn(4, 300)
    rows = Rows(logits, SamplingConfig(temperature=1.0, top_k=5))
    # a draft the target gives probability ~0 at position 0: rejected there, rows 1.. never built
    bad = int(torch.argmin(logits[0]))
    speculative_accept([bad, 1, 2], [PointMass(bad), PointMass(1), PointMass(2)], rows, make_rng(0))
    assert set(rows._rows) == {0}


# ---- speculative_accept -------------------------------------------------------------------


def _run_accept(p: torch.Tensor, q: torch.Tensor, trials: int, seed: int = 0):
    """p [k+1, V] target rows, q [k, V] draft rows (fixed, context-free). -> list of outputs."""
    rng = make_rng(seed)
    k = q.shape[0]
    outs, n_acc = [], []
    for _ in range(trials):
        draft = [sample(q[i], rng) for i in range(k)]
        n, nxt = speculative_accept(draft, q, p, rng)
        assert 0 <= n <= k
        outs.append(draft[:n] + [nxt])
        n_acc.append(n)
    return outs, n_acc


def _check_positions(outs, p):
    """With context-free rows, position i of the output (when reached) is ~ p[i]."""
    V = p.shape[1]
    for i in range(p.shape[0]):
        toks = [o[i] for o in outs if len(o) > i]
        if len(toks) < 200:
            continue
        pv = chi2_pvalue(np.bincount(toks, minlength=V), p[i].numpy())
        assert pv > P_MIN, f"position {i}: p-value {pv}"


def _rows(*rows):
    t = torch.tensor(rows, dtype=torch.float32)
    return t / t.sum(-1, keepdim=True)


SPEC_CASES = {
    "k1": (_rows([0.1, 0.2, 0.3, 0.15, 0.25], [0.3, 0.1, 0.1, 0.2, 0.3]), _rows([0.3, 0.3, 0.1, 0.2, 0.1])),
    "k3-disjoint-supports": (
        _rows([0.5, 0.3, 0.2, 0, 0, 0], [0, 0.1, 0.2, 0.3, 0.4, 0], [0.2, 0.2, 0.2, 0.2, 0.1, 0.1], [1, 1, 1, 1, 1, 1]),
        _rows([0.1, 0.1, 0.1, 0.3, 0.4, 0], [0.5, 0.5, 0, 0, 0, 0], [0.2, 0.2, 0.2, 0.2, 0.1, 0.1]),
    ),
    "one-hot-drafts": (
        _rows([0.1, 0.6, 0.3], [0.2, 0.2, 0.6], [0.5, 0.25, 0.25]),
        _rows([0, 1, 0], [0, 0, 1]),
    ),
    "q-equals-p": (_rows([0.2, 0.5, 0.3], [0.6, 0.3, 0.1]), _rows([0.2, 0.5, 0.3])),
}


@pytest.mark.parametrize("case", list(SPEC_CASES))
def test_speculative_accept_preserves_target(case):
    p, q = SPEC_CASES[case]
    outs, n_acc = _run_accept(p, q, 12000)
    _check_positions(outs, p)
    # P(first draft accepted) = sum_x min(p0(x), q0(x)) = 1 - TV(p0, q0)
    expected = float(torch.minimum(p[0], q[0]).sum())
    hits = sum(n >= 1 for n in n_acc)
    if expected >= 1 - 1e-6:
        assert hits == len(n_acc)
    else:
        assert binomtest(hits, len(n_acc), expected).pvalue > P_MIN


def test_speculative_accept_no_draft_samples_target():
    p = _rows([0.1, 0.7, 0.2])
    rng = make_rng(1)
    draws = []
    for _ in range(3000):
        n, nxt = speculative_accept([], torch.zeros(0, 3), p, rng)
        assert n == 0
        draws.append(nxt)
    assert chi2_pvalue(np.bincount(draws, minlength=3), p[0].numpy()) > P_MIN


def test_residual_distribution():
    p, q = torch.tensor([0.5, 0.3, 0.2]), torch.tensor([0.2, 0.5, 0.3])
    assert torch.allclose(residual_distribution(p, q), torch.tensor([1.0, 0.0, 0.0]))
    p, q = torch.tensor([0.4, 0.4, 0.2]), torch.tensor([0.1, 0.1, 0.8])
    assert torch.allclose(residual_distribution(p, q), torch.tensor([0.5, 0.5, 0.0]))
    assert torch.allclose(residual_distribution(p, p), p)


def test_deterministic_drafts_always_accepted_when_target_agrees():
    p = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
    q = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    for s in range(50):
        assert speculative_accept([1, 2], q, p, make_rng(s)) == (2, 0)
    # target puts zero mass on the draft: always rejected, replacement from p
    for s in range(50):
        assert speculative_accept([0, 2], q * 0 + torch.tensor([1.0, 0, 0]), p, make_rng(s)) == (0, 1)


# ---- end to end: speculative sampling == autoregressive sampling ---------------------------

V_SMALL = 12
N_SAMPLES = 1200
PROMPT = [1, 5, 3, 7, 1, 5, 3, 9]


def _runtime(hf) -> Runtime:
    # Runtime directly: SelfSpecModel's fingerprint currently needs >= 64 tokens (see
    # test_load_tiny_vocabulary) and these tests need a tiny vocabulary.
    return Runtime.from_state_dict(ModelSpec.from_hf_config(hf.config), hf.state_dict(), hf.config)


@pytest.fixture(scope="module")
def small():
    out = {}
    for arch in ("llama", "gemma3"):
        hf = build_hf(arch, seed=0, vocab_size=V_SMALL)
        out[arch] = (hf, _runtime(hf))
    draft_hf = build_hf("llama", seed=9, vocab_size=V_SMALL, num_layers=1)
    out["draft"] = _runtime(draft_hf)
    return out


def _exact(hf, prompt, sampling: SamplingConfig, n: int = 4) -> np.ndarray:
    """The exact autoregressive joint distribution of the first n new tokens [V]*n, from
    transformers' logits through the same transform."""
    V = V_SMALL
    joint = np.array(1.0)
    for depth in range(n):
        seqs = [list(prompt) + list(c) for c in itertools.product(range(V), repeat=depth)]
        with torch.no_grad():
            logits = hf(torch.tensor(seqs), use_cache=False).logits[:, -1].float()
        p = probs_from_logits(logits, sampling).double().numpy()  # [V^depth, V]
        joint = joint.reshape(-1, 1) * p
    return joint.reshape([V] * n)


E2E = [
    ("autoregressive", "llama", dict(strategy="autoregressive"), dict(temperature=1.0)),
    ("early-exit", "llama", dict(strategy="early-exit", exit_layer=2, num_speculations=2), dict(temperature=1.0)),
    ("layer-skip", "gemma3", dict(strategy="layer-skip", skip_mlp=(1, 2), num_speculations=3), dict(temperature=1.0)),
    ("early-exit-topk", "gemma3", dict(strategy="early-exit", exit_layer=1, num_speculations=3), dict(temperature=1.0, top_k=4)),
    ("layer-skip-topp", "llama", dict(strategy="layer-skip", skip_attn=(1,), skip_mlp=(3,), num_speculations=2),
     dict(temperature=1.0, top_p=0.8)),
    ("early-exit-vocab-t0.7", "llama", dict(strategy="early-exit", exit_layer=3, num_speculations=3, draft_vocab=6),
     dict(temperature=0.7)),
    ("prompt-lookup", "gemma3", dict(strategy="prompt-lookup", num_speculations=3), dict(temperature=1.0)),
    ("draft-model", "llama", dict(strategy="draft-model", draft_model="tiny", num_speculations=3), dict(temperature=1.2, top_k=6)),
    # auto (the default strategy) gating a self-draft, and gating prompt lookup (the default model's profile)
    ("auto", "llama", dict(strategy="auto", base=DraftConfig("early-exit", exit_layer=1, num_speculations=3)), dict(temperature=1.0)),
    ("auto-lookup", "gemma3", dict(strategy="auto", base=DraftConfig("prompt-lookup", num_speculations=2)),
     dict(temperature=0.9, top_p=0.9)),
    # "-dense": every distribution as a dense Softmax row (CAP = 0), the path of temperature-only
    # sampling and of large nuclei on a real vocabulary, incl. restricted and point-mass drafts
    ("early-exit-vocab-dense", "llama", dict(strategy="early-exit", exit_layer=3, num_speculations=3, draft_vocab=6),
     dict(temperature=0.7)),
    ("layer-skip-topp-dense", "llama", dict(strategy="layer-skip", skip_attn=(1,), skip_mlp=(3,), num_speculations=2),
     dict(temperature=1.0, top_p=0.8)),
    ("prompt-lookup-dense", "gemma3", dict(strategy="prompt-lookup", num_speculations=3), dict(temperature=1.0)),
    ("draft-model-dense", "llama", dict(strategy="draft-model", draft_model="tiny", num_speculations=3),
     dict(temperature=1.2, top_k=6)),
    # "-torch": the fallback (no C library: SELFSPEC_NO_KERNELS=1), full probability vectors
    ("early-exit-vocab-topp-torch", "llama", dict(strategy="early-exit", exit_layer=3, num_speculations=3, draft_vocab=6),
     dict(temperature=0.7, top_p=0.9)),
]


def _e2e_drafter(rt, cfg: DraftConfig, draft_rt):
    if cfg.strategy != "auto":
        return make_drafter(rt, cfg, (), draft_rt)
    rows = (1, 2, 3, 5, 9, 17)  # modelled costs: drafting pays at good acceptance, not at bad
    costs = CostModel(rt.num_layers, {r: 0.5 for r in rows}, {r: 0.5 for r in rows}, {r: 0.2 for r in rows})
    return AutoDrafter(rt, cfg, base=make_drafter(rt, cfg.base, (), draft_rt), costs=costs, timing=False)


@pytest.mark.parametrize("coupling", COUPLINGS)
@pytest.mark.parametrize("name,arch,draft_kw,sampling_kw", E2E, ids=[e[0] for e in E2E])
def test_speculative_sampling_matches_autoregressive_distribution(small, name, arch, draft_kw, sampling_kw, coupling, monkeypatch):
    """Both couplings: rejection sampling (accept with min(1, p/q), resample) and Gumbel-max
    (the target's Gumbel argmax with the seed's noise, whatever the draft) sample exactly p."""
    hf, rt = small[arch]
    if name.endswith("-dense"):
        monkeypatch.setattr(sampling_mod, "CAP", 0)
    if name.endswith("-torch"):  # sampling's torch fallback (the model keeps its kernels: chosen when it loaded)
        monkeypatch.setattr(kernels, "sampling_functions", lambda: None)
    cfg = DraftConfig(**draft_kw)
    drafter = _e2e_drafter(rt, cfg, small["draft"])
    if cfg.draft_vocab is not None:
        drafter.set_draft_vocab(torch.arange(cfg.draft_vocab))
    exact = _exact(hf, PROMPT, SamplingConfig(**sampling_kw))
    V = V_SMALL
    counts = np.zeros([V] * 4)
    drafted = accepted = 0
    for seed in range(N_SAMPLES):
        res = generate(rt, drafter, PROMPT, GenerationConfig(4), SamplingConfig(seed=seed, coupling=coupling, **sampling_kw))
        assert len(res.token_ids) == 4
        counts[tuple(res.token_ids)] += 1
        drafted += res.stats.drafted
        accepted += res.stats.accepted
    if cfg.speculative:  # the test exercises both acceptance and rejection
        assert 0 < accepted < drafted, (accepted, drafted)
    p_joint3 = chi2_pvalue(counts.sum(3), exact.sum(3))
    p_t3 = chi2_pvalue(counts.sum((0, 1, 2)), exact.sum((0, 1, 2)))
    p_t12 = chi2_pvalue(counts.sum((0, 3)), exact.sum((0, 3)))
    assert min(p_joint3, p_t3, p_t12) > P_MIN, (p_joint3, p_t3, p_t12)


# ---- reproducibility ---------------------------------------------------------------------------


REPRO = [
    dict(strategy="autoregressive"),
    dict(strategy="auto"),  # the default: rejection: its decisions must not depend on timing; gumbel: the text does not depend on them
    dict(strategy="early-exit", exit_layer=2, num_speculations=3),
    dict(strategy="layer-skip", skip_mlp=[1], num_speculations=5),
    dict(strategy="prompt-lookup"),
    dict(strategy="early-exit", exit_layer=2, draft_threshold=0.3),
    dict(strategy="early-exit", exit_layer=2, adaptive=True),
]


@pytest.mark.parametrize("coupling", COUPLINGS)
@pytest.mark.parametrize("kw", REPRO, ids=["ar", "auto", "ee", "ls", "pl", "threshold", "adaptive"])
def test_same_seed_same_output(kw, coupling):
    """Same seed -> same tokens, on repeated calls of one model and on a fresh load (either
    coupling; test_seeded: with Gumbel-max, also the same tokens whatever drafts them)."""
    hf = build_hf("qwen3", seed=0)
    m = selfspec.load(hf, dtype="float32")
    fresh = selfspec.load(hf, dtype="float32")
    prompt = prompts(n=1)[0]
    for seed in range(3):
        for top_k in (None, 20):
            opts = dict(max_new_tokens=30, temperature=1.0, top_k=top_k, seed=seed, coupling=coupling, **kw)
            runs = [m.generate(prompt, **opts).token_ids for _ in range(3)]
            again = fresh.generate(prompt, **opts).token_ids
            assert runs[0] == runs[1] == runs[2] == again, f"seed {seed}, top_k {top_k}"
    others = {tuple(m.generate(prompt, max_new_tokens=24, temperature=1.0, seed=s, coupling=coupling, **kw).token_ids) for s in range(4)}
    assert len(others) > 1  # the seed matters


def test_seed_none_samples_differ():
    hf = build_hf("llama", seed=3)
    m = selfspec.load(hf, dtype="float32")
    outs = {tuple(m.generate([3, 4, 5], max_new_tokens=16, temperature=1.5, strategy="autoregressive").token_ids) for _ in range(4)}
    assert len(outs) > 1


def test_greedy_ignores_seed():
    hf = build_hf("llama", seed=3)
    m = selfspec.load(hf, dtype="float32")
    a = m.generate([3, 4, 5], max_new_tokens=16, seed=1, strategy="autoregressive").token_ids
    b = m.generate([3, 4, 5], max_new_tokens=16, seed=2, strategy="early-exit", exit_layer=2).token_ids
    assert a == b

