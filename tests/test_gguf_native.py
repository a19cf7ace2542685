"""A GGUF's own blocks multiplied as stored (csrc/ggml_gemm.c, kernels/ggml_gemm.py,
ggml_weights.py): each block type against dequantize-then-matmul in float64, the vector code
against its scalar reference bit for bit, row invariance (1 row vs 16 vs more), and a tiny
GGUF run natively: every strategy's greedy output token-identical to its autoregressive output,
seeded sampling too, and --dtype bfloat16 keeping the dequantized path."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf.constants import GGML_QUANT_SIZES

import helpers
from gguf_files import random_blocks, write_gguf

import selfspec
from selfspec import kernels
from selfspec.ggml_weights import GGMLRuntime
from selfspec.kernels.ggml_gemm import PACKED, QUANTIZED, TYPES, GGMLWeight, reference

Q = gguf.GGMLQuantizationType
pytestmark = pytest.mark.skipif(not kernels.available(), reason="needs selfspec's kernels")


def _weight(qtype, rows: int, cols: int, seed: int) -> GGMLWeight:
    if qtype in QUANTIZED:
        return GGMLWeight([(random_blocks(qtype, rows, cols, seed), qtype)], cols)
    w = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)) * 0.05  # F16 / BF16: values as stored
    raw = w.half().view(torch.uint8) if qtype == Q.F16 else w.bfloat16().view(torch.uint8)
    return GGMLWeight([(raw.numpy(), qtype)], cols)


@pytest.mark.parametrize("qtype", sorted(TYPES, key=int))
def test_block_matmul_matches_float64_and_its_scalar_chain(qtype):
    K = 512
    w = _weight(qtype, 72, K, seed=int(qtype))
    assert w.packed == ([0] if qtype in PACKED else [])  # eight rows side by side: the same chain
    x = torch.randn(16, K, generator=torch.Generator().manual_seed(1))
    y = kernels.matmul(x, w)
    assert torch.equal(y, reference(x, w))  # the vector code is the documented chain, bit for bit
    exact = x.double() @ w.dequantize().double()
    # activations in int8 per 32 (K-quants: 256) values; F16 / BF16 rows: fp32 chains of the unquantized x
    assert ((y.double() - exact).norm() / exact.norm()).item() < (2e-2 if qtype in QUANTIZED else 1e-6)
    # bf16 activations and output: the same chain over the widened x, rounded once
    yb = kernels.matmul(x.bfloat16(), w)
    assert torch.equal(yb, reference(x.bfloat16().float(), w).bfloat16())
    # one row has its own paths (two weight rows at a time, an odd one left), and rows not a
    # multiple of 8 are not packed: the same chain
    w = _weight(qtype, 71, K, seed=int(qtype) + 1)
    assert w.packed == []
    assert torch.equal(kernels.matmul(x[:1], w), reference(x[:1], w))
    assert torch.equal(kernels.matmul(x[:5], w), reference(x[:5], w))


@pytest.mark.parametrize("qtype", sorted(QUANTIZED, key=int))
@pytest.mark.parametrize("fill", [0xFF, 0x00, 0x80])
@pytest.mark.parametrize("rows", [9, 16])  # 16: packed where the type is
def test_extreme_blocks_do_not_saturate(qtype, fill, rows):
    """Every stored value at its largest (or smallest) magnitude, every scale byte alike, against
    activations at +-127 after quantization: the vector code's 16-bit pair sums and 32-bit
    super-block sums must hold them exactly (the scalar chain adds in plain int)."""
    K = 512
    raw = np.full((rows, K // GGML_QUANT_SIZES[qtype][0] * GGML_QUANT_SIZES[qtype][1]), fill, np.uint8)
    ref = random_blocks(qtype, rows, K, seed=5)  # its fp16 scales only
    for off in {Q.Q4_1: (0, 2), Q.Q5_1: (0, 2), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}.get(qtype, (0,)):
        blocks = raw.reshape(rows, -1, GGML_QUANT_SIZES[qtype][1])
        blocks[..., off:off + 2] = ref.reshape(rows, -1, GGML_QUANT_SIZES[qtype][1])[..., off:off + 2]
    w = GGMLWeight([(raw, qtype)], K)
    sign = torch.ones(K)
    x = torch.stack([sign, -sign, sign * torch.tensor([1.0, -1.0]).repeat(K // 2)])
    y = kernels.matmul(x, w)
    assert torch.equal(y, reference(x, w)) and torch.equal(kernels.matmul(x[2:], w), y[2:])
    exact = x.double() @ w.dequantize().double()
    assert torch.allclose(y.double(), exact, rtol=1e-5, atol=1e-6 * exact.abs().max().item())  # |x| all 1: xq = +-127 exactly


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_K])  # activation blocks of 32 and of 256 values
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_activation_quantization_edge_cases_match_the_scalar_definition(qtype, dtype):
    """The kernel quantizes activations with vector code, the reference with the scalar loop that
    defines the bits: halves that round to even, NaN (-> -127, never the block's maximum), an
    all-zero block, subnormal and huge values must come out the same."""
    K = 512
    w = _weight(qtype, 40, K, seed=9)
    x = torch.randn(6, K, generator=torch.Generator().manual_seed(4))
    x[0] = torch.arange(K) % 9 - 4 + 0.5  # with 127 in each block below: scale 1, every value a tie
    x[0, ::32] = 127.0
    x[1, 5], x[1, 300] = float("nan"), float("nan")
    x[2, :256] = 0.0  # a whole block of either size
    x[3] *= 1e-40  # subnormal in fp32 (bf16 keeps them too)
    x[4] *= 1e30
    x[5, 7] = -1e4  # one value sets the scale; the rest round to 0 or +-1
    x = x.to(dtype)
    y = kernels.matmul(x, w)
    assert torch.equal(y, reference(x.float(), w).to(dtype))
    assert torch.isfinite(y[:3]).all()
    assert torch.equal(kernels.matmul(x[1:2], w), y[1:2])  # and one row alone


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.IQ4_NL, Q.IQ4_XS, Q.F16, Q.BF16])
@pytest.mark.parametrize("n", [300, 304])  # 304: packed where the type is
def test_rows_do_not_depend_on_how_many_are_computed(qtype, n):
    K = 256
    w = _weight(qtype, n, K, seed=3)  # several threads' shares of N
    x = torch.randn(40, K, generator=torch.Generator().manual_seed(2))  # several passes of up to 8 rows
    batch = kernels.matmul(x, w)
    one = torch.cat([kernels.matmul(x[i:i + 1], w) for i in range(40)])
    sixteen = torch.cat([kernels.matmul(x[i:i + 16], w) for i in range(0, 40, 16)])
    assert torch.equal(batch, one) and torch.equal(batch, sixteen)
    for r in range(2, 10):  # every row count a pass compiles as a constant, and one over it
        assert torch.equal(kernels.matmul(x[:r], w), batch[:r]), r
    assert torch.equal(batch, kernels.matmul(x, w, num_threads=1))


def test_mixed_parts_are_one_matrix_of_their_columns():
    K = 256
    kinds = ((Q.Q4_K, 64), (Q.Q5_0, 32), (Q.Q8_0, 36))
    parts = [(random_blocks(q, n, K, seed=i), q) for i, (q, n) in enumerate(kinds)]
    parts.append((_weight(Q.F16, 16, K, seed=5).parts[0][0], Q.F16))
    x = torch.randn(5, K, generator=torch.Generator().manual_seed(4))
    for ps, packed in ((parts, [0, 1]), ([parts[2], parts[1]], [])):  # 36 rows, then rows from 36: as stored
        fused = GGMLWeight(ps, K)
        assert fused.packed == packed
        alone = torch.cat([kernels.matmul(x, GGMLWeight([p], K)) for p in ps], 1)
        assert torch.equal(kernels.matmul(x, fused), alone)
    fused = GGMLWeight(parts, K)
    ids = torch.tensor([0, 70, 127, 100, 3, 140])
    assert torch.equal(fused.rows(ids), fused.dequantize().t()[ids])


def test_bad_weights_are_refused():
    with pytest.raises(ValueError, match="not rows of 256 Q4_K"):
        GGMLWeight([(random_blocks(Q.Q4_K, 4, 256, 0)[:, :100], Q.Q4_K)], 256)
    with pytest.raises(ValueError, match="not multiplied natively"):
        GGMLWeight([(np.zeros((4, 84), np.uint8), Q.Q2_K)], 256)
    with pytest.raises(ValueError, match="shape mismatch"):
        kernels.matmul(torch.randn(2, 128), _weight(Q.Q8_0, 4, 256, 0))


# ---- a tiny GGUF run natively ----------------------------------------------------------------

# a Q4_K_M-like mix over a Gemma 3 whose rows are whole 256-value super-blocks
_MIX = {"attn_q": Q.Q5_0, "attn_k": Q.Q4_K, "attn_v": Q.Q6_K, "attn_output": Q.IQ4_XS, "ffn_gate": Q.Q5_K,
        "ffn_up": Q.Q5_1, "ffn_down": Q.Q6_K, "token_embd": Q.Q8_0}
N_NEW = 24


@pytest.fixture(scope="module")
def native(tmp_path_factory):
    hf = helpers.build_hf("gemma3", seed=5, num_layers=4, hidden_size=256, intermediate_size=512, head_dim=64)
    path = write_gguf(hf, tmp_path_factory.mktemp("gguf") / "mix.gguf", Q.Q8_0, _MIX)
    model = selfspec.load(path, tokenizer=helpers.word_tokenizer(), dtype="native")
    assert isinstance(model.runtime, GGMLRuntime) and model.runtime.numerics == "cpu-ggml"
    return model, path


_STRATEGIES = [
    dict(strategy="early-exit", exit_layer=2, num_speculations=4),
    dict(strategy="early-exit", exit_layer=1, num_speculations=8, draft_vocab=40),
    dict(strategy="layer-skip", skip_mlp=(1, 2)),
    dict(strategy="layer-skip", skip_attn=(0,), skip_mlp=(3,), num_speculations=8),
    dict(strategy="prompt-lookup"),
    dict(strategy="quantized", draft_bits=4, num_speculations=5),
    dict(strategy="auto"),
]


@pytest.mark.parametrize("kw", _STRATEGIES, ids=lambda kw: "-".join(str(v) for v in kw.values()))
def test_greedy_speculation_is_autoregressive_on_blocks(native, kw):
    model, _ = native
    for prompt in helpers.prompts(n=2):
        ar = model.generate(prompt, max_new_tokens=N_NEW, strategy="autoregressive").token_ids
        assert model.generate(prompt, max_new_tokens=N_NEW, **kw).token_ids == ar


def test_seeded_sampling_and_batches_are_exact_on_blocks(native):
    model, _ = native
    prompts = helpers.prompts(n=3)
    for kw in ({"strategy": "layer-skip", "skip_mlp": (1,)}, {"strategy": "early-exit", "exit_layer": 2}):
        for p in prompts:
            ar = model.generate(p, max_new_tokens=N_NEW, strategy="autoregressive", temperature=0.8, seed=11).token_ids
            assert model.generate(p, max_new_tokens=N_NEW, temperature=0.8, seed=11, **kw).token_ids == ar
    solo = [model.generate(p, max_new_tokens=N_NEW, strategy="autoregressive").token_ids for p in prompts]
    batch = model.generate_batch(prompts, max_new_tokens=N_NEW, strategy="early-exit", exit_layer=2)
    assert [r.token_ids for r in batch] == solo


def test_int8_draft_copy_is_refused_in_one_line(native):
    model, _ = native
    with pytest.raises(selfspec.SelfSpecError, match="more bytes than its own blocks"):
        model.generate(helpers.prompts(n=1)[0], max_new_tokens=4, strategy="quantized", draft_bits=8)


def test_dtype_bfloat16_keeps_the_dequantized_path(native):
    _, path = native
    model = selfspec.load(path, tokenizer=helpers.word_tokenizer(), dtype="bfloat16")
    assert not isinstance(model.runtime, GGMLRuntime)
    # the native model is the file's values: its logits track the fp32 dequantized model's
    ref = selfspec.load(path, tokenizer=helpers.word_tokenizer(), dtype="float32")
    nat, _ = native
    ids = torch.tensor(helpers.prompts(n=1)[0])
    with torch.inference_mode():
        a = nat.runtime.forward(ids, 0, nat.runtime.new_cache(32))
        b = ref.runtime.forward(ids, 0, ref.runtime.new_cache(32))
    assert ((a - b).norm() / b.norm()).item() < 0.1
    # one model whichever way it runs: its profiles and kept costs are found by the same fingerprint
    assert nat.fingerprint == model.fingerprint == ref.fingerprint


def test_auto_dequantizes_where_that_fits_and_runs_blocks_where_only_they_fit(native, monkeypatch):
    _, path = native
    model = selfspec.load(path, tokenizer=helpers.word_tokenizer())  # auto, the default
    assert not isinstance(model.runtime, GGMLRuntime) and model.runtime.dtype == torch.bfloat16
    from selfspec import ggml_weights, loading
    spec = model.spec
    blocks, bf16 = ggml_weights.native_bytes(spec), loading.runtime_bytes(spec, torch.bfloat16)
    assert blocks < bf16
    monkeypatch.setattr(loading, "available_memory", lambda device="cpu": (blocks + bf16) // 2)
    small = selfspec.load(path, tokenizer=helpers.word_tokenizer())
    assert isinstance(small.runtime, GGMLRuntime)
    prompt = helpers.prompts(n=1)[0]
    ar = dict(max_new_tokens=8, strategy="autoregressive")
    assert small.generate(prompt, **ar).token_ids == native[0].generate(prompt, **ar).token_ids
    with pytest.raises(selfspec.SelfSpecError, match="cannot fit"):  # explicit bfloat16: refused, not switched
        selfspec.load(path, tokenizer=helpers.word_tokenizer(), dtype="bfloat16")
    monkeypatch.setattr(loading, "available_memory", lambda device="cpu": blocks // 2)
    with pytest.raises(selfspec.SelfSpecError, match="even on its own blocks"):
        selfspec.load(path, tokenizer=helpers.word_tokenizer())


def test_auto_runs_the_blocks_of_files_above_its_size(native, monkeypatch):
    from selfspec import ggml_weights
    model, path = native
    monkeypatch.setattr(ggml_weights, "NATIVE_ABOVE", 0)  # the tiny file counts as a 1B
    auto = selfspec.load(path, tokenizer=helpers.word_tokenizer())
    assert isinstance(auto.runtime, GGMLRuntime)
    prompt = helpers.prompts(n=1)[0]
    ar = dict(max_new_tokens=8, strategy="autoregressive")
    assert auto.generate(prompt, **ar).token_ids == model.generate(prompt, **ar).token_ids
    assert not isinstance(selfspec.load(path, tokenizer=helpers.word_tokenizer(), dtype="bfloat16").runtime, GGMLRuntime)


@pytest.mark.parametrize("qtype", [Q.F16, Q.BF16])
def test_full_precision_files_run_as_stored(qtype, tmp_path):
    """F16 / BF16 matrices multiply the fp32 activations unquantized: the native model is the
    file's fp32 dequantized model to fp32 rounding (not rounded to bf16 first), and its
    speculation is exact."""
    hf = helpers.build_hf("llama", seed=2)
    path = write_gguf(hf, tmp_path / f"{qtype.name}.gguf", qtype)
    model = selfspec.load(path, tokenizer=helpers.word_tokenizer(), dtype="native")
    assert isinstance(model.runtime, GGMLRuntime)
    ids = torch.tensor(helpers.prompts(n=1, lengths=(12,))[0])

    def logits(m) -> torch.Tensor:
        with torch.inference_mode(), m.runtime.compute_scope():
            return m.runtime.forward(ids, 0, m.runtime.new_cache(16))

    want = logits(selfspec.load(path, tokenizer=helpers.word_tokenizer(), dtype="float32"))
    assert ((logits(model) - want).norm() / want.norm()).item() < 3e-5  # ~2e-6 here; --dtype bfloat16: ~3e-2
    for prompt in helpers.prompts(n=2):
        ar = model.generate(prompt, max_new_tokens=N_NEW, strategy="autoregressive").token_ids
        assert model.generate(prompt, max_new_tokens=N_NEW, strategy="layer-skip", skip_mlp=(1, 2)).token_ids == ar
        # an int8 copy reads half of F16 / BF16 layers' bytes: allowed here (refused over quantized blocks)
        assert model.generate(prompt, max_new_tokens=N_NEW, strategy="quantized", draft_bits=8).token_ids == ar
    assert model.runtime.draft_bits == (4, 8)


def test_native_refuses_blocks_it_cannot_run_in_one_line(tmp_path, monkeypatch):
    hf = helpers.build_hf("llama", seed=1, hidden_size=256, intermediate_size=256)
    q2k = write_gguf(hf, tmp_path / "q2_k.gguf", Q.Q2_K)  # Q2_K blocks: not multiplied natively (yet)
    from selfspec import ggml_weights, gguf_load
    assert "Q2_K" in ggml_weights.native_reason(gguf_load.GGUFCheckpoint(gguf_load.GGUFFile(q2k)), "cpu")
    with pytest.raises(selfspec.SelfSpecError, match="cannot run as stored"):
        selfspec.load(q2k, tokenizer=helpers.word_tokenizer(), dtype="native")
    monkeypatch.setattr(ggml_weights, "NATIVE_ABOVE", 0)  # auto would take the blocks by size: it dequantizes them
    model = selfspec.load(q2k, tokenizer=helpers.word_tokenizer())
    assert not isinstance(model.runtime, GGMLRuntime)
    prompt = helpers.prompts(n=1)[0]
    assert model.generate(prompt, max_new_tokens=8, strategy="early-exit", exit_layer=1).token_ids == \
        model.generate(prompt, max_new_tokens=8, strategy="autoregressive").token_ids


def test_biases_run_on_blocks(tmp_path):
    """Qwen2's q/k/v biases (fp32 in the file) are added to the blocks' outputs: the native model
    tracks the file's dequantized one (the control: the same file without its biases is far off),
    and its speculation stays exact."""
    hf = helpers.build_hf("qwen2", seed=8, hidden_size=128, intermediate_size=256)
    path = write_gguf(hf, tmp_path / "qwen2.gguf", Q.Q8_0)
    model = selfspec.load(path, tokenizer=helpers.word_tokenizer(), dtype="native")
    assert isinstance(model.runtime, GGMLRuntime) and "bqkv" in model.runtime.layers[0]
    ids = torch.tensor(helpers.prompts(n=1, lengths=(12,))[0])

    def logits(m) -> torch.Tensor:
        with torch.inference_mode(), m.runtime.compute_scope():
            return m.runtime.forward(ids, 0, m.runtime.new_cache(16))

    want, got = logits(selfspec.load(path, tokenizer=helpers.word_tokenizer(), dtype="float32")), logits(model)
    with torch.no_grad():
        for layer in hf.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.zero_()
    unbiased = write_gguf(hf, tmp_path / "qwen2-unbiased.gguf", Q.Q8_0)
    off = logits(selfspec.load(unbiased, tokenizer=helpers.word_tokenizer(), dtype="float32"))
    err = ((got - want).norm() / want.norm()).item()  # activations in int8 per 32 values: ~0.1 on a tiny random model
    assert err < 0.15 and ((off - want).norm() / want.norm()).item() > 3 * err, (err, ((off - want).norm() / want.norm()).item())
    for prompt in helpers.prompts(n=2):
        ar = model.generate(prompt, max_new_tokens=N_NEW, strategy="autoregressive").token_ids
        for kw in (dict(strategy="early-exit", exit_layer=2), dict(strategy="quantized", draft_bits=4)):
            assert model.generate(prompt, max_new_tokens=N_NEW, **kw).token_ids == ar
