"""The real default model, Gemma 3 270M (slow: about a minute the first time, when the
GGUF package is converted into ~/.cache/selfspec; a few seconds after that).

All tests share the session-scoped `default_model` fixture (conftest.py) and one
transformers reference model. The cache checks work on a copy, never on the real cache.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from selfspec import loading
from selfspec.config import Grammar

from helpers import ar_generate

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "def fibonacci(n):\n", "Once upon a time, in a small village,"]
N_NEW = 24


@pytest.fixture(scope="module")
def hf_reference(default_model):
    from transformers import AutoModelForCausalLM

    d = loading.default_model_dir()
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="eager", local_files_only=True)
    model.eval()
    return model


@pytest.fixture(scope="module")
def autoregressive(default_model):
    """prompt -> (prompt ids, plain greedy continuation), computed once."""
    return {p: (default_model.encode(p), ar_generate(default_model, p, max_new_tokens=N_NEW)) for p in PROMPTS}


def test_default_model_shape(default_model):
    spec = default_model.spec
    assert spec.model_type == "gemma3_text"
    assert spec.num_layers == 18 and spec.vocab_size == 262144
    assert default_model.runtime.dtype == torch.float32
    assert default_model.tokenizer is not None
    assert 1 in default_model.eos_token_ids  # <eos>
    ids = default_model.encode("Hello")
    assert ids[0] == 2  # <bos>


# Our logits and transformers' may differ by rounding (different kernels, summation orders).
LOGIT_TOL = 1e-3


def test_greedy_matches_transformers(default_model, hf_reference, autoregressive):
    """Our greedy continuation, teacher-forced through transformers: at every position our
    token must be transformers' argmax up to rounding. Decode logits within LOGIT_TOL of
    transformers' can only pick a token whose transformers logit is within 2 * LOGIT_TOL of
    the top one: where the top-2 margin is wider (nearly everywhere) that is the argmax, and a
    near-tie (this model has margins of 0.012) may go either way without failing the test."""
    eos = set(default_model.eos_token_ids)
    rt = default_model.runtime
    decisive = compared = 0
    for prompt in PROMPTS:
        ids, ours = autoregressive[prompt]
        got = ours.token_ids
        if len(got) < N_NEW:  # stopped early: only at an EOS
            assert ours.finish_reason == "eos" and got[-1] in eos
        else:
            assert ours.finish_reason == "length"
        assert len(got) >= 8, "the continuation is too short to compare anything"
        seq = ids + got
        with torch.inference_mode():
            ref = hf_reference(torch.tensor([seq[:-1]]), use_cache=False).logits[0].float()
            mine = rt.forward(torch.tensor(seq[:-1]), 0, rt.new_cache(len(seq) + 4))
        assert (mine - ref).abs().max().item() <= LOGIT_TOL, prompt
        ref = ref[len(ids) - 1 :]  # row i predicts got[i]
        top2 = ref.topk(2, dim=-1).values
        chosen = ref.gather(1, torch.tensor(got)[:, None])[:, 0]
        assert (chosen >= top2[:, 0] - 2 * LOGIT_TOL).all(), f"{prompt!r}: a token transformers clearly ranks lower"
        decisive += int((top2[:, 0] - top2[:, 1] > 2 * LOGIT_TOL).sum())
        compared += len(got)
    assert decisive >= 0.9 * compared, "too many near-ties to compare anything"


def test_prefill_logits_match_transformers(default_model, hf_reference):
    ids = default_model.encode(PROMPTS[2])
    rt = default_model.runtime
    with torch.inference_mode():
        ours = rt.forward(torch.tensor(ids), 0, rt.new_cache(len(ids) + 4))
        ref = hf_reference(torch.tensor([ids]), use_cache=False).logits[0].float()
    assert (ours - ref).abs().max().item() < 1e-3


@pytest.mark.parametrize(
    "kw",
    [
        dict(strategy="early-exit", exit_layer=12, num_speculations=4),
        dict(strategy="layer-skip", skip_mlp=[8, 10]),
        dict(strategy="prompt-lookup"),
    ],
    ids=["early-exit", "layer-skip", "prompt-lookup"],
)
def test_strategies_equal_autoregressive(default_model, autoregressive, kw):
    """float32; the bfloat16 run of every strategy is test_bfloat16_strategies_equal_autoregressive."""
    accepted = 0
    for prompt in PROMPTS[:2]:
        _, ar = autoregressive[prompt]
        out = default_model.generate(prompt, max_new_tokens=N_NEW, **kw)
        assert out.token_ids == ar.token_ids, f"{kw['strategy']} on {prompt!r}"
        assert out.text == ar.text
        s = out.stats
        assert s.drafted == sum(s.per_position_drafted) and s.accepted == sum(s.per_position_accepted)
        if out.finish_reason == "length":
            assert len(out.token_ids) == 1 + s.accepted + s.verify_steps
        accepted += s.accepted
    if kw["strategy"] == "early-exit":  # layer 12 of 18 drafts well on this model
        assert accepted > 0


@pytest.fixture(scope="module")
def zero_adapter(default_model_bf16, tmp_path_factory) -> str:
    """An exit adapter with attention at layer 12 of the real model, small random weights (not
    trained: only the path matters here, acceptance does not)."""
    from selfspec.adapter import AdapterMeta, ExitAdapter, save_adapter

    m = default_model_bf16
    a = ExitAdapter(AdapterMeta(exit_layer=12, hidden_size=m.spec.hidden_size, inner_size=64, model_fingerprint=m.fingerprint,
                                heads=2, head_dim=64))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        a.down.copy_(torch.randn(a.down.shape, generator=g) * 0.02)
        a.out.copy_(torch.randn(a.out.shape, generator=g) * 0.02)
    path = tmp_path_factory.mktemp("adapter") / "adapter.safetensors"
    save_adapter(a, path)
    return str(path)


BF16_PROMPTS = ["def fibonacci(n):\n", "The capital of France is Paris. The capital of France is",
                "Once upon a time, in a small village,"]
BF16_STRATEGIES = {
    "early-exit": dict(strategy="early-exit", exit_layer=12, num_speculations=4),
    "layer-skip": dict(strategy="layer-skip", skip_mlp=[8, 10], num_speculations=3),
    "prompt-lookup": dict(strategy="prompt-lookup"),
    "auto": dict(strategy="auto"),
    "lookup-first": dict(strategy="early-exit", exit_layer=12, num_speculations=4, lookup_first=True),
    "draft-vocab": dict(strategy="early-exit", exit_layer=15, num_speculations=5, draft_vocab=16384),
    "exit-adapter": dict(strategy="exit-adapter", num_speculations=4),
}


@pytest.fixture(scope="module")
def autoregressive_bf16(default_model_bf16):
    return {p: ar_generate(default_model_bf16, p, max_new_tokens=32) for p in BF16_PROMPTS}


@pytest.mark.parametrize("name", list(BF16_STRATEGIES))
def test_bfloat16_strategies_equal_autoregressive(default_model_bf16, autoregressive_bf16, zero_adapter, name):
    """What users run on the CPU: bfloat16 (the fused kernels where they build). Every
    strategy's greedy output must be plain bf16 decoding's, token for token."""
    m = default_model_bf16
    assert m.runtime.dtype == torch.bfloat16
    kw = dict(BF16_STRATEGIES[name])
    if name == "exit-adapter":
        kw["adapter"] = zero_adapter
    drafted = 0
    for prompt in BF16_PROMPTS:
        ar = autoregressive_bf16[prompt]
        out = m.generate(prompt, max_new_tokens=32, **kw)
        assert out.token_ids == ar.token_ids, f"{name} on {prompt!r}"
        drafted += out.stats.drafted
    assert drafted > 0  # drafts were verified, not only plain steps compared


def test_auto_where_the_kernels_cannot_run_skips_a_quantized_profile(monkeypatch, caplog):
    """The shipped profile drafts with an int8 copy, which needs the CPU kernels. Where they
    cannot run (another CPU, no compiler, SELFSPEC_NO_KERNELS=1) the default strategy must still
    generate (the README's first command): auto says so once and chooses per prompt, with plain
    decoding's tokens."""
    import selfspec
    from selfspec.drafters import factory

    monkeypatch.setenv("SELFSPEC_NO_KERNELS", "1")
    monkeypatch.setattr(factory, "_noted_unrunnable", set())
    # the dtype the README's command gets there: fp32 on a CPU without native bf16, where torch's
    # bf16 matmul takes ~1 s per LM-head row (AVX2) and auto's cost measurement minutes
    m = selfspec.load("gemma-3-270m", device="cpu")
    assert not m.runtime.uses_kernels
    prompt = BF16_PROMPTS[0]
    ar = ar_generate(m, prompt, max_new_tokens=8)
    with caplog.at_level("WARNING", logger="selfspec"):
        outs = [m.generate(prompt, max_new_tokens=8, strategy="auto") for _ in range(2)]
    assert all(o.token_ids == ar.token_ids for o in outs)
    assert all(o.stats.draft["source"] == "calibrated" for o in outs)
    notes = [r for r in caplog.records if "needs selfspec's CPU kernels" in r.getMessage()]
    assert len(notes) == 1


def test_row_invariance_real_model(default_model):
    """The real shapes (hidden 640, GQA 4:1, head_dim 256, vocab 262144): a block of T rows
    equals T single-token forwards bit for bit."""
    rt = default_model.runtime
    ids = default_model.encode(
        "The capital of France is Paris, the capital of Germany is Berlin, the capital of Italy is Rome,"
        " and the capital of Spain is Madrid."
    )
    P = 4
    assert len(ids) >= P + 17
    with torch.inference_mode():
        for T in (2, 17):
            a, b = rt.new_cache(64), rt.new_cache(64)
            rt.forward(torch.tensor(ids[:P]), 0, a)
            rt.forward(torch.tensor(ids[:P]), 0, b)
            block = rt.forward(torch.tensor(ids[P : P + T]), P, a)
            steps = torch.cat([rt.forward(torch.tensor([ids[P + i]]), P + i, b) for i in range(T)])
            assert torch.equal(block, steps), f"T={T}: max diff {(block - steps).abs().max().item()}"


# ---- the converted-model cache --------------------------------------------------------------


def test_cache_is_complete(default_model):
    d = loading.default_model_dir()
    assert d == loading.cache_root() / loading.DEFAULT_MODEL
    assert loading._cache_is_complete(d)
    marker = json.loads((d / "selfspec-cache.json").read_text())
    assert "model.safetensors" in marker["files"] and "config.json" in marker["files"]


@pytest.fixture
def cache_copy(tmp_path, default_model):
    """A copy of the converted cache directory. model.safetensors is copied as its header
    plus a sparse tail of the same size (what the completeness check reads), not 1 GB."""
    src = loading.default_model_dir()
    dst = tmp_path / loading.DEFAULT_MODEL
    dst.mkdir()
    for f in src.iterdir():
        if f.name == "model.safetensors":
            with open(f, "rb") as fin, open(dst / f.name, "wb") as fout:
                n = int.from_bytes(fin.read(8), "little")
                fin.seek(0)
                fout.write(fin.read(8 + n))
                fout.truncate(f.stat().st_size)
        else:
            shutil.copy2(f, dst / f.name)
    assert loading._cache_is_complete(dst), "precondition: the copy is complete"
    yield dst
    shutil.rmtree(dst, ignore_errors=True)


def _truncate(path, keep_fraction=0.5):
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(int(size * keep_fraction))


def test_truncated_weights_detected(cache_copy):
    _truncate(cache_copy / "model.safetensors")
    assert not loading._cache_is_complete(cache_copy)


def test_truncated_tokenizer_detected(cache_copy):
    _truncate(cache_copy / "tokenizer.json", 0.9)
    assert not loading._cache_is_complete(cache_copy)


def test_missing_file_detected(cache_copy):
    (cache_copy / "config.json").unlink()
    assert not loading._cache_is_complete(cache_copy)


@pytest.mark.parametrize("how", ["missing", "garbage", "wrong-version", "wrong-size", "truncated"])
def test_corrupt_marker_detected(cache_copy, how):
    marker = cache_copy / "selfspec-cache.json"
    info = json.loads(marker.read_text())
    if how == "missing":
        marker.unlink()
    elif how == "garbage":
        marker.write_text("not json {")
    elif how == "wrong-version":
        marker.write_text(json.dumps({**info, "version": info["version"] + 1}))
    elif how == "wrong-size":
        info["files"]["model.safetensors"] += 1
        marker.write_text(json.dumps(info))
    else:
        _truncate(marker, 0.5)
    assert not loading._cache_is_complete(cache_copy)


def test_garbled_safetensors_header_detected(cache_copy):
    path = cache_copy / "model.safetensors"
    with open(path, "r+b") as f:
        f.seek(8)
        f.write(b"\xff" * 64)  # same size, unreadable header
    assert not loading._cache_is_complete(cache_copy)


def test_real_cache_untouched(default_model):
    assert loading._cache_is_complete(loading.default_model_dir())


def test_a_grammar_outside_the_draft_vocabulary_is_lossless(default_model_bf16):
    """Issue 51's report: Chinese characters under a regex, none of whose tokens the restricted
    draft head (the most frequent tokens of code) holds. Every strategy, greedy and seeded,
    gives autoregressive decoding's output under the grammar: five characters, then EOS."""
    m = default_model_bf16
    g = Grammar("regex", "[\u4e00-\u9fff]{5}")
    prompt = "Write three Chinese characters:"
    for samp in (dict(), dict(temperature=0.8, seed=3)):
        ref = ar_generate(m, prompt, max_new_tokens=24, grammar=g, **samp)
        assert len(ref.text) == 5 and ref.finish_reason == "eos", ref.text
        for kw in (dict(strategy="auto"), dict(strategy="quantized"), dict(strategy="early-exit", exit_layer=12, draft_vocab=16384)):
            out = m.generate(prompt, max_new_tokens=24, grammar=g, **kw, **samp)
            assert out.token_ids == ref.token_ids, (kw, samp, out.text)
