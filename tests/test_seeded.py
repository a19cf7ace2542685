"""A seed is one text: with Gumbel-max coupling (SamplingConfig.coupling "gumbel", the default)
seeded sampled output is token for token seeded autoregressive sampling's, whatever drafts it
(every strategy, every architecture), on 1 or 2 threads, alone or in a batch; and the noise
generator behind it (csrc/gumbel.c) is Philox4x32-10 with known answers, the same bits in C
and torch, and independent across positions and seeds.

The sharpness of the equality checks is tested too: a rule that accepts a mismatching draft
fails them (test_a_wrong_acceptance_rule_is_caught), and so does today's rejection sampling
with a perturbed draft (its text depends on the draft)."""

from __future__ import annotations

import contextlib
import ctypes
import math

import numpy as np
import pytest
import torch
from scipy.stats import chi2_contingency, chisquare, kstest

import selfspec
from selfspec import step as step_mod
from selfspec import kernels
from selfspec import coupling as S
from selfspec.config import DraftConfig, SamplingConfig
from selfspec.drafters.tokenwise import TokenDrafter
from selfspec.coupling import gumbel_max, gumbel_noise, gumbel_noise_torch, gumbel_token, philox4x32
from selfspec.sampling import SubVocab, distribution, probs_from_logits
from selfspec.verification import coupled_accept

from helpers import ARCHS, ar_generate, build_hf, prompts, random_adapter

needs_kernels = pytest.mark.skipif(not kernels.available(), reason="the C kernels are not available here")

N_NEW = 24
SAMPLINGS = [dict(temperature=1.0, seed=11), dict(temperature=0.8, top_k=20, seed=12), dict(temperature=1.2, top_p=0.9, seed=13)]

STRATEGIES = [
    ("ee-E2-K4", dict(strategy="early-exit", exit_layer=2, num_speculations=4)),
    ("ee-E1-K3-vocab-adaptive", dict(strategy="early-exit", exit_layer=1, num_speculations=3, draft_vocab=40,
                                     draft_threshold=0.3, adaptive=True)),
    ("ls-attn1-mlp2-K3", dict(strategy="layer-skip", skip_attn=(1,), skip_mlp=(2,), num_speculations=3)),
    ("q8-K4", dict(strategy="quantized")),
    ("q4-K3-lookup-first", dict(strategy="quantized", draft_bits=4, num_speculations=3, lookup_first=True)),
    ("ad-E2-K3", dict(strategy="exit-adapter", num_speculations=3)),
    ("dm-K4", dict(strategy="draft-model")),
    ("pl-K4", dict(strategy="prompt-lookup")),
    ("ee-E2-K3-lookup-first", dict(strategy="early-exit", exit_layer=2, num_speculations=3, lookup_first=True)),
    ("auto", dict(strategy="auto")),
    ("auto-ee-E2-K4", dict(strategy="auto", base=DraftConfig("early-exit", exit_layer=2, num_speculations=4))),
]


def _prompts():
    return prompts(n=2, seed=3, lengths=(6, 9)) + [[7, 8, 9, 10, 7, 8, 9, 10, 7, 8]]  # the last: copies to look up


@pytest.fixture(scope="module")
def adapter_path(tmp_path_factory) -> str:
    return random_adapter(tmp_path_factory.mktemp("seeded-adapter") / "adapter.safetensors", seed=1)


@contextlib.contextmanager
def threads(n: int):
    """torch's threads, and with them the kernels' (kernels/pool.py: a generation's compute
    scope gives the kernels torch's count)."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _kw(kw: dict, draft_model_dir: str, adapter: str) -> dict:
    kw = dict(kw)
    if kw["strategy"] == "draft-model":
        kw["draft_model"] = draft_model_dir
    if kw["strategy"] == "exit-adapter":
        kw["adapter"] = adapter
    return kw


def assert_one_text(model, kw: dict, coupling: str = "gumbel", batch: bool = True) -> None:
    """Seeded sampled output with the draft `kw` equals seeded autoregressive sampling, token for
    token: every prompt x sampling in SAMPLINGS, solo on 1 and 2 threads, and (batch) all of them
    in one generate_batch on 1 and 2 threads."""
    ps = _prompts()
    cases = [(p, s) for p in ps for s in SAMPLINGS]
    with threads(1):
        ref = [ar_generate(model, p, max_new_tokens=N_NEW, coupling=coupling, **s).token_ids for p, s in cases]
    drafted = 0
    for n in (1, 2):
        with threads(n):
            for (p, s), want in zip(cases, ref):
                out = model.generate(p, max_new_tokens=N_NEW, coupling=coupling, **s, **kw)
                assert out.token_ids == want, f"{n} thread(s), sampling {s}, prompt {p}"
                drafted += out.stats.drafted
            if batch:
                for s in SAMPLINGS:
                    got = model.generate_batch(ps, max_new_tokens=N_NEW, coupling=coupling, **s, **kw)
                    want = [ref[cases.index((p, s))] for p in ps]
                    assert [r.token_ids for r in got] == want, f"batch, {n} thread(s), sampling {s}"
    if kw["strategy"] not in ("auto", "autoregressive"):
        assert drafted > 0, "nothing was drafted: the comparison would be vacuous"


@pytest.mark.parametrize("name,kw", STRATEGIES, ids=[s[0] for s in STRATEGIES])
@pytest.mark.parametrize("arch", ARCHS)
def test_seeded_sampling_is_autoregressive_sampling(zoo, draft_model_dir, adapter_path, arch, name, kw):
    _, model = zoo.get(arch)
    if kw["strategy"] == "quantized" and not model.runtime.uses_kernels:
        pytest.skip("quantized drafting needs selfspec's CPU kernels")
    model.set_token_frequencies(torch.randperm(model.spec.vocab_size, generator=torch.Generator().manual_seed(0)))
    assert_one_text(model, _kw(kw, draft_model_dir, adapter_path), batch=arch in ("llama", "gemma3") or name == "ee-E2-K4")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_drafts_are_accepted_and_rejected(zoo, dtype):
    """The equality above is not vacuous: with coupling, drafts are accepted and rejected."""
    _, model = zoo.get("llama", dtype=dtype)
    acc = drafted = 0
    for p in _prompts():
        for s in SAMPLINGS:
            out = model.generate(p, max_new_tokens=N_NEW, strategy="early-exit", exit_layer=3, num_speculations=4, **s)
            acc, drafted = acc + out.stats.accepted, drafted + out.stats.drafted
    assert 0 < acc < drafted


def _perturbed_drafts(monkeypatch, scale: float = 2.0):
    """Every sampled draft token comes from draft logits with fresh random noise added: a
    draft that changes from run to run (as the int8 copy's does with the thread count)."""
    choose = TokenDrafter._choose
    g = torch.Generator().manual_seed(torch.seed() % (1 << 62))

    def noisy(self, logits, step, draft):
        return choose(self, logits + scale * torch.randn(logits.shape, generator=g), step, draft)

    monkeypatch.setattr(TokenDrafter, "_choose", noisy)


def test_a_changing_draft_does_not_change_the_text(zoo, monkeypatch):
    _, model = zoo.get("qwen3")
    kw = dict(strategy="early-exit", exit_layer=2, num_speculations=4)
    _perturbed_drafts(monkeypatch)
    assert_one_text(model, kw)


def test_rejection_sampling_text_depends_on_the_draft(zoo, monkeypatch):
    """Today's rule keeps the distribution, not the sample: with a changing draft its seeded text
    differs from autoregressive sampling's. (So the equality checks here can fail.)"""
    _, model = zoo.get("qwen3")
    _perturbed_drafts(monkeypatch)
    with pytest.raises(AssertionError):
        assert_one_text(model, dict(strategy="early-exit", exit_layer=2, num_speculations=4), coupling="rejection", batch=False)


def test_a_wrong_acceptance_rule_is_caught(zoo, monkeypatch):
    """Mutation check: a rule that also accepts the first mismatching draft token fails."""
    _, model = zoo.get("llama")
    kw = dict(strategy="early-exit", exit_layer=2, num_speculations=4)
    assert_one_text(model, kw, batch=False)  # the right rule passes

    def sloppy(draft, picks):
        n, nxt = coupled_accept(draft, picks)
        return (n + 1, picks[n + 1]) if n < len(draft) else (n, nxt)

    monkeypatch.setattr(step_mod, "coupled_accept", sloppy)
    with pytest.raises(AssertionError):
        assert_one_text(model, kw, batch=False)


def test_seed_none_differs_and_rejection_still_reproduces(zoo):
    _, model = zoo.get("llama")
    p = _prompts()[0]
    runs = {tuple(model.generate(p, max_new_tokens=16, temperature=1.5, strategy="early-exit", exit_layer=2).token_ids)
            for _ in range(4)}
    assert len(runs) > 1  # no seed: fresh noise each time
    kw = dict(max_new_tokens=16, temperature=1.0, seed=5, coupling="rejection", strategy="early-exit", exit_layer=2)
    assert model.generate(p, **kw).token_ids == model.generate(p, **kw).token_ids


def test_the_coupling_changes_the_text_not_the_greedy_output(zoo):
    _, model = zoo.get("llama")
    p = _prompts()[1]
    a = ar_generate(model, p, max_new_tokens=20, temperature=1.0, seed=3).token_ids
    b = ar_generate(model, p, max_new_tokens=20, temperature=1.0, seed=3, coupling="rejection").token_ids
    assert a != b  # two different rules, each a draw from the model
    assert ar_generate(model, p, max_new_tokens=20).token_ids == ar_generate(model, p, max_new_tokens=20, coupling="rejection").token_ids


# ---- the generator -----------------------------------------------------------------------------

M32 = 0xFFFFFFFF


def philox_ref(ctr: list[int], key: list[int]) -> list[int]:
    """Philox4x32-10 in Python integers (Salmon et al., SC'11)."""
    c, k = list(ctr), list(key)
    for _ in range(10):
        p0, p1 = 0xD2511F53 * c[0], 0xCD9E8D57 * c[2]
        c = [(p1 >> 32) ^ c[1] ^ k[0], p1 & M32, (p0 >> 32) ^ c[3] ^ k[1], p0 & M32]
        k = [(k[0] + 0x9E3779B9) & M32, (k[1] + 0xBB67AE85) & M32]
    return c


# Random123's known-answer vectors for philox4x32_10 (kat_vectors): counter, key -> output
KAT = [
    ([0, 0, 0, 0], [0, 0], [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]),
    ([M32] * 4, [M32] * 2, [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]),
    ([0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344], [0xA4093822, 0x299F31D0], [0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1]),
]


@pytest.mark.parametrize("ctr,key,want", KAT)
def test_philox_known_answers(ctr, key, want):
    assert philox_ref(ctr, key) == want
    got = philox4x32([torch.tensor([v]) for v in ctr], tuple(key))
    assert [int(v) for v in got] == want
    if kernels.available():
        out = (ctypes.c_uint32 * 4)()
        kernels.sampling_functions()["philox"]((ctypes.c_uint32 * 4)(*ctr), (ctypes.c_uint32 * 2)(*key), out)
        assert list(out) == want


def _noise_ref(key: int, pos: int, token: int) -> float:
    """g in float64 from the same bits: -log(-log1p(-w)), w = (b + 1/2) 2^-32 (capped)."""
    out = philox_ref([token >> 2, pos & M32, pos >> 32, S.NOISE_DOMAIN], [key & M32, key >> 32])
    w = min((out[token & 3] + 0.5) * 2.0**-32, 1 - 2.0**-24)
    return -math.log(-math.log1p(-w))


# the definition, pinned: a seed must mean the same text in later versions
PINNED = [((0, 0, 0), -0.5761868357658386), ((0, 0, 1), -0.47142213582992554), ((5, 17, 262143), 0.4922713041305542),
          ((2**64 - 1, 2**33 + 1, 123456), -0.010528968647122383)]


def test_noise_known_answers():
    for (key, pos, token), want in PINNED:
        g = float(gumbel_noise_torch(key, pos, torch.tensor([token]))[0])
        assert g == want, (key, pos, token, g)
        assert g == pytest.approx(_noise_ref(key, pos, token), abs=1e-5)
        assert float(gumbel_noise(key, pos, torch.tensor([token]))[0]) == want


@needs_kernels
def test_c_and_torch_noise_are_the_same_bits():
    g = torch.Generator().manual_seed(0)
    toks = torch.cat([torch.arange(5000), torch.randint(0, 1 << 31, (20000,), generator=g)])
    for key, pos in [(0, 0), (1, 1), (2**63 + 12345, 7), (2**64 - 1, 2**40 + 3), (987654321, 100000)]:
        a, b = gumbel_noise(key, pos, toks), gumbel_noise_torch(key, pos, toks)
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))


def test_noise_is_accurate_and_gumbel_distributed():
    key, pos = 42, 9
    toks = torch.arange(40000)
    g = gumbel_noise(key, pos, toks).double().numpy()
    ref = np.array([_noise_ref(key, pos, t) for t in range(0, 40000, 97)])
    assert np.abs(g[::97] - ref).max() < 1e-5  # fp32: w rounds to 24 bits, and so does 1 - w
    assert -2.9 < g.min() and g.max() < 23
    assert kstest(g, lambda x: np.exp(-np.exp(-x))).pvalue > 1e-3  # the standard Gumbel CDF
    # extreme bits give finite noise within [-2.82, 22.9]: w at its smallest and largest
    for b in (0, 1, 255, 256, (1 << 32) - 1):
        w = min((b + 0.5) * 2.0**-32, 1 - 2.0**-24)
        assert -2.9 < -math.log(-math.log1p(-w)) < 23


def _gumbel_draws(logp: np.ndarray, keys, positions) -> np.ndarray:
    """[len(keys), len(positions)] tokens argmax(log p + g)."""
    x = torch.tensor(logp, dtype=torch.float32)
    toks = torch.arange(len(logp))
    return np.array([[int((x + gumbel_noise(k, pos, toks)).argmax()) for pos in positions] for k in keys])


def test_gumbel_max_draws_are_independent_across_positions_and_seeds():
    p = np.array([0.3, 0.25, 0.2, 0.12, 0.08, 0.05])
    draws = _gumbel_draws(np.log(p), range(4000), [0, 1, 2**33])
    for j in range(3):  # each position: a draw from p
        assert chisquare(np.bincount(draws[:, j], minlength=6), 4000 * p).pvalue > 1e-4
    for a, b in ((0, 1), (0, 2), (1, 2)):  # positions of one seed: independent
        table = np.zeros((6, 6))
        np.add.at(table, (draws[:, a], draws[:, b]), 1)
        assert chi2_contingency(table).pvalue > 1e-4
    table = np.zeros((6, 6))  # consecutive seeds at one position: independent
    np.add.at(table, (draws[:-1, 0], draws[1:, 0]), 1)
    assert chi2_contingency(table).pvalue > 1e-4


def test_gumbel_max_marginal_over_seeds_matches_the_model():
    """Many seeds, one position: the picks of a real-looking row follow its distribution, for
    temperature, top-k and top-p (distribution's support), on the full-row and the support paths."""
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(300, generator=g) * 2.5
    for cfg in (SamplingConfig(temperature=1.0), SamplingConfig(temperature=0.7, top_k=12), SamplingConfig(temperature=1.3, top_p=0.8)):
        p = probs_from_logits(logits, cfg).double().numpy()
        picks = np.array([gumbel_token(logits, cfg, k, 3) for k in range(6000)])
        counts = np.bincount(picks, minlength=300)
        assert counts[p == 0].sum() == 0
        big = p * 6000 >= 5
        obs = np.append(counts[big], counts[~big].sum())
        exp = np.append(6000 * p[big], 6000 * p[~big].sum())
        keep = exp > 0
        assert chisquare(obs[keep], exp[keep]).pvalue > 1e-4, cfg


# ---- the pick ------------------------------------------------------------------------------------


def _brute(x: torch.Tensor, tokens: torch.Tensor, key: int, pos: int) -> int:
    score = x + gumbel_noise(key, pos, tokens)
    score[~torch.isfinite(x)] = float("-inf")
    return int(score.argmax())


@needs_kernels
def test_the_screened_pick_is_the_exact_argmax():
    """The C pick passes most of a row over without noise (fl(x + GMAX) < best) and most of the rest
    without logarithms (their bits): rows built so that many entries sit 3-25 below the top."""
    g = torch.Generator().manual_seed(2)
    V = 6000
    rows = [torch.randn(V, generator=g) * 3, -torch.rand(V, generator=g) * 25, (torch.randn(V, generator=g) * 3).bfloat16().float()]
    ties = torch.zeros(V)
    ties[::7] = -30.0
    rows.append(ties)
    for r in rows:
        for T in (1.0, 0.6):
            x = r / T
            for key in range(40):
                want = _brute(x, torch.arange(V), key, key * 13)
                assert S._c_pick(r.contiguous(), T, -S._FLT_MAX, None, key, key * 13) == want
    # a support threshold and a restricted vocabulary
    ids = torch.randperm(50000, generator=g)[:V].sort().values
    r = rows[0]
    tau = float(r.quantile(0.7))
    for key in range(20):
        xs = torch.where(r >= tau, r, torch.tensor(float("-inf")))
        want = _brute(xs, ids, key, 5)
        assert S._c_pick(r.contiguous(), 1.0, tau, ids, key, 5) == want


@needs_kernels
def test_avx2_code_gives_the_same_noise_and_picks(tmp_path):
    """csrc/gumbel.c built without AVX-512 (the AVX2 code of simd.h and of its multiplies)
    computes the very bits of this build: a seed is one text across those machines too."""
    import os
    import subprocess

    from selfspec.kernels import build

    lib = tmp_path / "libgumbel_avx2.so"
    subprocess.run([os.environ.get("CC", "gcc"), *build._FLAGS, "-mno-avx512f", str(build._CSRC / "gumbel.c"), "-o", str(lib)],
                   check=True, capture_output=True, timeout=300)
    alt = ctypes.CDLL(str(lib))
    alt.selfspec_gumbel_noise.argtypes = [ctypes.c_uint64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p]
    alt.selfspec_gumbel_pick.restype = ctypes.c_long
    alt.selfspec_gumbel_pick.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_float, ctypes.c_float, ctypes.c_void_p,
                                         ctypes.c_uint64, ctypes.c_int64, ctypes.c_void_p]
    g = torch.Generator().manual_seed(6)
    toks = torch.randint(0, 1 << 31, (10001,), generator=g)
    for key, pos in [(0, 0), (2**64 - 1, 2**40 + 3)]:
        out = torch.empty(len(toks))
        alt.selfspec_gumbel_noise(key, pos, toks.data_ptr(), len(toks), out.data_ptr())
        assert torch.equal(out.view(torch.int32), gumbel_noise(key, pos, toks).view(torch.int32))
    row = (torch.randn(20000, generator=g) * 4).bfloat16().float()
    for key in range(20):
        assert alt.selfspec_gumbel_pick(row.data_ptr(), len(row), 0.8, -S._FLT_MAX, None, key, 9, None) == \
            S._c_pick(row, 0.8, -S._FLT_MAX, None, key, 9)


def test_every_representation_picks_alike(monkeypatch):
    """Explicit, dense (Softmax) and the torch fallback (DenseProbs) pick the same token for one
    row; a restricted vocabulary's row picks among its own tokens."""
    g = torch.Generator().manual_seed(5)
    V = 3000
    x = (torch.randn(V, generator=g) * 3).bfloat16().float()
    sub = SubVocab(torch.randperm(V, generator=g)[:500].sort().values, V)
    for cfg in (SamplingConfig(temperature=0.9), SamplingConfig(temperature=0.8, top_k=40), SamplingConfig(temperature=1.1, top_p=0.9)):
        for key in range(10):
            picks = {gumbel_max(distribution(x, cfg), key, 4), gumbel_max(distribution(x, cfg, cap=0), key, 4), gumbel_token(x, cfg, key, 4)}
            with monkeypatch.context() as mp:
                mp.setattr(kernels, "sampling_functions", lambda: None)
                picks.add(gumbel_max(distribution(x, cfg), key, 4))
                picks.add(gumbel_token(x, cfg, key, 4))
            assert len(picks) == 1, (cfg, key, picks)
            row = x[sub.ids]
            sp = {gumbel_max(distribution(row, cfg, sub), key, 4), gumbel_max(distribution(row, cfg, sub, cap=0), key, 4),
                  gumbel_token(row, cfg, key, 4, sub)}
            assert len(sp) == 1 and int(sub.index[sp.pop()]) >= 0


def test_coupled_accept():
    assert coupled_accept([3, 4, 5], [3, 4, 5, 6]) == (3, 6)
    assert coupled_accept([3, 9, 5], [3, 4, 5, 6]) == (1, 4)
    assert coupled_accept([], [7]) == (0, 7)
    looked = []

    class Lazy:
        def __getitem__(self, i):
            looked.append(i)
            return [1, 2, 3][i]

    assert coupled_accept([8, 2], Lazy()) == (0, 1) and looked == [0, 0]


def test_bad_coupling_is_one_line():
    with pytest.raises(selfspec.SelfSpecError, match="unknown coupling 'gumbell'; did you mean gumbel"):
        SamplingConfig(temperature=1.0, coupling="gumbell")
