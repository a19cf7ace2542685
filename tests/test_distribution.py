"""Speculative sampling preserves the target distribution, strategy by strategy: auto, exit
adapters with lookup-first, thresholds (adaptive) with a restricted draft vocabulary; all in
bfloat16, what users run on the CPU (the fused kernels where they build: also ~4x cheaper
per sample than float32 on a tiny model, which 16,300 samples per test need; test_sampling
covers the float32 strategies).

Each test samples short continuations with a strategy, a different seed per sample (Gumbel-max
coupling, the default: a seed's text is plain sampling's; the default strategy and the quantized
draft with rejection sampling too), and
compares the distribution of the 2nd and 3rd new tokens (the first speculative step: drafts,
acceptance, residual and bonus tokens) with the *exact* distribution of plain sampling,
computed by enumerating every prefix on a tiny model with a 12-token vocabulary. An exact
reference has no sampling noise, so one sampled arm suffices (and no seed is shared with
anything). Seeds are fixed: each test is deterministic.

The statistic is Pearson's chi-square against the exact probabilities; its power against a
total-variation error is checked by test_the_sample_size_detects_a_tv_error_of_0_03.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import selfspec
from selfspec.adapter import AdapterMeta, ExitAdapter, save_adapter
from selfspec.config import COUPLINGS, DraftConfig, GenerationConfig, SamplingConfig
from selfspec.engine import generate
from selfspec.predictor.costs import CostModel

from helpers import build_hf
from test_kernels import needs_kernels

V = 12  # tokens: at most 12 cells per position, df <= 11
PROMPT = [1, 2, 3, 4, 1, 2]  # a repeat: prompt lookup has n-grams to copy
NEW = 4  # the first step drafts min(K, NEW - 2) = 2 tokens after the prefill's token
POSITIONS = (1, 2)  # new tokens whose marginal distributions are tested
TV = 0.03  # the total-variation error each test must detect
# Seeds are fixed, so a test's outcome is fixed; ALPHA is the chance that a correct sampler
# still fails with the seeds chosen (once, then always): essentially impossible.
ALPHA = 1e-5  # per test, split over POSITIONS (Bonferroni)
POWER = 0.95  # the chance that a sampler TV away from the target fails
# Pearson's statistic on k <= 12 cells against the exact p has noncentrality
# lambda = n * chi2(q || p) >= n * (2 TV)^2 (Cauchy-Schwarz: (sum |q - p|)^2 <= sum (q - p)^2 / p).
# P(noncentral chi2(11, 4 n TV^2) > chi2.isf(ALPHA / 2, 11)) >= 0.95 needs n >= 16,245
# (power 0.99 would need 19,415, and 21,525 at ALPHA = 1e-6; a sample costs 1.5-4 ms here):
N_SAMPLES = 16_300
MIN_EXPECTED = 5  # cells expected fewer times are pooled into one


def _exact_marginals(model, prompt: list[int], sampling: SamplingConfig) -> list[np.ndarray]:
    """P(new token j = t) under plain sampling for j in POSITIONS, by enumerating every
    prefix (V^2 forward passes), in float64 from the runtime's own logits."""
    rt = model.runtime
    depth = max(POSITIONS)

    def dist(logits: torch.Tensor) -> torch.Tensor:  # temperature, then top-k (transformers' order)
        z = logits.double() / sampling.temperature
        if sampling.top_k is not None:
            z = z.masked_fill(z < z.topk(sampling.top_k).values[-1], -math.inf)
        return z.softmax(-1)

    marginals = [torch.zeros(V, dtype=torch.float64) for _ in range(depth + 1)]
    with torch.inference_mode():
        for prefix in np.ndindex(*([V] * depth)):
            ids = prompt + list(prefix)
            logits = rt.forward(torch.tensor(ids), 0, rt.new_cache(len(ids) + 1))  # [len, V]
            probs = [dist(logits[len(prompt) - 1 + j]) for j in range(depth + 1)]
            weight = 1.0  # P(new tokens 0..j-1 = prefix[:j]) times, cumulatively
            for j in range(depth + 1):
                if all(t == 0 for t in prefix[j:]):  # count each shorter prefix once
                    marginals[j] += weight * probs[j]
                if j < depth:
                    weight *= probs[j][prefix[j]].item()
    return [marginals[j].numpy() for j in POSITIONS]


def _chi_square_p(counts: np.ndarray, probs: np.ndarray) -> float:
    """p-value of Pearson's test of counts against exact probs; tokens outside the support
    (top-k) must never occur, rare cells are pooled."""
    from scipy.stats import chi2

    n = counts.sum()
    assert counts[probs == 0].sum() == 0, "a token outside the support was sampled"
    expected = n * probs
    keep = expected >= MIN_EXPECTED
    obs, exp = list(counts[keep]), list(expected[keep])
    if (~keep).any():
        obs.append(counts[~keep].sum())
        exp.append(expected[~keep].sum())
    obs, exp = np.array(obs, dtype=float), np.array(exp)
    stat = float(((obs - exp) ** 2 / np.maximum(exp, 1e-300)).sum())
    return float(chi2.sf(stat, len(obs) - 1))


class _Steps:
    """Wraps a drafter's `accepted` to record (k, drafted, accepted) of every step."""

    def __init__(self, drafter):
        self.log: list[tuple[int, int, int]] = []
        inner = drafter.accepted

        def accepted(step, draft, n):
            self.log.append((step.k, len(draft.tokens), n))
            inner(step, draft, n)

        drafter.accepted = accepted


def _sample(model, drafter, sampling: SamplingConfig, seed0: int, on_sample=None) -> list[np.ndarray]:
    counts = [np.zeros(V, dtype=np.int64) for _ in POSITIONS]
    rt = model.runtime
    for i in range(N_SAMPLES):
        s = SamplingConfig(sampling.temperature, sampling.top_k, sampling.top_p, seed=seed0 + i, coupling=sampling.coupling)
        out = generate(rt, drafter, PROMPT, GenerationConfig(NEW), s, eos_ids=())
        for c, j in zip(counts, POSITIONS):
            c[out.token_ids[j]] += 1
        if on_sample is not None:
            on_sample(out)
    return counts


def _check(model, drafter, sampling: SamplingConfig, seed0: int, on_sample=None) -> _Steps:
    steps = _Steps(drafter)
    counts = _sample(model, drafter, sampling, seed0, on_sample)
    exact = _exact_marginals(model, PROMPT, sampling)
    for j, c, p in zip(POSITIONS, counts, exact):
        pv = _chi_square_p(c, p)
        tv = 0.5 * np.abs(c / c.sum() - p).sum()
        assert pv > ALPHA / len(POSITIONS), f"new token {j}: p = {pv:.2e}, empirical TV {tv:.4f}"
    drafted = sum(d for _, d, _ in steps.log)
    accepted = sum(n for _, _, n in steps.log)
    assert 0 < accepted < drafted, "both accepted and rejected drafts must occur"
    return steps


def _tiny():
    return selfspec.load(build_hf("llama", seed=4, num_layers=3, vocab_size=V, initializer_range=0.6), dtype="bfloat16")


@pytest.fixture(scope="module")
def tiny():
    return _tiny()


def _count_draft_sources(d) -> list[int]:
    """[drafts from the model, drafts from prompt lookup] of a lookup-first drafter, as it drafts."""
    counts = [0, 0]
    draft = d.draft

    def counting(step):
        out = draft(step)
        if out.tokens:
            counts[out.copied] += 1
        return out

    d.draft = counting
    return counts


def test_the_sample_size_detects_a_tv_error_of_0_03():
    from scipy.stats import chi2, ncx2

    df = V - 1  # the most cells a position can have; fewer cells only add power
    crit = chi2.isf(ALPHA / len(POSITIONS), df)
    assert ncx2.sf(crit, df, N_SAMPLES * (2 * TV) ** 2) >= POWER


@pytest.mark.parametrize("coupling", COUPLINGS)
def test_auto_preserves_the_distribution(tiny, coupling):
    """auto gating early exit with a restricted draft vocabulary; costs where drafting pays at
    the prior acceptance but not after rejections, so its per-step choice of k varies with
    what it observed (and with it how the RNG is consumed, under rejection sampling)."""
    cfg = DraftConfig("auto", base=DraftConfig("early-exit", exit_layer=1, num_speculations=3))
    rows = (1, 2, 3, 5, 9, 17)
    costs = CostModel(3, {r: 0.5 for r in rows}, {r: 0.5 for r in rows}, {r: 1.0 for r in rows})
    tiny.resources.cost_model = lambda heads=(), bits=(): costs
    d = tiny.drafter(cfg)
    decisions: set = set()
    steps = _check(tiny, d, SamplingConfig(temperature=1.0, coupling=coupling), seed0=1_000_000,
                   on_sample=lambda out: decisions.update(d.decisions))
    assert 0 in decisions and any(k > 0 for k in decisions), decisions


def test_exit_adapter_with_lookup_first_preserves_the_distribution(tiny, tmp_path):
    """An exit adapter with attention behind prompt lookup: some steps draft the lookup's
    copy (a point mass q), the others the adapter's sample. Temperature and top-k apply to
    drafts and target alike."""
    a = ExitAdapter(AdapterMeta(exit_layer=2, hidden_size=tiny.spec.hidden_size, inner_size=16, heads=2, head_dim=8))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        a.down.copy_(torch.randn(a.down.shape, generator=g) * 0.5)
        a.out.copy_(torch.randn(a.out.shape, generator=g) * 0.5)
    save_adapter(a, tmp_path / "adapter.safetensors")
    d = tiny.drafter(DraftConfig("exit-adapter", adapter=str(tmp_path / "adapter.safetensors"), num_speculations=3, lookup_first=True))
    from_lookup = _count_draft_sources(d)
    _check(tiny, d, SamplingConfig(temperature=0.8, top_k=9), seed0=2_000_000)
    assert min(from_lookup) > 0, from_lookup


def test_threshold_adaptive_and_draft_vocab_preserve_the_distribution(tiny):
    """Early exit that stops drafting below an adaptive confidence threshold, drafting over
    the 8 most frequent tokens only (q is zero outside them)."""
    tiny.set_token_frequencies(torch.randperm(V, generator=torch.Generator().manual_seed(3)))
    d = tiny.drafter(DraftConfig("early-exit", exit_layer=1, num_speculations=3, draft_threshold=0.5, adaptive=True, draft_vocab=8))
    steps = _check(tiny, d, SamplingConfig(temperature=1.0), seed0=3_000_000)
    assert any(k > 0 and drafted < k for k, drafted, _ in steps.log), "the threshold never stopped a draft"




@needs_kernels
@pytest.mark.parametrize("coupling", COUPLINGS)
def test_quantized_with_lookup_first_preserves_the_distribution(tiny, coupling):
    """An int4 copy of the model's weights drafting behind prompt lookup: the copies are
    guesses of its own sampled drafts (draft_guessed), never drafts themselves; rejections
    often enough on this tiny model."""
    d = tiny.drafter(DraftConfig("quantized", draft_bits=4, num_speculations=3, lookup_first=True))
    sources = _count_draft_sources(d)
    guessed = []
    draft_guessed = d.inner.draft_guessed
    d.inner.draft_guessed = lambda step, guess=None: (guessed.append(guess is not None), draft_guessed(step, guess))[1]
    _check(tiny, d, SamplingConfig(temperature=0.9, top_k=8, coupling=coupling), seed0=4_000_000)
    assert sources[0] > 0 and sources[1] == 0, sources
    assert any(guessed), "no draft had a lookup guess"
