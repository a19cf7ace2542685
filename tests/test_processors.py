"""Issue 46: logits processors (presence / frequency / repetition penalties, logit_bias, min_p,
a grammar's mask) and logprobs, exact under speculation.

- the processors' definitions against independent references (transformers' own processors
  where it has them, OpenAI's formulas written out);
- greedy speculative == autoregressive under each processor, on every architecture's tiny
  model, solo and in a batch;
- seeded sampling with the Gumbel coupling: speculative == autoregressive, token for token;
- sampling exactness: Pearson's chi-square against the exact autoregressive distribution
  (enumerated, the processors applied by code written here), with the rejection coupling, and
  with a context-dependent mask that forces tokens (free drafts) and rolls back;
- logprobs equal a reference from transformers' plain forward pass.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import selfspec
from selfspec.config import DraftConfig, GenerationConfig, SamplingConfig
from selfspec.engine import generate
from selfspec.processors import Processing
from selfspec.sampling import SubVocab

from helpers import ARCHS, ar_generate, build_hf, hf_logits, prompts
from test_distribution import ALPHA, N_SAMPLES, NEW, POSITIONS, PROMPT, V, _chi_square_p

PROCESSORS = {
    "penalties": dict(presence_penalty=0.7, frequency_penalty=0.4),
    "repetition": dict(repetition_penalty=1.6),
    "bias": dict(logit_bias={3: 4.0, 7: -100.0, 11: 2.5}),
    "all": dict(presence_penalty=-0.5, frequency_penalty=0.8, repetition_penalty=0.7, logit_bias={5: 3.0}, min_p=0.05),
}
STRATEGIES = (dict(strategy="early-exit", exit_layer=2), dict(strategy="layer-skip", skip_mlp=(1, 2)),
              dict(strategy="prompt-lookup"))


def reference_row(z: torch.Tensor, prompt: list[int], generated: list[int], s: SamplingConfig) -> torch.Tensor:
    """processors.py's definition, written out independently (fp64)."""
    z = z.double().clone()
    for t, b in (s.logit_bias.items if s.logit_bias else ()):
        z[t] += b
    if s.repetition_penalty != 1.0:
        for t in set(prompt) | set(generated):
            z[t] = z[t] / s.repetition_penalty if z[t] > 0 else z[t] * s.repetition_penalty
    for t in set(generated):
        z[t] -= s.presence_penalty + s.frequency_penalty * generated.count(t)
    return z


# ---- the definitions ---------------------------------------------------------------------


def test_processors_match_their_references():
    from transformers import MinPLogitsWarper, RepetitionPenaltyLogitsProcessor

    g = torch.Generator().manual_seed(0)
    Vb = 50
    prompt, generated = [1, 2, 3, 2], [4, 4, 9, 2]
    z = torch.randn(Vb, generator=g) * 3
    s = SamplingConfig(presence_penalty=0.6, frequency_penalty=0.3, repetition_penalty=1.4, logit_bias={9: 5.0, 0: -2.0})
    proc = Processing(s, GenerationConfig(), prompt, Vb)
    proc.commit(generated)
    assert torch.allclose(proc.row(z).double(), reference_row(z, prompt, generated, s), atol=1e-5)
    # drafts count like committed tokens, and leave the committed state as it was
    proc2 = Processing(s, GenerationConfig(), prompt, Vb)
    proc2.commit(generated[:2])
    assert torch.equal(proc2.row(z, generated[2:]), proc.row(z))
    assert torch.allclose(proc2.row(z).double(), reference_row(z, prompt, generated[:2], s), atol=1e-5)
    # transformers' repetition penalty over the whole input
    rep = SamplingConfig(repetition_penalty=1.4)
    p = Processing(rep, GenerationConfig(), prompt, Vb)
    p.commit(generated)
    want = RepetitionPenaltyLogitsProcessor(1.4)(torch.tensor([prompt + generated]), z[None].clone())[0]
    assert torch.allclose(p.row(z), want)
    # min_p: p >= min_p * p_max after temperature (transformers' MinP keeps the same tokens)
    mp = SamplingConfig(temperature=1.5, min_p=0.2)
    kept = torch.isfinite(Processing(mp, GenerationConfig(), prompt, Vb).row(z / 3))
    want = torch.isfinite(MinPLogitsWarper(0.2)(None, (z / 3 / 1.5)[None].clone())[0])
    assert torch.equal(kept, want) and 1 < int(kept.sum()) < Vb
    # a restricted draft head sees the same values at its tokens
    sub = SubVocab(torch.tensor([0, 2, 4, 9, 30]), Vb)
    assert torch.equal(proc.row(z[sub.ids], sub=sub), proc.row(z)[sub.ids])


def test_penalty_rows_are_bit_identical_over_overlapping_drafts():
    """A verify row after drafts that repeat committed tokens equals, bit for bit, the
    autoregressive row after committing those drafts: a token both committed and drafted loses
    its penalty in one subtraction on both paths (two would round twice: an ulp apart in about
    a third of such cases)."""
    g = torch.Generator().manual_seed(1)
    Vb, trials, overlapped = 40, 300, 0
    for i in range(trials):
        s = SamplingConfig(presence_penalty=float(torch.rand(1, generator=g)) * 2 - 0.5,
                           frequency_penalty=float(torch.rand(1, generator=g)) * 1.7 + 0.01,
                           repetition_penalty=(1.0, 1.3)[i % 2], logit_bias={3: 0.7} if i % 3 == 0 else None)
        committed = torch.randint(0, 8, (int(torch.randint(1, 9, (1,), generator=g)),), generator=g).tolist()
        draft = torch.randint(0, 8, (int(torch.randint(1, 7, (1,), generator=g)),), generator=g).tolist()
        overlapped += bool(set(committed) & set(draft))
        z = torch.randn(len(draft) + 1, Vb, generator=g) * 5
        spec = Processing(s, GenerationConfig(), [1, 2], Vb)
        spec.commit(committed)
        rows = spec.rows(z, draft)
        sub = SubVocab(torch.arange(0, Vb, 2), Vb)
        for j in range(len(draft) + 1):
            ar = Processing(s, GenerationConfig(), [1, 2], Vb)
            ar.commit(committed)
            for t in draft[:j]:  # autoregressive decoding commits one token a step
                ar.commit([t])
            assert torch.equal(rows[j], ar.row(z[j])), (i, j, committed, draft)
            assert torch.equal(spec.row(z[j][sub.ids], draft[:j], sub), ar.row(z[j][sub.ids], sub=sub)), (i, j)
    assert overlapped > trials // 2  # the drafts do repeat committed tokens


def test_penalised_logprobs_are_identical_on_every_strategy(zoo):
    """End to end: with penalties, every strategy's verify rows are the autoregressive rows, bit
    for bit (the runtime's rows are row invariant; the penalties now are too), so the recorded
    logprobs are equal, not close."""
    _, m = zoo.get("llama")
    opts = dict(presence_penalty=0.3, frequency_penalty=0.45, max_new_tokens=24, logprobs=2)
    for prompt in prompts(n=2):
        ref = ar_generate(m, prompt, **opts)
        assert len(set(ref.token_ids)) < len(ref.token_ids)  # tokens repeat: drafts overlap committed ones
        for strat in STRATEGIES + (dict(strategy="quantized"),):
            out = m.generate(prompt, **strat, **opts)
            assert out.token_ids == ref.token_ids, strat
            assert [e.logprob for e in out.logprobs] == [e.logprob for e in ref.logprobs], strat


# ---- greedy: speculative == autoregressive -----------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_speculative_equals_autoregressive_under_each_processor(zoo, arch):
    _, m = zoo.get(arch)
    for name, opts in PROCESSORS.items():
        changed = False
        for prompt in prompts(n=2):
            ref = ar_generate(m, prompt, max_new_tokens=24, **opts)
            changed |= ref.token_ids != ar_generate(m, prompt, max_new_tokens=24).token_ids
            for strat in STRATEGIES:
                out = m.generate(prompt, max_new_tokens=24, **strat, **opts)
                assert out.token_ids == ref.token_ids, (arch, name, strat)
        assert changed or name != "bias", "the bias changed nothing"
        batch = m.generate_batch(prompts(n=3), max_new_tokens=16, **STRATEGIES[0], **opts)
        for p, r in zip(prompts(n=3), batch):
            assert r.token_ids == ar_generate(m, p, max_new_tokens=16, **opts).token_ids, (arch, name, "batch")
    # a banned token never appears; a boosted one appears
    out = m.generate(prompts()[0], max_new_tokens=24, **STRATEGIES[0], logit_bias={7: -100.0, 11: 100.0})
    assert 7 not in out.token_ids and set(out.token_ids) == {11}


def test_seeded_gumbel_speculative_equals_autoregressive_under_processors(zoo):
    _, m = zoo.get("llama")
    for opts in PROCESSORS.values():
        for seed in range(4):
            kw = dict(temperature=0.9, top_k=40, seed=seed, max_new_tokens=20, **opts)
            ref = ar_generate(m, prompts()[0], **kw)
            for strat in STRATEGIES[:2]:
                assert m.generate(prompts()[0], **strat, **kw).token_ids == ref.token_ids, (opts, strat, seed)
            batch = m.generate_batch([prompts()[0]] * 2, **STRATEGIES[0], **kw)
            assert all(r.token_ids == ref.token_ids for r in batch)


# ---- sampling: the exact distribution ------------------------------------------------------


class ToyGrammar:
    """A context-dependent mask with forced tokens, rolled back like grammar.Matcher: token 0 is
    never allowed, no token may follow itself, and after token 5 only token 6 may come (a forced
    token: drafted for free)."""

    def __init__(self, prompt: list[int]):
        self.tokens = list(prompt)

    @staticmethod
    def mask(context: list[int]) -> torch.Tensor:
        allowed = torch.ones(V, dtype=torch.bool)
        allowed[0] = False
        if context[-1] == 5:
            allowed[:] = False
            allowed[6] = True
        else:
            allowed[context[-1]] = False
        return allowed

    def allowed(self, drafted=()):
        return self.mask(self.tokens + list(drafted))

    def commit(self, tokens):
        self.tokens += list(tokens)

    def forced(self, most):
        chain = []
        while len(chain) < most and int(self.allowed(chain).sum()) == 1:
            chain.append(int(torch.nonzero(self.allowed(chain))[0]))
        return chain, len(chain)


def _exact(model, s: SamplingConfig, grammar: bool) -> list[np.ndarray]:
    """P(new token j = t) of autoregressive sampling under s (processors applied per prefix by
    reference_row, the toy grammar's mask), by enumerating every prefix."""
    rt, depth = model.runtime, max(POSITIONS)

    def dist(z, generated):
        z = reference_row(z, PROMPT, generated, s)
        if grammar:
            z = z.masked_fill(~ToyGrammar.mask(PROMPT + generated), -math.inf)
        x = z / s.temperature
        if s.min_p:
            x = x.masked_fill(x < x.max() + math.log(s.min_p), -math.inf)
        return x.softmax(-1)

    marginals = [torch.zeros(V, dtype=torch.float64) for _ in range(depth + 1)]
    with torch.inference_mode():
        for prefix in np.ndindex(*([V] * depth)):
            ids = PROMPT + list(prefix)
            logits = rt.forward(torch.tensor(ids), 0, rt.new_cache(len(ids) + 1))
            weight = 1.0
            for j in range(depth + 1):
                p = dist(logits[len(PROMPT) - 1 + j].float(), list(prefix[:j]))
                if all(t == 0 for t in prefix[j:]):
                    marginals[j] += weight * p
                if j < depth:
                    weight *= p[prefix[j]].item()
    return [marginals[j].numpy() for j in POSITIONS]


def _check_distribution(model, drafter, s: SamplingConfig, grammar: bool, seed0: int) -> dict:
    counts = [np.zeros(V, dtype=np.int64) for _ in POSITIONS]
    totals = {"drafted": 0, "accepted": 0, "free": 0}
    for i in range(N_SAMPLES):
        si = SamplingConfig(**{**s.__dict__, "seed": seed0 + i})
        gen = GenerationConfig(NEW)
        proc = Processing(si, gen, PROMPT, V, ToyGrammar(PROMPT) if grammar else None)
        out = generate(model.runtime, drafter, PROMPT, gen, si, eos_ids=(), proc=proc)
        for c, j in zip(counts, POSITIONS):
            c[out.token_ids[j]] += 1
        totals["drafted"] += out.stats.drafted
        totals["accepted"] += out.stats.accepted
        totals["free"] += out.stats.free_accepted
    for j, c, p in zip(POSITIONS, counts, _exact(model, s, grammar)):
        pv = _chi_square_p(c, p)
        assert pv > ALPHA / len(POSITIONS), f"new token {j}: p = {pv:.2e}, TV {0.5 * np.abs(c / c.sum() - p).sum():.4f}"
    assert 0 < totals["accepted"] < totals["drafted"], totals
    return totals


@pytest.fixture(scope="module")
def tiny12():
    return selfspec.load(build_hf("llama", seed=4, num_layers=3, vocab_size=V, initializer_range=0.6), dtype="bfloat16")


def test_sampling_under_processors_is_exact(tiny12):
    """Penalties, bias and min_p with speculative sampling's accept / resample (the rejection
    coupling: its output depends on the draft, its distribution must not)."""
    d = tiny12.drafter(DraftConfig("early-exit", exit_layer=1, num_speculations=3))
    s = SamplingConfig(temperature=1.0, coupling="rejection", presence_penalty=0.8, frequency_penalty=0.5,
                       repetition_penalty=1.3, logit_bias={2: 1.5, 9: -1.0}, min_p=0.02)
    _check_distribution(tiny12, d, s, grammar=False, seed0=5_000_000)


def test_sampling_under_a_grammar_with_forced_tokens_is_exact(tiny12):
    """A mask that depends on the drafts before each position, with forced tokens drafted for
    free (rolled back when a draft is rejected), Gumbel coupling."""
    d = tiny12.drafter(DraftConfig("early-exit", exit_layer=1, num_speculations=3))
    totals = _check_distribution(tiny12, d, SamplingConfig(temperature=1.0), grammar=True, seed0=6_000_000)
    assert totals["free"] > 0, totals


# ---- logprobs ----------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ("llama", "gemma3"))
def test_logprobs_equal_a_plain_forward_pass(zoo, arch):
    """The logprob of every generated token and its top alternatives, from the verify passes,
    equal log-softmax of transformers' logits over prompt + output (greedy: temperature 1;
    sampling: temperature and top-k applied; with a penalty, the penalised logits)."""
    hf, m = zoo.get(arch)
    prompt = prompts()[0]
    cases = [({}, dict(temperature=0.0)), ({}, dict(temperature=0.7, top_k=5, seed=3)),
             (dict(presence_penalty=1.0), dict(temperature=0.0))]
    for opts, samp in cases:
        for strat in (dict(strategy="autoregressive"), STRATEGIES[0]):
            out = m.generate(prompt, max_new_tokens=12, logprobs=3, **strat, **opts, **samp)
            assert len(out.logprobs) == len(out.token_ids)
            logits = hf_logits(hf, prompt + out.token_ids)
            for i, e in enumerate(out.logprobs):
                z = logits[len(prompt) - 1 + i].double()
                z = reference_row(z, prompt, out.token_ids[:i], SamplingConfig(**opts))
                T = samp["temperature"] or 1.0
                x = z / T
                if samp.get("top_k"):
                    x = x.masked_fill(x < x.topk(samp["top_k"]).values[-1], -math.inf)
                ref = x.log_softmax(-1)
                assert e.token == out.token_ids[i]
                assert abs(e.logprob - float(ref[e.token])) < 1e-3, (arch, opts, samp, strat, i)
                top = ref.topk(3)
                assert [t for t, _ in e.top] == top.indices.tolist()
                assert np.allclose([lp for _, lp in e.top], top.values.tolist(), atol=1e-3)
        spec = m.generate(prompt, max_new_tokens=12, logprobs=2, **STRATEGIES[0], **opts, **samp)
        ar = m.generate(prompt, max_new_tokens=12, logprobs=2, strategy="autoregressive", **opts, **samp)
        assert spec.token_ids == ar.token_ids
        assert np.allclose([e.logprob for e in spec.logprobs], [e.logprob for e in ar.logprobs], atol=1e-5)


def test_logprobs_take_the_distribution_acceptance_built(zoo, monkeypatch):
    """Under truncation a row's distribution (a pass over the vocabulary) is built once: the
    logprobs of the tokens a step accepts read the one acceptance built, under either rule;
    only the first token (the prompt pass's row) builds its own. Values as without sharing."""
    from selfspec import logprobs

    hf, m = zoo.get("llama")
    prompt = prompts()[0]
    samp = dict(temperature=0.8, top_p=0.9, seed=5, max_new_tokens=12, logprobs=2, **STRATEGIES[0])
    real, calls = logprobs.distribution, []
    monkeypatch.setattr(logprobs, "distribution", lambda *a, **k: calls.append(1) or real(*a, **k))
    for coupling in ("gumbel", "rejection"):
        calls.clear()
        out = m.generate(prompt, coupling=coupling, **samp)
        assert len(out.logprobs) == len(out.token_ids) == 12 and len(calls) == 1, coupling
        assert m.generate(prompt, coupling=coupling, **{**samp, "logprobs": None}).token_ids == out.token_ids
        logits = hf_logits(hf, prompt + out.token_ids)
        for i, e in enumerate(out.logprobs):  # the nucleus's log-softmax, from a plain forward pass
            x = logits[len(prompt) - 1 + i].double() / 0.8
            p = x.softmax(-1)
            above = (p[None, :] * (p[None, :] > p[:, None])).sum(-1)  # mass strictly more likely than each token
            ref = x.masked_fill(above >= 0.9, -math.inf).log_softmax(-1)
            assert abs(e.logprob - float(ref[e.token])) < 1e-3, (coupling, i)


def test_prompt_logprobs(zoo):
    hf, m = zoo.get("llama")
    prompt = prompts(lengths=(70,))[0]  # more than one chunk of rows
    got = m.prompt_logprobs(prompt, top=2)
    ref = hf_logits(hf, prompt).double().log_softmax(-1)
    assert got[0] is None and len(got) == len(prompt)
    for i in range(1, len(prompt)):
        assert abs(got[i].logprob - float(ref[i - 1, prompt[i]])) < 1e-3
        assert [t for t, _ in got[i].top] == ref[i - 1].topk(2).indices.tolist()
