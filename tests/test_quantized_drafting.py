"""Quantized self-drafting (drafters/quantized.py): the model drafts with a low-bit copy of its
own weights. Losslessness is in the engine's matrix (test_engine) and the distribution tests
(test_distribution); here: what the copy shares and what it costs."""

from __future__ import annotations

import pytest
import torch

import selfspec
from selfspec.config import DraftConfig
from selfspec.drafters import QuantizedDrafter, lookup_first
from selfspec.errors import SelfSpecError
from selfspec.kernels import QuantizedWeight
from selfspec.runtime import Runtime

from helpers import ar_generate, build_hf, looping_model, prompts
from test_kernels import needs_kernels

pytestmark = needs_kernels


@pytest.fixture(scope="module")
def model():
    m = selfspec.load(build_hf("gemma3", seed=3, num_layers=4, hidden_size=128, intermediate_size=256, vocab_size=256,
                               head_dim=32), dtype="bfloat16")
    m.set_token_frequencies(torch.randperm(m.spec.vocab_size, generator=torch.Generator().manual_seed(0)))
    return m


def test_the_draft_shares_the_verifiers_cache(model, monkeypatch):
    """One KV cache per generation: the copy writes its rows into the verifier's cache (which
    verification overwrites), never a cache of its own."""
    made = []
    new_cache = Runtime.new_cache
    monkeypatch.setattr(Runtime, "new_cache", lambda self, n: (made.append(self), new_cache(self, n))[1])
    p = prompts(n=1, vocab=model.spec.vocab_size, lengths=(12,))[0]
    out = model.generate(p, max_new_tokens=24, strategy="quantized", num_speculations=4)
    assert out.stats.drafted > 0 and out.stats.accepted > 0
    assert made == [model.runtime]  # the engine's cache, and no other
    assert out.token_ids == ar_generate(model, p, max_new_tokens=24).token_ids


def test_the_copy_is_made_once_and_shares_all_but_the_matrices(model):
    d1 = model.drafter(DraftConfig("quantized"))
    d2 = model.drafter(DraftConfig("quantized", num_speculations=7, lookup_first=True))
    assert isinstance(d1, QuantizedDrafter) and d1.draft_rt is d2.inner.draft_rt  # one int8 copy for both
    q, rt = d1.draft_rt, model.runtime
    assert q is not rt and q.head is rt.head and q.final_norm is rt.final_norm and q._rope is rt._rope
    assert all(isinstance(L[k], QuantizedWeight) and L[k].bits == 8 for L in q.layers for k in ("wqkv", "wo", "w_gate_up", "w_down"))
    assert all(L["attn_norm"] is M["attn_norm"] for L, M in zip(q.layers, rt.layers))
    assert isinstance(d1.draft_head, QuantizedWeight) and d1.draft_head.shape == (model.spec.hidden_size, model.spec.vocab_size)
    d3 = model.drafter(DraftConfig("quantized", draft_bits=4, head_bits=8, draft_vocab=64))
    assert d3.draft_rt.layers[0]["wo"].bits == 4 and d3.draft_head.bits == 8 and d3.draft_head.shape[1] == 64
    assert model.resources.bounded()["quantized"] == 2


@pytest.mark.parametrize("bits,limit", [(8, 0.55), (4, 0.30)])
def test_extra_bytes(model, bits, limit):
    """The copy's layer matrices against the model's own (bf16): int8 about half, int4 under
    a third (the issue's bounds), scales included."""
    q = model.resources.quantized(bits)
    own = sum(model.runtime.weight(i, k).numel() * 2 for i in range(model.spec.num_layers) for k in ("wqkv", "wo", "w_gate_up", "w_down"))
    extra = sum(L[k].nbytes for L in q.layers for k in ("wqkv", "wo", "w_gate_up", "w_down"))
    assert extra <= limit * own, (extra, own)


def test_draft_agrees_with_the_model(model):
    """An int8 copy agrees with the full model on nearly every greedy token (here a tiny random
    model; ~98-99% on the default model, benchmarks/quant/quant_agreement.py)."""
    ps = prompts(n=4, vocab=model.spec.vocab_size, lengths=(10, 14), seed=5)
    outs = [model.generate(p, max_new_tokens=32, strategy="quantized", num_speculations=4) for p in ps]
    drafted, accepted = sum(o.stats.drafted for o in outs), sum(o.stats.accepted for o in outs)
    assert accepted / drafted > 0.8, (accepted, drafted)


def test_torch_runtimes_say_quantized_drafting_needs_the_kernels(monkeypatch):
    monkeypatch.setenv("SELFSPEC_NO_KERNELS", "1")
    m = selfspec.load(build_hf("llama", seed=0), dtype="float32")
    with pytest.raises(SelfSpecError, match="quantized drafting needs selfspec's CPU kernels"):
        m.generate([1, 2, 3], max_new_tokens=4, strategy="quantized")


def test_copies_are_kept_on_disk_and_read_back(tmp_path, monkeypatch):
    """Made once per machine: a second load reads the same weights back (no quantizer call);
    a file from other quantizer code or a truncated one is ignored and remade."""
    from selfspec import quant, quant_store

    monkeypatch.setenv("SELFSPEC_QUANT_DIR", str(tmp_path))
    hf = build_hf("llama", seed=9, num_layers=2, hidden_size=64, intermediate_size=128, vocab_size=96)
    first = selfspec.load(hf, dtype="bfloat16")
    q1 = first.resources.quantized(4)
    _, h1 = first.resources.draft_head(None, 8)
    files = sorted(p.name for p in tmp_path.iterdir())
    assert len(files) == 2 and all(f.startswith(first.fingerprint) for f in files), files

    calls = []
    real = quant.quantize
    monkeypatch.setattr("selfspec.runtime.quantize", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    second = selfspec.load(hf, dtype="bfloat16")
    q2 = second.resources.quantized(4)
    _, h2 = second.resources.draft_head(None, 8)
    assert calls == []
    for L1, L2 in zip(q1.layers, q2.layers):
        for k in ("wqkv", "wo", "w_gate_up", "w_down"):
            assert torch.equal(L1[k].q, L2[k].q) and torch.equal(L1[k].scale, L2[k].scale) and torch.equal(L1[k].zero, L2[k].zero)
    assert torch.equal(h1.q, h2.q) and torch.equal(h1.scale, h2.scale)
    p = ar_generate(second, [1, 2, 3, 4, 5], max_new_tokens=12)
    assert second.generate([1, 2, 3, 4, 5], max_new_tokens=12, strategy="quantized", draft_bits=4).token_ids == p.token_ids

    layers = next(tmp_path.glob("*layers-int4*"))
    layers.write_bytes(layers.read_bytes()[:1000])  # truncated
    monkeypatch.setattr(quant_store, "quantizer_version", lambda: "other")
    calls.clear()
    third = selfspec.load(hf, dtype="bfloat16")
    third.resources.quantized(4)
    assert len(calls) == 8  # 2 layers x 4 matrices remade
    assert quant_store.load_weights(layers) is not None  # and stored again, whole


@pytest.mark.parametrize("temperature", [0.0, 0.9])
@pytest.mark.parametrize("draft", [dict(strategy="quantized", num_speculations=5, draft_vocab=64),
                                   dict(strategy="quantized", num_speculations=6, draft_bits=4),
                                   dict(strategy="layer-skip", skip_mlp=(1,), num_speculations=4)])
def test_a_guessed_draft_is_the_draft(model, draft, temperature, monkeypatch):
    """draft_guessed (one pass over [last token, guess...], rows used while the guess agrees)
    drafts exactly draft()'s tokens, and when sampling draws them from the same distributions
    with the same random numbers, whatever the guess: right, partly right, wrong, too long,
    empty, or a new guess after each disagreement. And a right guess takes fewer passes."""
    from selfspec.config import SamplingConfig
    from selfspec.drafters.base import Step
    from selfspec.sampling import make_rng

    rt = model.runtime
    drafter = model.drafter(model.draft_config(**draft))
    p = prompts(n=1, vocab=model.spec.vocab_size, lengths=(20,), seed=4)[0]
    sampling = SamplingConfig(temperature=temperature, top_p=0.95 if temperature else None, seed=3)
    calls = []
    orig, orig_step = drafter.draft_rt.run_layers, drafter.draft_rt.step_token
    monkeypatch.setattr(drafter.draft_rt, "run_layers", lambda h, *a, **kw: (calls.append(h.shape[0]), orig(h, *a, **kw))[1])
    monkeypatch.setattr(drafter.draft_rt, "step_token", lambda *a, **kw: (calls.append(1), orig_step(*a, **kw))[1])  # one row, one call

    def run(guess):
        cache = rt.new_cache(64)
        with torch.inference_mode():
            rt.forward(torch.tensor(p[:-1]), 0, cache)
            step = Step(list(p), len(p) - 1, drafter.cfg.num_speculations, cache, sampling, make_rng(sampling.seed, rt.device))
            calls.clear()
            d = drafter.draft(step) if guess == "plain" else drafter.draft_guessed(step, guess)
            return d, len(calls), float(torch.rand(1, generator=step.rng))  # the rng's state after drafting

    want, passes, after = run("plain")
    assert len(want.tokens) >= 2 and passes == len(want.tokens)
    toks = want.tokens
    guesses = {"right": lambda done: toks[len(done):], "too long": lambda done: toks[len(done):] + [1, 2, 3, 4, 5],
               "wrong first": lambda done: [(toks[0] + 1) % 256, *toks[1:]] if not done else [],
               "wrong later": lambda done: [*toks[len(done):-1], (toks[-1] + 1) % 256],
               "empty": lambda done: [], "junk": lambda done: [(t * 7 + 3) % 256 for t in range(4)]}
    for name, guess in guesses.items():
        got, n, rng_after = run(guess)
        assert got.tokens == want.tokens, name
        assert rng_after == after, name
        if temperature:
            for a, b in zip(got.dists, want.dists):
                ids = torch.arange(model.spec.vocab_size)
                assert torch.equal(a.probs_at(ids), b.probs_at(ids)), name
        if name == "right":
            assert n == 1 < passes


@pytest.mark.parametrize("sampling", [{}, dict(temperature=0.8, top_p=0.95, seed=4), dict(temperature=1.0, seed=2)])
def test_drafts_are_the_same_in_one_call(model, monkeypatch, sampling):
    """Drafting takes Runtime.step_token (one C call a pass: the argmaxes in greedy decoding, the
    logits when sampling); with it forced off (the primitives, token by token) the drafts,
    acceptance and output are the same."""
    p = prompts(n=1, vocab=model.spec.vocab_size, lengths=(16,), seed=9)[0]
    cfgs = [dict(strategy="quantized", num_speculations=5, draft_vocab=64), dict(strategy="quantized", num_speculations=4),
            dict(strategy="layer-skip", skip_mlp=(1,), num_speculations=4)]
    calls = []
    for cfg in cfgs:
        d = model.draft_config(**cfg)
        rt = model.drafter(d).draft_rt
        step = rt.step_token
        monkeypatch.setattr(rt, "step_token", lambda *a, **kw: (calls.append(1), step(*a, **kw))[1])
        one = model.generate(p, max_new_tokens=40, draft=d, **sampling)
        monkeypatch.setattr(rt, "step_token", lambda *a, **kw: None)
        primitives = model.generate(p, max_new_tokens=40, draft=d, **sampling)
        monkeypatch.undo()
        assert one.token_ids == primitives.token_ids == ar_generate(model, p, max_new_tokens=40, **sampling).token_ids, cfg
        assert one.stats.per_position_accepted == primitives.stats.per_position_accepted and one.stats.drafted > 0, cfg
    assert len(calls) > 20


def test_a_copys_tail_is_verified_past_the_self_draft(monkeypatch):
    """Greedy, lookup-first: where a prompt-lookup copy foretold the whole self-draft, the
    copy's next tokens are verified too (Draft.tail, up to Step.room): output stays plain
    decoding's, the wrapped drafter hears of its own tokens only, and sampling never gets a
    tail (a copy is accepted with probability p(x) there). The model has no attention output
    (zeroed o_proj), so its next token depends on the last one only and greedy text loops."""
    from selfspec.drafters import LookupFirstDrafter

    m = looping_model()
    K, N = 3, 40
    opts = dict(strategy="quantized", num_speculations=K, lookup_first=True)
    heard = []
    orig = QuantizedDrafter.accepted
    monkeypatch.setattr(QuantizedDrafter, "accepted", lambda self, step, d, n: (heard.append((len(d.tokens), n)), orig(self, step, d, n))[1])
    for p in prompts(n=3, vocab=m.spec.vocab_size, lengths=(8, 12), seed=11):
        ar = ar_generate(m, p, max_new_tokens=N).token_ids
        out = m.generate(p, max_new_tokens=N, **opts)
        assert out.token_ids == ar
        assert len(out.stats.per_position_drafted) > K and out.stats.per_position_accepted[K] > 0  # tails, accepted
        assert out.stats.verify_steps < N / (K + 1)
        gated = m.generate(p, max_new_tokens=N, draft=DraftConfig("auto", base=DraftConfig(**opts)))  # auto sizes the tail
        assert gated.token_ids == ar
        sampled = m.generate(p, max_new_tokens=N, temperature=0.8, seed=1, **opts)
        assert len(sampled.stats.per_position_drafted) == K
    assert heard and all(d <= K and n <= d for d, n in heard)
    ps = prompts(n=2, vocab=m.spec.vocab_size, lengths=(8, 12), seed=11)
    batch = m.generate_batch(ps, max_new_tokens=N, **opts)  # lookup-first runs its own steps in a batch: tails too
    assert [r.token_ids for r in batch] == [ar_generate(m, p, max_new_tokens=N).token_ids for p in ps]
    assert all(len(r.stats.per_position_drafted) > K for r in batch)
    monkeypatch.setattr(LookupFirstDrafter, "_with_tail", lambda self, step, own, copy: own)
    monkeypatch.setattr(lookup_first, "copy_held", lambda copy, committed: False)  # no hot copies either
    out = m.generate(p, max_new_tokens=N, **opts)
    assert out.token_ids == ar and len(out.stats.per_position_drafted) == K


def test_a_hot_copy_is_the_draft(monkeypatch):
    """Greedy lookup-first over a quantized draft: after a prompt-lookup copy that held for every
    token the step committed (lookup.copy_held), the next copy is the draft itself (no self-draft
    pass), up to Step.room; output stays plain decoding's, the wrapped drafter hears nothing of
    it, sampling never takes one. Same looping model as the tails test."""
    m = looping_model()
    K, N = 3, 40
    opts = dict(strategy="quantized", num_speculations=K, lookup_first=True)
    drafts, heard = [], []
    verify, accepted = lookup_first.LookupFirstDrafter.verify, QuantizedDrafter.accepted
    monkeypatch.setattr(lookup_first.LookupFirstDrafter, "verify",
                        lambda self, step, d: (drafts.append((d.copied, len(d.tokens))), verify(self, step, d))[1])
    monkeypatch.setattr(QuantizedDrafter, "accepted", lambda self, step, d, n: (heard.append(d.copied), accepted(self, step, d, n))[1])
    p = prompts(n=1, vocab=m.spec.vocab_size, lengths=(8,), seed=11)[0]
    ar = ar_generate(m, p, max_new_tokens=N).token_ids
    out = m.generate(p, max_new_tokens=N, **opts)
    assert out.token_ids == ar
    assert any(c and n > K for c, n in drafts) and not any(heard)  # hot copies past K; not heard inside
    drafts.clear()
    assert m.generate(p, max_new_tokens=N, temperature=0.8, seed=1, **opts).stats.new_tokens == N
    assert not any(c for c, _ in drafts)
    drafts.clear()
    monkeypatch.setattr(lookup_first, "copy_held", lambda copy, committed: False)
    assert m.generate(p, max_new_tokens=N, **opts).token_ids == ar and not any(c for c, _ in drafts)
