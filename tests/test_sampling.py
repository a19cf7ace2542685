"""Sampling: the logits transform, the speculative acceptance rule, and end to end
distribution preservation (speculative sampling must sample exactly the autoregressive
distribution), plus seed reproducibility.

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
from selfspec.config import DraftConfig, GenerationConfig, SamplingConfig
from selfspec.drafters import make_drafter
from selfspec.engine import generate
from selfspec.errors import SelfSpecError
from selfspec.runtime import Runtime
from selfspec.sampling import make_rng, probs_from_logits, sample
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
]


@pytest.mark.parametrize("name,arch,draft_kw,sampling_kw", E2E, ids=[e[0] for e in E2E])
def test_speculative_sampling_matches_autoregressive_distribution(small, name, arch, draft_kw, sampling_kw):
    hf, rt = small[arch]
    cfg = DraftConfig(**draft_kw)
    drafter = make_drafter(rt, cfg, (), small["draft"])
    if cfg.draft_vocab is not None:
        drafter.set_draft_vocab(torch.arange(cfg.draft_vocab))
    exact = _exact(hf, PROMPT, SamplingConfig(**sampling_kw))
    V = V_SMALL
    counts = np.zeros([V] * 4)
    drafted = accepted = 0
    for seed in range(N_SAMPLES):
        res = generate(rt, drafter, PROMPT, GenerationConfig(4), SamplingConfig(seed=seed, **sampling_kw))
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
    dict(),  # the default, auto: its decisions must not depend on timing when sampling
    dict(strategy="early-exit", exit_layer=2, num_speculations=3),
    dict(strategy="layer-skip", skip_mlp=[1], num_speculations=5),
    dict(strategy="prompt-lookup"),
    dict(strategy="early-exit", exit_layer=2, draft_threshold=0.3),
    dict(strategy="early-exit", exit_layer=2, adaptive=True),
]


@pytest.mark.parametrize("kw", REPRO, ids=["ar", "auto", "ee", "ls", "pl", "threshold", "adaptive"])
def test_same_seed_same_output(kw):
    """Same seed -> same tokens, on repeated calls of one model and on a fresh load."""
    hf = build_hf("qwen3", seed=0)
    m = selfspec.load(hf, dtype="float32")
    fresh = selfspec.load(hf, dtype="float32")
    prompt = prompts(n=1)[0]
    for seed in range(3):
        for top_k in (None, 20):
            opts = dict(max_new_tokens=30, temperature=1.0, top_k=top_k, seed=seed, **kw)
            runs = [m.generate(prompt, **opts).token_ids for _ in range(3)]
            again = fresh.generate(prompt, **opts).token_ids
            assert runs[0] == runs[1] == runs[2] == again, f"seed {seed}, top_k {top_k}"
    others = {tuple(m.generate(prompt, max_new_tokens=24, temperature=1.0, seed=s, **kw).token_ids) for s in range(4)}
    assert len(others) > 1  # the seed matters


def test_seed_none_samples_differ():
    hf = build_hf("llama", seed=3)
    m = selfspec.load(hf, dtype="float32")
    outs = {tuple(m.generate([3, 4, 5], max_new_tokens=16, temperature=1.5).token_ids) for _ in range(4)}
    assert len(outs) > 1


def test_greedy_ignores_seed():
    hf = build_hf("llama", seed=3)
    m = selfspec.load(hf, dtype="float32")
    a = m.generate([3, 4, 5], max_new_tokens=16, seed=1).token_ids
    b = m.generate([3, 4, 5], max_new_tokens=16, seed=2, strategy="early-exit", exit_layer=2).token_ids
    assert a == b
