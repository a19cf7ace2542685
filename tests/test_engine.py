"""The engine (issue "engine"): every draft strategy is lossless.

Greedy speculative decoding must produce exactly the autoregressive token ids, whatever
the drafts were; stop conditions (EOS, max_new_tokens, stop strings) must fire at the same
token as in plain decoding, even in the middle of a block of accepted drafts; statistics
must count exactly what happened. An *oracle* drafter (drafts = the known autoregressive
continuation with errors injected at chosen places) pins acceptance down exactly.

Every reference is plain decoding, pinned (helpers.ar_generate / _ar): the default strategy,
auto, drafts, and a bug shared by auto and a strategy would cancel out against it.
"""

from __future__ import annotations

import pytest
import torch

import selfspec
from selfspec.config import MAX_SPECULATIONS, DraftConfig, GenerationConfig, SamplingConfig
from selfspec.drafters import Draft, Drafter, make_drafter
from selfspec.engine import generate
from selfspec.errors import SelfSpecError

from helpers import ARCHS, VOCAB, ar_generate, assert_plain, build_hf, prompts, random_adapter, word_tokenizer

GREEDY = SamplingConfig()
N_NEW = 30

# (id, DraftConfig kwargs) for 4-layer models. draft_model is filled in from a fixture.
STRATEGIES = [
    ("ee-E1-K1", dict(strategy="early-exit", exit_layer=1, num_speculations=1)),
    ("ee-E1-K16", dict(strategy="early-exit", exit_layer=1, num_speculations=16)),
    ("ee-E2-K4", dict(strategy="early-exit", exit_layer=2, num_speculations=4)),
    ("ee-E3-K16", dict(strategy="early-exit", exit_layer=3, num_speculations=16)),
    ("ee-E3-K2-threshold", dict(strategy="early-exit", exit_layer=3, num_speculations=2, draft_threshold=0.2)),
    ("ee-E2-K6-adaptive", dict(strategy="early-exit", exit_layer=2, num_speculations=6, adaptive=True)),
    ("ee-E2-K5-vocab", dict(strategy="early-exit", exit_layer=2, num_speculations=5, draft_vocab=40)),
    ("ls-mlp12", dict(strategy="layer-skip", skip_mlp=(1, 2))),
    ("ls-attn0-mlp3-K8", dict(strategy="layer-skip", skip_attn=(0,), skip_mlp=(3,), num_speculations=8)),
    ("ls-all-attn-K16", dict(strategy="layer-skip", skip_attn=(0, 1, 2, 3), num_speculations=16)),
    ("ls-all-mlp-K1", dict(strategy="layer-skip", skip_mlp=(0, 1, 2, 3), skip_attn=(2,), num_speculations=1)),
    ("pl-K4", dict(strategy="prompt-lookup")),
    ("pl-ngram1-K16", dict(strategy="prompt-lookup", max_ngram=1, num_speculations=16)),
    ("dm-K4", dict(strategy="draft-model")),
    ("dm-K16", dict(strategy="draft-model", num_speculations=16)),
    ("q8-K4", dict(strategy="quantized")),
    ("q4-E3-K6", dict(strategy="quantized", draft_bits=4, exit_layer=3, num_speculations=6)),
    ("q4h8-skip-adaptive", dict(strategy="quantized", draft_bits=4, head_bits=8, skip_attn=(1,), adaptive=True, num_speculations=5)),
]

# Built by the model (auto needs its costs, exit-adapter its adapter file): the lossless matrix only.
MODEL_STRATEGIES = [
    ("ee-E2-K4-lookup-first", dict(strategy="early-exit", exit_layer=2, num_speculations=4, lookup_first=True)),
    ("ls-mlp1-K3-lookup-first", dict(strategy="layer-skip", skip_mlp=(1,), num_speculations=3, lookup_first=True)),
    ("ad-E2-K5", dict(strategy="exit-adapter", num_speculations=5)),
    ("ad-E2-K3-lookup-first-adaptive", dict(strategy="exit-adapter", num_speculations=3, lookup_first=True, adaptive=True)),
    ("auto", dict(strategy="auto")),
    ("auto-ee-E1-K6", dict(strategy="auto", base=DraftConfig("early-exit", exit_layer=1, num_speculations=6))),
    ("auto-ls-mlp02", dict(strategy="auto", base=DraftConfig("layer-skip", skip_mlp=(0, 2)))),
    ("q8-vocab-lookup-first", dict(strategy="quantized", draft_vocab=40, lookup_first=True, num_speculations=6)),
    ("auto-q8", dict(strategy="auto", base=DraftConfig("quantized", num_speculations=6))),
]


def _prompts():
    base = prompts(n=3, lengths=(5, 11, 3))
    # a repetitive prompt, so that prompt lookup has n-grams to copy
    base.append([7, 8, 9, 10, 7, 8, 9, 10, 7, 8, 9])
    return base


@pytest.fixture(scope="session")
def draft_runtime(draft_model_dir):
    return selfspec.load(draft_model_dir, dtype="float32").runtime


def _token_frequencies(model, seed: int = 0) -> None:
    """A restricted draft vocabulary needs a token-frequency order: give it a random one
    (nothing is computed from, or written to, the user's cache)."""
    model.set_token_frequencies(torch.randperm(model.spec.vocab_size, generator=torch.Generator().manual_seed(seed)))


@pytest.fixture(scope="session")
def adapter_path(tmp_path_factory) -> str:
    """A random exit adapter with attention at exit layer 2 (hidden 64: every tiny arch)."""
    return random_adapter(tmp_path_factory.mktemp("adapter") / "adapter.safetensors", seed=0)


def _cfg(kw: dict, draft_model_dir: str, adapter: str | None = None) -> dict:
    kw = dict(kw)
    if kw["strategy"] == "draft-model":
        kw["draft_model"] = draft_model_dir
    if kw["strategy"] == "exit-adapter":
        kw["adapter"] = adapter
    return kw


def _ar(model, prompt, n=N_NEW, eos_ids=(), tokenizer=None, gen=None):
    """Plain decoding through the engine with chosen EOS ids / tokenizer (ar_generate uses the model's)."""
    rt = model.runtime
    return assert_plain(generate(rt, make_drafter(rt, DraftConfig("autoregressive"), eos_ids), prompt, gen or GenerationConfig(n),
                                 GREEDY, tokenizer, eos_ids))


@pytest.fixture(scope="session")
def ar_cache() -> dict:
    """(arch, prompt) -> plain greedy continuation of N_NEW tokens: the matrix below asks for
    each one 22 times."""
    return {}


def _check_stats(res, K: int | None, copies: bool = False):
    """K: the configured draft length (None: auto chooses its base, and K with it, per prompt).
    copies: lookup-first, whose greedy copies (tails, hot copies) may pass K, up to MAX_SPECULATIONS."""
    s = res.stats
    assert s.new_tokens == len(res.token_ids)
    assert len(res.drafted_mask) == len(res.token_ids)
    if K is None:
        K = len(s.per_position_drafted)
        assert K >= 1
    assert len(s.per_position_accepted) == len(s.per_position_drafted)
    assert K <= len(s.per_position_drafted) <= MAX_SPECULATIONS if copies else len(s.per_position_drafted) == K
    assert s.drafted == sum(s.per_position_drafted)
    assert s.accepted == sum(s.per_position_accepted)
    assert 0 <= s.accepted <= s.drafted
    assert all(a <= d for a, d in zip(s.per_position_accepted, s.per_position_drafted))
    assert all(x >= y for x, y in zip(s.per_position_drafted, s.per_position_drafted[1:]))
    assert all(x >= y for x, y in zip(s.per_position_accepted, s.per_position_accepted[1:]))
    if res.finish_reason == "length":  # nothing cut off: every committed token is in the output
        assert s.new_tokens == 1 + s.accepted + s.verify_steps
        assert sum(res.drafted_mask) == s.accepted
    if s.verify_steps:
        assert s.mean_accepted_length == pytest.approx((s.accepted + s.verify_steps) / s.verify_steps)


# ---- losslessness ------------------------------------------------------------------------


@pytest.mark.parametrize("name,kw", STRATEGIES + MODEL_STRATEGIES, ids=[s[0] for s in STRATEGIES + MODEL_STRATEGIES])
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_strategies_equal_autoregressive(zoo, draft_model_dir, adapter_path, ar_cache, arch, name, kw):
    _, model = zoo.get(arch)
    if "quantized" in (kw["strategy"], getattr(kw.get("base"), "strategy", None)) and not model.runtime.uses_kernels:
        pytest.skip("quantized drafting needs selfspec's CPU kernels")
    _token_frequencies(model)
    kw = _cfg(kw, draft_model_dir, adapter_path)
    for prompt in _prompts():
        key = (arch, tuple(prompt))
        if key not in ar_cache:
            ar_cache[key] = ar_generate(model, prompt, max_new_tokens=N_NEW)
        ar = ar_cache[key]
        out = model.generate(prompt, max_new_tokens=N_NEW, **kw)
        assert out.token_ids == ar.token_ids, f"{arch}/{name}: prompt {prompt}"
        assert out.finish_reason == "length"
        K = kw["base"].num_speculations if "base" in kw else None if kw["strategy"] == "auto" else kw.get("num_speculations", 4)
        _check_stats(out, K, copies=bool(kw.get("lookup_first")))


def test_autoregressive_stats(zoo):
    _, model = zoo.get("llama")
    out = ar_generate(model, prompts(n=1)[0], max_new_tokens=12)
    s = out.stats
    assert (s.drafted, s.accepted, s.verify_steps, s.new_tokens) == (0, 0, 11, 12)
    assert s.per_position_drafted == [] and s.mean_accepted_length == 1.0
    assert out.drafted_mask == [False] * 12


def test_good_drafts_are_accepted(zoo):
    """The losslessness tests above are not vacuous: real drafts do get accepted."""
    _, model = zoo.get("llama")
    acc = 0
    for prompt in _prompts():
        out = model.generate(prompt, max_new_tokens=N_NEW, strategy="early-exit", exit_layer=3, num_speculations=4)
        acc += out.stats.accepted
        assert sum(out.drafted_mask) == out.stats.accepted
    assert acc > 0


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_draft_model_drafter_direct(zoo, draft_runtime, arch):
    _, model = zoo.get(arch)
    rt = model.runtime
    for K in (1, 3, 16):
        cfg = DraftConfig(strategy="draft-model", draft_model="unused", num_speculations=K)
        for prompt in _prompts():
            ar = _ar(model, prompt)
            out = generate(rt, make_drafter(rt, cfg, (), draft_runtime), prompt, GenerationConfig(N_NEW), GREEDY)
            assert out.token_ids == ar.token_ids
            _check_stats(out, K)


@pytest.mark.parametrize("draft_vocab_size", [VOCAB + 32])
def test_draft_model_with_a_padded_vocabulary(zoo, draft_vocab_size):
    """A draft model whose embedding is padded past the target's vocabulary (same tokenizer)."""
    _, model = zoo.get("mistral")
    rt = model.runtime
    draft_rt = selfspec.load(build_hf("llama", seed=6, num_layers=1, vocab_size=draft_vocab_size), dtype="float32").runtime
    cfg = DraftConfig(strategy="draft-model", draft_model="unused", num_speculations=3)
    for prompt in _prompts():
        ar = _ar(model, prompt).token_ids
        out = generate(rt, make_drafter(rt, cfg, (), draft_rt), prompt, GenerationConfig(N_NEW), GREEDY)
        assert out.token_ids == ar
        assert all(0 <= t < VOCAB for t in out.token_ids)
        sampled = generate(rt, make_drafter(rt, cfg, (), draft_rt), prompt, GenerationConfig(N_NEW),
                           SamplingConfig(temperature=1.0, seed=1))
        assert all(0 <= t < VOCAB for t in sampled.token_ids) and len(sampled.token_ids) == N_NEW


def test_draft_model_with_draft_vocab(zoo, draft_model_dir):
    """draft_vocab is a generic DraftConfig option; with a draft model it must not crash
    (and must stay lossless)."""
    _, model = zoo.get("llama")
    _token_frequencies(model)
    prompt = _prompts()[0]
    ar = ar_generate(model, prompt, max_new_tokens=N_NEW)
    out = model.generate(prompt, max_new_tokens=N_NEW, strategy="draft-model", draft_model=draft_model_dir, draft_vocab=40)
    assert out.token_ids == ar.token_ids


def test_strategies_in_sequence_share_one_model(zoo, draft_model_dir):
    """Drafters are cached per config on the model; interleaving them must not leak state."""
    _, model = zoo.get("qwen3")
    _token_frequencies(model)
    prompt_a, prompt_b = _prompts()[:2]
    ar_a = ar_generate(model, prompt_a, max_new_tokens=N_NEW).token_ids
    ar_b = ar_generate(model, prompt_b, max_new_tokens=N_NEW).token_ids
    for _ in range(2):
        for _, kw in STRATEGIES[::3]:
            kw = _cfg(kw, draft_model_dir)
            assert model.generate(prompt_a, max_new_tokens=N_NEW, **kw).token_ids == ar_a
            assert model.generate(prompt_b, max_new_tokens=N_NEW - 7, **kw).token_ids == ar_b[: N_NEW - 7]


@pytest.mark.parametrize("arch", ["gemma3", "llama3"])
def test_bfloat16_strategies_equal_autoregressive(zoo, draft_model_dir, arch):
    _, model = zoo.get(arch, dtype="bfloat16")
    _token_frequencies(model)
    for prompt in _prompts()[:2]:
        ar = ar_generate(model, prompt, max_new_tokens=N_NEW).token_ids
        for _, kw in STRATEGIES[1::2]:
            assert model.generate(prompt, max_new_tokens=N_NEW, **_cfg(kw, draft_model_dir)).token_ids == ar


# ---- the oracle drafter ---------------------------------------------------------------------


class OracleDrafter(Drafter):
    """Drafts the known autoregressive continuation, wrong from a chosen index on.

    plan(step_index, k) -> c: the first c drafts are correct, draft c (if any) is wrong,
    the drafts after it are correct again (so only a *prefix* rule accepts exactly c)."""

    name = "oracle"

    def __init__(self, runtime, K, continuation, prompt_len, plan, overdraft=False, eos_ids=()):
        super().__init__(runtime, DraftConfig(strategy="prompt-lookup", num_speculations=K), eos_ids)
        self.K, self.cont, self.prompt_len, self.plan, self.overdraft = K, continuation, prompt_len, plan, overdraft
        self.log: list[tuple[int, int]] = []

    def draft(self, step):
        generated = len(step.tokens) - self.prompt_len  # step.tokens[-1] is new token generated-1
        assert step.tokens[self.prompt_len :] == self.cont[:generated], "engine committed a wrong token"
        assert step.pos == len(step.tokens) - 1
        k = self.K if self.overdraft else step.k
        c = min(self.plan(len(self.log), k), k)
        toks = list(self.cont[generated : generated + k])
        assert len(toks) == k
        if c < k:
            toks[c] = (toks[c] + 1) % self.rt.spec.vocab_size
        self.log.append((k, c))
        return Draft(tokens=toks)


def _simulate(N: int, K: int, plan):
    """What the engine must do: k = min(K, remaining - 1) per step, c of them accepted."""
    gen, steps = 1, []
    while gen < N:
        k = min(K, N - gen - 1)
        c = min(plan(len(steps), k), k)
        steps.append((k, c))
        gen += c + 1
    return steps


PLANS = {
    "accept-all": lambda i, k: k,
    "accept-none": lambda i, k: 0,
    **{f"accept-{c}": (lambda c: lambda i, k: c)(c) for c in range(1, 4)},
    "cycle": lambda i, k: i % (k + 1) if k else 0,
    "cycle-down": lambda i, k: (7 * i + 3) % 17,
}


@pytest.mark.parametrize("K", [1, 4, 16])
@pytest.mark.parametrize("plan_name", list(PLANS))
def test_oracle_output_and_stats_exact(zoo, K, plan_name):
    _, model = zoo.get("mistral")
    rt = model.runtime
    plan = PLANS[plan_name]
    for prompt, N in ((prompts(n=1, lengths=(6,))[0], 37), (prompts(n=1, lengths=(2,), seed=3)[0], 23)):
        cont = _ar(model, prompt, N + 17).token_ids
        oracle = OracleDrafter(rt, K, cont, len(prompt), plan)
        res = generate(rt, oracle, prompt, GenerationConfig(N), GREEDY)
        assert res.token_ids == cont[:N]
        assert res.finish_reason == "length"
        steps = _simulate(N, K, plan)
        assert oracle.log == steps
        s = res.stats
        assert s.verify_steps == len(steps)
        assert s.drafted == sum(k for k, _ in steps)
        assert s.accepted == sum(c for _, c in steps)
        assert s.per_position_drafted == [sum(k > i for k, _ in steps) for i in range(K)]
        assert s.per_position_accepted == [sum(c > i for _, c in steps) for i in range(K)]
        assert s.mean_accepted_length == (s.accepted + s.verify_steps) / s.verify_steps
        assert s.acceptance_rate == (s.accepted / s.drafted if s.drafted else 0.0)
        assert s.new_tokens == N
        mask = [False]
        for _, c in steps:
            mask += [True] * c + [False]
        assert res.drafted_mask == mask
        d = res.to_dict()
        assert d["stats"]["mean_accepted_length"] == s.mean_accepted_length
        assert d["token_ids"] == res.token_ids


@pytest.mark.parametrize("c", range(0, 17))
def test_oracle_every_partial_length_k16(zoo, c):
    _, model = zoo.get("gemma3")
    rt = model.runtime
    prompt = prompts(n=1, lengths=(4,))[0]
    N = 40
    cont = _ar(model, prompt, N + 17).token_ids
    oracle = OracleDrafter(rt, 16, cont, len(prompt), lambda i, k: c)
    res = generate(rt, oracle, prompt, GenerationConfig(N), GREEDY)
    assert res.token_ids == cont[:N]
    steps = _simulate(N, 16, lambda i, k: c)
    assert oracle.log == steps
    assert res.stats.accepted == sum(x for _, x in steps)
    assert res.stats.per_position_accepted[:c] == [len([1 for _, x in steps if x > i]) for i in range(c)]


@pytest.mark.parametrize("N", range(1, 14))
def test_max_new_tokens_mid_block_never_exceeded(zoo, N):
    """A drafter that ignores step.k (drafts a full block near the end) still cannot push
    the output past max_new_tokens; real strategies stop at exactly N as well."""
    _, model = zoo.get("qwen2")
    rt = model.runtime
    prompt = prompts(n=1, lengths=(5,))[0]
    cont = _ar(model, prompt, N + 20).token_ids
    oracle = OracleDrafter(rt, 4, cont, len(prompt), PLANS["accept-all"], overdraft=True)
    res = generate(rt, oracle, prompt, GenerationConfig(N), GREEDY)
    assert res.token_ids == cont[:N]
    assert res.finish_reason == "length" and res.stats.new_tokens == N
    for kw in (dict(strategy="early-exit", exit_layer=3, num_speculations=4),
               dict(strategy="prompt-lookup", num_speculations=16)):
        out = model.generate(prompt, max_new_tokens=N, **kw)
        assert out.token_ids == cont[:N] and out.finish_reason == "length"


# ---- EOS -------------------------------------------------------------------------------------


def _first_occurrences(ids, lo, hi):
    return [j for j in range(lo, min(hi, len(ids))) if ids[j] not in ids[:j]]


def test_eos_inside_accepted_drafts_oracle(zoo):
    _, model = zoo.get("llama")
    rt = model.runtime
    prompt = prompts(n=1, lengths=(5,))[0]
    cont = _ar(model, prompt, 60).token_ids
    # accept-all with K=4: tokens 1-4 drafted, 5 verifier, 6-9 drafted, ...
    inside = [j for j in _first_occurrences(cont, 2, 40) if j % 5 != 0]
    assert inside, "precondition: some token first appears at a drafted position"
    for j in inside[:4]:
        eos = cont[j]
        oracle = OracleDrafter(rt, 4, cont, len(prompt), PLANS["accept-all"], eos_ids=(eos,))
        res = generate(rt, oracle, prompt, GenerationConfig(50), GREEDY, eos_ids=(eos,))
        assert res.token_ids == cont[: j + 1]
        assert res.finish_reason == "eos"
        assert res.drafted_mask[j] is True
        assert res.stats.new_tokens == j + 1
        ar = _ar(model, prompt, 50, eos_ids=(eos,))
        assert ar.token_ids == res.token_ids and ar.finish_reason == "eos"


@pytest.mark.parametrize("arch", ["llama", "mistral", "gemma3"])
def test_eos_every_strategy_stops_where_autoregressive_does(zoo, draft_runtime, arch):
    _, model = zoo.get(arch)
    rt = model.runtime
    checked = 0
    for prompt in _prompts():
        cont = _ar(model, prompt, N_NEW).token_ids
        for j in _first_occurrences(cont, 4, N_NEW - 2)[:2]:
            eos = (cont[j],)
            ar = _ar(model, prompt, N_NEW, eos_ids=eos)
            assert ar.token_ids == cont[: j + 1] and ar.finish_reason == "eos"
            for name, kw in STRATEGIES:
                cfg = DraftConfig(**_cfg(kw, "unused"))
                drafter = make_drafter(rt, cfg, eos, draft_runtime)
                res = generate(rt, drafter, prompt, GenerationConfig(N_NEW), GREEDY, eos_ids=eos)
                assert res.token_ids == ar.token_ids, f"{arch}/{name}: eos {eos} at {j}"
                assert res.finish_reason == "eos"
                checked += 1
    assert checked > 0


def test_eos_as_first_token(zoo):
    _, model = zoo.get("llama")
    rt = model.runtime
    prompt = prompts(n=1)[0]
    first = _ar(model, prompt, 1).token_ids[0]
    for kw in (dict(strategy="autoregressive"), dict(strategy="early-exit", exit_layer=2), dict(strategy="prompt-lookup")):
        res = generate(rt, make_drafter(rt, DraftConfig(**kw), (first,)), prompt, GenerationConfig(20), GREEDY,
                       eos_ids=(first,))
        assert res.token_ids == [first] and res.finish_reason == "eos"


def test_model_eos_from_config_stops_generation(draft_model_dir):
    """The model config's eos_token_id is honoured by SelfSpecModel.generate."""
    hf = build_hf("llama", seed=2)
    prompt = prompts(n=1)[0]
    cont = ar_generate(selfspec.load(hf, dtype="float32"), prompt, max_new_tokens=N_NEW).token_ids
    j = _first_occurrences(cont, 3, N_NEW)[0]
    hf.config.eos_token_id = cont[j]
    m = selfspec.load(hf, dtype="float32")
    assert cont[j] in m.eos_token_ids
    for kw in (dict(strategy="auto"), dict(strategy="autoregressive"), dict(strategy="early-exit", exit_layer=3),
               dict(strategy="layer-skip", skip_mlp=[2])):
        out = m.generate(prompt, max_new_tokens=N_NEW, **kw)
        assert out.token_ids == cont[: j + 1] and out.finish_reason == "eos"


# ---- stop strings ---------------------------------------------------------------------------


def _expected_stop(ids, tok, stops):
    """Reference: the first prefix whose decoded text contains a stop string."""
    for n in range(1, len(ids) + 1):
        text = tok.decode(ids[:n], skip_special_tokens=True)
        hits = [text.find(s) for s in stops if s in text]
        if hits:
            return ids[:n], text[: min(hits)]
    return None


@pytest.fixture(scope="module")
def text_model():
    tok = word_tokenizer(VOCAB)
    hf = build_hf("llama", seed=0)
    model = selfspec.load(hf, dtype="float32", tokenizer=tok)
    _token_frequencies(model, seed=1)
    return model, tok


def test_stop_string_spanning_block_boundary_oracle(text_model):
    model, tok = text_model
    rt = model.runtime
    prompt = prompts(n=1, lengths=(5,))[0]
    cont = _ar(model, prompt, 60).token_ids
    found = 0
    # accept-all, K=4: blocks are [0], [1..5], [6..10], ...: boundaries after 5, 10, 15, ...
    for b in (5, 10, 15, 20, 25):
        stop = tok.decode(cont[b : b + 2])  # last word of one block, first of the next
        exp = _expected_stop(cont[:40], tok, [stop])
        if exp is None or len(exp[0]) != b + 2:
            continue  # the string occurs earlier: not a boundary test
        found += 1
        oracle = OracleDrafter(rt, 4, cont, len(prompt), PLANS["accept-all"])
        res = generate(rt, oracle, prompt, GenerationConfig(40, stop=(stop,)), GREEDY, tok)
        assert res.token_ids == exp[0]
        assert res.text == exp[1]
        assert res.finish_reason == "stop"
        assert res.drafted_mask[b] is False and res.drafted_mask[b + 1] is True
        ar = _ar(model, prompt, gen=GenerationConfig(40, stop=(stop,)), tokenizer=tok)
        assert (ar.token_ids, ar.text, ar.finish_reason) == (res.token_ids, res.text, "stop")
    assert found >= 2


def test_stop_strings_every_strategy(text_model, draft_model_dir):
    model, tok = text_model
    checked = 0
    for prompt in _prompts()[:3]:
        text_prompt = tok.decode(prompt)
        ar_full = ar_generate(model, text_prompt, max_new_tokens=N_NEW)
        ids = ar_full.token_ids
        assert ar_full.text == tok.decode(ids, skip_special_tokens=True)
        for name, kw in STRATEGIES[::2]:
            kw = _cfg(kw, draft_model_dir)
            spec = model.generate(text_prompt, max_new_tokens=N_NEW, **kw)
            assert spec.token_ids == ids
            # boundaries of this strategy's blocks: after each verifier token
            bounds = [i for i in range(1, len(ids) - 1) if not spec.drafted_mask[i]]
            for b in bounds[:3]:
                words = tok.decode(ids[b : b + 2]).split(" ")
                stop = words[0][-2:] + " " + words[1][:2]  # straddles the boundary
                exp = _expected_stop(ids, tok, [stop])
                ar = ar_generate(model, text_prompt, max_new_tokens=N_NEW, stop=[stop])
                out = model.generate(text_prompt, max_new_tokens=N_NEW, stop=[stop], **kw)
                assert (out.token_ids, out.text, out.finish_reason) == (ar.token_ids, ar.text, ar.finish_reason), name
                assert (ar.token_ids, ar.text) == exp
                assert ar.finish_reason == "stop"
                checked += 1
    assert checked > 10


def test_streaming_events_reassemble_the_result(text_model):
    model, tok = text_model
    prompt = tok.decode(_prompts()[0])
    for kw in (dict(strategy="auto"), dict(strategy="early-exit", exit_layer=3, num_speculations=4)):
        events = []
        res = model.generate(prompt, max_new_tokens=N_NEW, on_event=events.append, **kw)
        assert [e.token_id for e in events] == res.token_ids
        assert [e.drafted for e in events] == res.drafted_mask
        assert "".join(e.text for e in events) == res.text
        assert res.text == tok.decode(res.token_ids, skip_special_tokens=True)


# ---- bad configurations ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw",
    [
        dict(strategy="early-exit", exit_layer=0),
        dict(strategy="early-exit", exit_layer=4),
        dict(strategy="early-exit", exit_layer=-1),
        dict(strategy="early-exit", exit_layer=99),
        dict(strategy="layer-skip", skip_mlp=(4,)),
        dict(strategy="layer-skip", skip_attn=(-1,)),
        dict(strategy="layer-skip", skip_attn=(0, 1, 2, 3), skip_mlp=(0, 1, 2, 3)),
        dict(strategy="early-exit", exit_layer=2, draft_vocab=VOCAB + 1),
    ],
)
def test_bad_draft_config_for_this_model(zoo, kw):
    _, model = zoo.get("llama")
    cfg = DraftConfig(**kw)  # valid in itself; invalid for a 4-layer model
    with pytest.raises(SelfSpecError):
        make_drafter(model.runtime, cfg)
    with pytest.raises(SelfSpecError):
        model.generate([1, 2, 3], max_new_tokens=4, **kw)


@pytest.mark.parametrize(
    "kw",
    [
        dict(strategy="early-exit", exit_layer=2, num_speculations=0),
        dict(strategy="early-exit", exit_layer=2, num_speculations=17),
        dict(strategy="early-exit", exit_layer=2, num_speculations=-3),
        dict(strategy="early-exit"),
        dict(strategy="layer-skip"),
        dict(strategy="layer-skip", skip_attn="1,x"),
        dict(strategy="draft-model"),
        dict(strategy="medusa"),
        dict(strategy="early-exit", exit_layer=2, draft_threshold=1.0),
        dict(strategy="prompt-lookup", max_ngram=0),
    ],
)
def test_bad_draft_config_values(zoo, kw):
    with pytest.raises(SelfSpecError):
        DraftConfig(**kw)
    _, model = zoo.get("llama")
    with pytest.raises(SelfSpecError):
        model.generate([1, 2, 3], max_new_tokens=4, **kw)


def test_unknown_strategy_message_lists_strategies():
    with pytest.raises(SelfSpecError, match="early-exit") as e:
        DraftConfig(strategy="nope")
    assert "nope" in str(e.value) and "layer-skip" in str(e.value)


def test_unknown_generate_option(zoo):
    _, model = zoo.get("llama")
    with pytest.raises(SelfSpecError, match="exit_layr"):
        model.generate([1, 2], max_new_tokens=2, strategy="early-exit", exit_layr=2)


def test_bad_prompts(zoo):
    _, model = zoo.get("llama")
    with pytest.raises(SelfSpecError):
        model.generate([], max_new_tokens=2, strategy="auto")
    with pytest.raises(SelfSpecError):
        model.generate([1, VOCAB], max_new_tokens=2, strategy="auto")
    with pytest.raises(SelfSpecError):
        model.generate("text without a tokenizer", max_new_tokens=2, strategy="auto")
    with pytest.raises(SelfSpecError):
        model.generate([1] * 512, max_new_tokens=2, strategy="auto")  # context is 512


def test_generation_near_the_context_end(zoo):
    """The budget shrinks to the context: the last position is max_position_embeddings-1."""
    _, model = zoo.get("llama")
    prompt = (prompts(n=1, lengths=(505,))[0])
    ar = ar_generate(model, prompt, max_new_tokens=50)
    assert len(ar.token_ids) == 512 - 505
    ee = model.generate(prompt, max_new_tokens=50, strategy="early-exit", exit_layer=2, num_speculations=16)
    assert ee.token_ids == ar.token_ids


def test_draft_vocab_without_frequencies_is_a_clear_error():
    m = selfspec.load(build_hf("llama", seed=1), dtype="float32")  # no tokenizer, no frequencies
    with pytest.raises(SelfSpecError):
        m.generate([1, 2, 3], max_new_tokens=4, strategy="early-exit", exit_layer=2, draft_vocab=10)
    m.set_token_frequencies(torch.arange(VOCAB).flip(0))
    ar = ar_generate(m, [1, 2, 3], max_new_tokens=12).token_ids
    assert m.generate([1, 2, 3], max_new_tokens=12, strategy="early-exit", exit_layer=2, draft_vocab=10).token_ids == ar


def test_streaming_with_stop_string(text_model):
    """Streamed deltas never show the stop string and add up to the final text."""
    model, tok = text_model
    prompt = tok.decode(_prompts()[1])
    ids = ar_generate(model, prompt, max_new_tokens=N_NEW).token_ids
    words = tok.decode(ids[9:11]).split(" ")
    stop = words[0][-2:] + " " + words[1][:2]
    for kw in (dict(strategy="auto"), dict(strategy="early-exit", exit_layer=3, num_speculations=4), dict(strategy="prompt-lookup")):
        events = []
        res = model.generate(prompt, max_new_tokens=N_NEW, stop=[stop], on_event=events.append, **kw)
        assert res.finish_reason == "stop"
        assert "".join(e.text for e in events) == res.text
        assert [e.token_id for e in events] == res.token_ids
        assert stop not in "".join(e.text for e in events)
        assert (res.token_ids, res.text) == _expected_stop(ids, tok, [stop])


def test_eos_text_does_not_depend_on_streaming_or_stop_strings():
    """EOS is "kept in token_ids, not in text" (engine._Output): the text must be the same
    whether or not stop strings / streaming switch on incremental text tracking, also when
    the EOS id is an ordinary (non-special) token of the tokenizer."""
    tok = word_tokenizer(VOCAB)
    hf = build_hf("llama", seed=0)
    prompt = _prompts()[0]
    ids = ar_generate(selfspec.load(hf, dtype="float32", tokenizer=tok), prompt, max_new_tokens=N_NEW).token_ids
    j = _first_occurrences(ids, 3, N_NEW)[0]
    hf.config.eos_token_id = ids[j]
    m = selfspec.load(hf, dtype="float32", tokenizer=tok)
    plain = ar_generate(m, prompt, max_new_tokens=N_NEW)
    with_stop = ar_generate(m, prompt, max_new_tokens=N_NEW, stop=["never occurs"])
    streamed = ar_generate(m, prompt, max_new_tokens=N_NEW, on_event=lambda e: None)
    assert plain.finish_reason == with_stop.finish_reason == streamed.finish_reason == "eos"
    assert plain.token_ids == with_stop.token_ids == streamed.token_ids == ids[: j + 1]
    assert with_stop.text == streamed.text == tok.decode(ids[:j], skip_special_tokens=True)
    assert plain.text == with_stop.text
