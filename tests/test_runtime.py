"""The runtime (issue "foundation"): our own layer loop must reproduce transformers.

For every supported architecture, tiny random-weight models built from transformers
configs are compared with transformers' own eager forward and greedy generate; the KV
cache must roll back exactly, and a forward over T positions must give bit-identical rows
to T single-token forwards (what makes speculative greedy output equal autoregressive).
"""

from __future__ import annotations

import pytest
import torch

import selfspec
from selfspec import kernels
from selfspec.architectures import SUPPORTED_ARCHITECTURES, ModelSpec
from selfspec.errors import SelfSpecError

from helpers import (
    ARCHS,
    VOCAB,
    build_hf,
    config_snapshot,
    hf_greedy,
    hf_logits,
    prompts,
    state_snapshot,
    tiny_config,
)

# Architectures plus a few variants that switch on otherwise-unused code paths.
VARIANTS = {
    **{a: (a, {}) for a in ARCHS},
    "llama_bias": ("llama", dict(attention_bias=True, mlp_bias=True)),
    "qwen2_sliding": ("qwen2", dict(use_sliding_window=True, sliding_window=8, max_window_layers=2)),
    "gemma3_softcap": ("gemma3", dict(final_logit_softcapping=3.0)),
}
TOL = 1e-4


def _decode_logits(rt, ids: list[int], prompt_len: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Prefill ids[:prompt_len] in one call, then decode the rest one token at a time."""
    cache = rt.new_cache(len(ids) + 8)
    with torch.inference_mode():
        pre = rt.forward(torch.tensor(ids[:prompt_len]), 0, cache)
        steps = [rt.forward(torch.tensor([ids[i]]), i, cache)[0] for i in range(prompt_len, len(ids))]
    return pre, steps


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_transformers_prefill_and_decode(zoo, variant):
    arch, kw = VARIANTS[variant]
    hf, model = zoo.get(arch, **kw)
    for prompt in prompts(n=2, lengths=(7, 13)):
        cont = hf_greedy(hf, prompt, 20)  # 27-33 positions: beyond every sliding window (8)
        ids = prompt + cont
        ref = hf_logits(hf, ids)
        pre, steps = _decode_logits(model.runtime, ids, len(prompt))
        assert pre.shape == (len(prompt), VOCAB)
        assert (pre - ref[: len(prompt)]).abs().max().item() < TOL
        for i, row in enumerate(steps):
            diff = (row - ref[len(prompt) + i]).abs().max().item()
            assert diff < TOL, f"{variant}: decode step {i} (position {len(prompt) + i}) differs by {diff}"


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_generate_matches_transformers(zoo, variant):
    arch, kw = VARIANTS[variant]
    hf, model = zoo.get(arch, **kw)
    for prompt, n in zip(prompts(n=3), (24, 17, 30)):
        ref = hf_greedy(hf, prompt, n)
        out = model.generate(prompt, max_new_tokens=n, strategy="autoregressive")
        assert out.token_ids == ref
        assert out.finish_reason == "length"
        assert out.prompt_tokens == len(prompt)
        assert out.stats.new_tokens == n


def test_features_under_test_change_the_output():
    """Guard for the comparisons above: the sliding window, llama3 rope scaling, the second
    Gemma rope base and the softcap really change transformers' logits on these configs,
    so a runtime that ignored them would fail."""
    ids = prompts(n=1, lengths=(30,))[0]

    def logits(arch, **kw):
        return hf_logits(build_hf(arch, **kw), ids)

    assert not torch.allclose(logits("mistral"), logits("mistral", sliding_window=None), atol=1e-3)
    qwen2_sliding = dict(use_sliding_window=True, sliding_window=8, max_window_layers=2)
    assert not torch.allclose(logits("qwen2", **qwen2_sliding), logits("qwen2"), atol=1e-3)
    assert not torch.allclose(
        logits("llama3"),
        logits("llama3", rope_parameters={"rope_type": "default", "rope_theta": 500000.0}),
        atol=1e-3,
    )
    gemma_one_base = {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "default", "rope_theta": 10000.0},
    }
    assert not torch.allclose(logits("gemma3"), logits("gemma3", rope_parameters=gemma_one_base), atol=1e-3)
    assert not torch.allclose(logits("gemma3"), logits("gemma3", sliding_window=1024), atol=1e-3)
    assert not torch.allclose(logits("gemma3"), logits("gemma3", query_pre_attn_scalar=16), atol=1e-3)


def test_spec_reads_architecture_switches(zoo):
    spec = {v: ModelSpec.from_hf_config(zoo.get(a, **kw)[0].config) for v, (a, kw) in VARIANTS.items()}
    assert spec["mistral"].sliding_windows == (8,) * 4
    assert spec["llama"].sliding_windows == (None,) * 4
    assert spec["qwen2_sliding"].sliding_windows == (None, None, 8, 8)
    assert spec["gemma3"].sliding_windows == (8, None, 8, None)
    assert spec["gemma3"].rope_kinds == ("sliding_attention", "full_attention") * 2
    assert spec["gemma3"].attn_scale == pytest.approx(24 ** -0.5)
    assert spec["gemma3"].embed_scale == pytest.approx(64 ** 0.5)
    assert spec["gemma3"].sandwich_norms and spec["gemma3"].qk_norm
    assert spec["qwen3"].qk_norm and not spec["qwen2"].qk_norm
    assert spec["qwen2"].qkv_bias and not spec["qwen2"].o_bias
    assert spec["llama_bias"].qkv_bias and spec["llama_bias"].o_bias and spec["llama_bias"].mlp_bias
    assert spec["llama3"].num_kv_heads == 1 and spec["llama3"].group_size == 4
    assert spec["llama3"].tie_embeddings and not spec["llama"].tie_embeddings


@pytest.mark.parametrize("arch", ARCHS)
def test_cache_rollback_is_exact(zoo, arch):
    """Writing KV for positions that are later rejected must leave no trace: re-decoding
    from an earlier position gives bit-identical logits to never having gone forward."""
    _, model = zoo.get(arch)
    rt = model.runtime
    seq = prompts(n=1, lengths=(30,), seed=11)[0]
    junk = prompts(n=1, lengths=(12,), seed=99)[0]
    P = 9
    with torch.inference_mode():
        clean = rt.new_cache(64)
        rt.forward(torch.tensor(seq[:P]), 0, clean)
        expected = [rt.forward(torch.tensor([seq[i]]), i, clean)[0] for i in range(P, len(seq))]

        dirty = rt.new_cache(64)
        rt.forward(torch.tensor(seq[:P]), 0, dirty)
        # go forward over rejected positions, several times, in blocks and single steps
        rt.forward(torch.tensor(junk), P, dirty)
        rt.forward(torch.tensor([junk[0]]), P, dirty)
        rt.forward(torch.tensor(junk[:5]), P + 3, dirty)
        # a drafter writes only some layers (early exit) or skips some (layer skip)
        h = rt.embed(torch.tensor(junk[:4]))
        rt.run_layers(h, 0, 2, P, dirty)
        rt.run_layers(h, 0, rt.num_layers, P, dirty, skip_attn=frozenset({1}), skip_mlp=frozenset({0}))
        got = [rt.forward(torch.tensor([seq[i]]), i, dirty)[0] for i in range(P, len(seq))]
    for i, (a, b) in enumerate(zip(expected, got)):
        assert torch.equal(a, b), f"{arch}: position {P + i} differs after rollback"


@pytest.mark.parametrize("arch", ARCHS)
def test_rollback_then_block_reverify(zoo, arch):
    """The speculative pattern: junk at P.., roll back to P, verify a block of real tokens."""
    _, model = zoo.get(arch)
    rt = model.runtime
    seq = prompts(n=1, lengths=(24,), seed=12)[0]
    P = 10
    with torch.inference_mode():
        clean = rt.new_cache(64)
        rt.forward(torch.tensor(seq[:P]), 0, clean)
        expected = rt.forward(torch.tensor(seq[P:]), P, clean)
        dirty = rt.new_cache(64)
        rt.forward(torch.tensor(seq[:P]), 0, dirty)
        rt.forward(torch.tensor(seq[P : P + 3] + [1, 2, 3, 4, 5]), P, dirty)
        got = rt.forward(torch.tensor(seq[P:]), P, dirty)
    assert torch.equal(expected, got)


# Wider models too: at hidden size 64 even an unpadded single-row BLAS matmul happens to agree
# with the multi-row kernel; from 128 on it does not (the M=1 gemv path rounds differently).
ROW_VARIANTS = {
    **{a: (a, {}) for a in ARCHS},
    "llama-wide": ("llama", dict(hidden_size=128, intermediate_size=256, vocab_size=512)),
    "gemma3-wide": ("gemma3", dict(hidden_size=256, intermediate_size=512, vocab_size=512, head_dim=64)),
}
# Where the guarantee could break without anyone noticing on one machine: the thread split,
# the cache's capacity (strides), where the allocator puts the buffers, a second run.
ALLOCATION_PATTERNS = [(1, 64, 0), (2, 64, 0), (1, 80, 13), (2, 272, 1001), (1, 64, 0)]  # (threads, capacity, junk floats)


def _block_and_steps(rt, seq: list[int], P: int, T: int, capacity: int, junk: int):
    """Logits and caches of a T-row pass at position P and of T single-row passes, after a
    P-token prefill; `junk` floats are allocated in between to move the buffers."""
    block_cache = rt.new_cache(capacity)
    pad = torch.empty(junk) if junk else None
    step_cache = rt.new_cache(capacity)
    rt.forward(torch.tensor(seq[:P]), 0, block_cache)
    rt.forward(torch.tensor(seq[:P]), 0, step_cache)
    block = rt.forward(torch.tensor(seq[P : P + T]), P, block_cache)
    steps = torch.cat([rt.forward(torch.tensor([seq[P + i]]), P + i, step_cache) for i in range(T)])
    del pad
    return block, steps, block_cache, step_cache


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("variant", list(ROW_VARIANTS))
def test_row_invariance(zoo, variant, dtype):
    """A forward over T positions == T single-token forwards, bit for bit (T = 2..17), under
    several allocation patterns, and the same bits under every pattern: on the CPU this is
    our kernels' guarantee by construction, so it must hold on every machine."""
    arch, kw = ROW_VARIANTS[variant]
    _, model = zoo.get(arch, dtype=dtype, **kw)
    rt = model.runtime
    require_kernels(rt)
    vocab = model.spec.vocab_size
    seq = prompts(n=1, lengths=(40,), seed=3)[0]
    P = 6
    bad, first = [], {}
    threads = torch.get_num_threads()
    try:
        with torch.inference_mode():
            for n_threads, capacity, junk in ALLOCATION_PATTERNS:
                torch.set_num_threads(n_threads)
                for T in range(2, 18):
                    block, steps, bc, sc = _block_and_steps(rt, seq, P, T, capacity, junk)
                    assert block.dtype == torch.float32 and block.shape == (T, vocab)
                    where = (T, n_threads, capacity, junk)
                    if not torch.equal(block, steps):
                        bad.append((where, (block - steps).abs().max().item()))
                    # and the KV the block wrote equals what the single steps wrote
                    if not (torch.equal(bc.kt[..., : P + T], sc.kt[..., : P + T]) and torch.equal(bc.v[:, :, : P + T], sc.v[:, :, : P + T])):
                        bad.append((where, "kv"))
                    if T not in first:
                        first[T] = block
                    elif not torch.equal(first[T], block):
                        bad.append((where, "differs from the first pattern"))
    finally:
        torch.set_num_threads(threads)
    assert not bad, f"{variant}/{dtype}: rows differ for ((T, threads, capacity, junk), what): {bad}"


def require_kernels(rt) -> None:
    """The CPU runtime must run on our kernels wherever the CPU can (a silent fallback to the
    BLAS would make the exactness tests pass or fail by luck)."""
    if rt.device.type == "cpu" and not rt.uses_kernels:
        if kernels_expected():
            pytest.fail(f"the CPU supports our kernels but they are unavailable: {kernels.load_error()}")
        pytest.skip("this CPU cannot run our kernels (no x86-64 AVX2/AVX-512): see test_torch_fallback_rows_are_close")


def kernels_expected() -> bool:
    """This machine can build and run the kernels (x86-64 with AVX2 + FMA + F16C or AVX-512, a
    compiler), and nobody switched them off."""
    import os
    import platform
    import shutil

    if os.environ.get("SELFSPEC_NO_KERNELS", "") not in ("", "0"):
        return False
    from selfspec.kernels import build

    return (platform.machine() in ("x86_64", "AMD64") and build.isa() is not None
            and shutil.which(os.environ.get("CC", "gcc")) is not None)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_torch_fallback_rows_are_close(monkeypatch, caplog, arch, dtype):
    """Without our kernels (no AVX2, no compiler, SELFSPEC_NO_KERNELS=1) the runtime falls
    back to torch, says once that exactness then rests on the BLAS, and still computes the
    same function: rows of a block pass agree with single steps to rounding (not bit for bit,
    which no BLAS promises)."""
    import selfspec.runtime as runtime_mod

    monkeypatch.setenv("SELFSPEC_NO_KERNELS", "1")
    monkeypatch.setattr(runtime_mod, "_warned_no_kernels", False)
    hf = build_hf(arch, seed=0, hidden_size=128, intermediate_size=256, vocab_size=512)
    with caplog.at_level("WARNING", logger="selfspec"):
        m = selfspec.load(hf, dtype=dtype)
        selfspec.load(hf, dtype=dtype)  # said once, not per load
    assert not m.runtime.uses_kernels and m.runtime.blocks is None
    warnings = [r for r in caplog.records if "kernels are unavailable" in r.getMessage()]
    assert len(warnings) == 1 and "BLAS" in warnings[0].getMessage()
    seq = prompts(n=1, lengths=(30,), seed=3, vocab=512)[0]
    with torch.inference_mode():
        block, steps, _, _ = _block_and_steps(m.runtime, seq, 6, 12, 64, 0)
    tol = 1e-4 if dtype == "float32" else 0.1  # bf16 roundings of different kernels
    assert (block - steps).abs().max().item() < tol * max(1.0, block.abs().max().item())


@pytest.mark.parametrize("arch", ARCHS)
def test_bfloat16_runtime_is_as_accurate_as_transformers_bfloat16(arch):
    """bfloat16 is not bit-exact with float32; the runtime's bf16 error (against the fp32
    reference) must be of the size of transformers' own bf16 error, not larger."""
    import copy

    hf = build_hf(arch, seed=1)
    ids = prompts(n=1, lengths=(20,))[0]
    ref = hf_logits(hf, ids)
    hf_err = (hf_logits(copy.deepcopy(hf).to(torch.bfloat16), ids) - ref).abs().max().item()
    m16 = selfspec.load(hf, dtype="bfloat16")
    assert m16.runtime.dtype == torch.bfloat16
    with torch.inference_mode():
        ours = m16.runtime.forward(torch.tensor(ids), 0, m16.runtime.new_cache(32))
    assert ours.dtype == torch.float32
    our_err = (ours - ref).abs().max().item()
    assert our_err <= 2 * hf_err + 0.1, f"{arch}: bf16 error {our_err} vs transformers' {hf_err}"


def test_unsupported_architecture_is_rejected():
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=32, n_embd=32, n_layer=1, n_head=2, n_positions=64))
    with pytest.raises(SelfSpecError) as e:
        selfspec.load(gpt2, dtype="float32")
    msg = str(e.value)
    assert "gpt2" in msg
    for name in SUPPORTED_ARCHITECTURES:
        assert name in msg
    assert set(SUPPORTED_ARCHITECTURES) >= {"llama", "mistral", "qwen2", "qwen3", "gemma3_text"}


@pytest.mark.parametrize("arch", ARCHS)
def test_user_model_and_config_not_mutated(arch):
    hf = build_hf(arch, seed=4)
    before_sd, before_cfg = state_snapshot(hf), config_snapshot(hf)
    before_attn = hf.config._attn_implementation
    m = selfspec.load(hf, dtype="float32")
    m.generate(prompts(n=1)[0], max_new_tokens=8, strategy="auto")
    m.generate(prompts(n=1)[0], max_new_tokens=8, strategy="early-exit", exit_layer=2)
    m.generate(prompts(n=1)[0], max_new_tokens=8, strategy="layer-skip", skip_mlp=[1], temperature=1.0, seed=0)
    m16 = selfspec.load(hf, dtype="bfloat16")
    m16.generate(prompts(n=1)[0], max_new_tokens=4, strategy="auto")
    after_sd = hf.state_dict()
    assert before_sd.keys() == after_sd.keys()
    for k, v in before_sd.items():
        assert after_sd[k].dtype == v.dtype, k
        assert torch.equal(after_sd[k], v), f"{arch}: parameter {k} was modified"
    assert config_snapshot(hf) == before_cfg
    assert hf.config._attn_implementation == before_attn
    assert all(p.dtype == torch.float32 for p in hf.parameters())


@pytest.mark.parametrize("vocab", [16, 63])
def test_load_tiny_vocabulary(vocab):
    """Any vocabulary size loads (the sampling tests use 12 tokens)."""
    hf = build_hf("llama", seed=0, vocab_size=vocab)
    m = selfspec.load(hf, dtype="float32")
    prompt = [1, 2, 3, 4]
    assert m.generate(prompt, max_new_tokens=10, strategy="autoregressive").token_ids == hf_greedy(hf, prompt, 10)
    assert isinstance(m.fingerprint, str) and m.fingerprint


@pytest.mark.parametrize("arch", ARCHS)
def test_fused_blocks_agree_with_torch_ops(arch):
    """bf16 on the CPU runs one C call per sub-layer (kernels.FusedBlocks); it must compute the
    same function as the op-by-op torch path (up to bf16 rounding), over sliding windows too."""
    hf = build_hf(arch, seed=2)
    m16 = selfspec.load(hf, dtype="bfloat16")
    rt = m16.runtime
    require_kernels(rt)
    assert rt.blocks is not None
    ids = torch.tensor(prompts(n=1, lengths=(30,), seed=5)[0])
    with torch.inference_mode():
        fused = rt.forward(ids, 0, rt.new_cache(64))
        blocks, rt.blocks = rt.blocks, None
        try:
            plain = rt.forward(ids, 0, rt.new_cache(64))
        finally:
            rt.blocks = blocks
    # fp32 reference: the fused path keeps fp32 between its matmuls, so it is at least as
    # close as the op-by-op bf16 path (measured: 0.07-0.48 vs 0.12-0.93 on these models).
    ref = hf_logits(hf, ids.tolist())
    fused_err, plain_err = (fused - ref).abs().max().item(), (plain - ref).abs().max().item()
    assert fused_err <= plain_err + 0.05, f"{arch}: fused error {fused_err} vs op-by-op {plain_err}"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_long_prefill_rows_equal_split_and_single_steps(zoo, arch, dtype):
    """Prefill-sized passes (over 64 rows: the fused attention works in 64-row chunks and the
    kernel switches to its many-row path) give the bits of shorter passes and of single steps."""
    _, model = zoo.get(arch, dtype=dtype)
    rt = model.runtime
    require_kernels(rt)
    seq = torch.tensor(prompts(n=1, lengths=(150,), seed=9)[0])
    with torch.inference_mode():
        one, split = rt.new_cache(160), rt.new_cache(160)
        whole = rt.forward(seq, 0, one)
        parts = torch.cat([rt.forward(seq[:70], 0, split), rt.forward(seq[70:140], 70, split)]
                          + [rt.forward(seq[i : i + 1], i, split) for i in range(140, 150)])
    assert torch.equal(whole, parts)
    assert torch.equal(one.kt, split.kt) and torch.equal(one.v, split.v)


def test_default_dtype_is_bfloat16_wherever_the_kernels_run(monkeypatch):
    """Our kernels widen bf16 exactly in registers on any AVX2 CPU, so bf16 (half the bytes) is
    the CPU default wherever they run, whatever torch's own bf16 support (none on AVX2 CPUs:
    there the README's first command ran float32 at ~0.6x the speed); without them, torch's
    choice."""
    from selfspec.model import default_dtype

    if kernels_expected():
        assert default_dtype("cpu") == "bfloat16"
    monkeypatch.setenv("SELFSPEC_NO_KERNELS", "1")
    native = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert default_dtype("cpu") == ("bfloat16" if native else "float32")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_step_token_is_the_primitives_argmax(variant, dtype):
    """Runtime.step_token (one C call) is embed -> run_layers -> logits -> argmax through the
    primitives: the same tokens (with logits=True the same logits, bit for bit) and the same
    keys/values written, for one row and several, the full head, a restricted head (prepared,
    and int8), a quantized copy of the layers, an early exit and skipped sub-layers."""
    from selfspec.quant import quantize_columns

    arch, kw = VARIANTS[variant]
    m = selfspec.load(build_hf(arch, seed=5, **kw), dtype=dtype)
    rt = m.runtime
    require_kernels(rt)
    vocab = torch.arange(1, m.spec.vocab_size, 3)
    heads = {"full": None, "restricted": rt.prepare_weight(rt.head_columns(vocab).contiguous()),
             "int8": quantize_columns(rt.head_columns(vocab), 8)}
    L = rt.num_layers
    cases = [(rt, h, L, (), ()) for h in heads] + [(rt.quantized(8), "int8", L, (), ()), (rt.quantized(8), "full", L - 1, (), ()),
                                                  (rt, "restricted", L, (1,), (0, 2))]
    p = prompts(n=1, lengths=(12,), seed=3)[0]
    with torch.inference_mode():
        for r, name, end, skip_attn, skip_mlp in cases:
            head, sa, sm = heads[name], frozenset(skip_attn), frozenset(skip_mlp)
            one, ref, rows = rt.new_cache(48), rt.new_cache(48), rt.new_cache(48)
            for c in (one, ref, rows):
                rt.forward(torch.tensor(p), 0, c)
            ids, pos = [p[-1]], len(p)
            for j in range(8):  # 1 row, then 3, alternately
                got = r.step_token(ids, pos, one, end, head, sa, sm)
                got_logits = r.step_token(ids, pos, rows, end, head, sa, sm, logits=True)
                h = r.run_layers(r.embed(torch.tensor(ids)), 0, end, pos, ref, sa, sm)
                logits = r.logits(h, head=head)
                want = logits.argmax(-1).tolist()
                assert got == want, (variant, name, end, j)
                assert torch.equal(got_logits, logits), (variant, name, end, j)
                toks = want if head is None else vocab[want].tolist()
                pos += len(ids)
                ids = toks[-1:] if j % 2 else [toks[-1], (toks[-1] * 7 + 1) % m.spec.vocab_size, 5]
            for c in (one, rows):
                assert torch.equal(c.kt, ref.kt) and torch.equal(c.v, ref.v), (variant, name)


@pytest.mark.parametrize("arch,rope", [(a, None) for a in ARCHS] + [
    ("llama", {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}),
    ("qwen2", {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128}),
    ("llama", {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}),
])
def test_rotary_tables_are_the_transformers_modules_own(arch, rope):
    """The tables computed without importing the modeling module equal the rotary module's own,
    bit for bit (the same functions, the same elementwise ops), for every family and scaling."""
    from selfspec.architectures import _module_tables, rotary_tables
    config = tiny_config(arch, **({} if rope is None else {"rope_parameters": rope}))
    spec = ModelSpec.from_hf_config(config)
    ours, theirs = rotary_tables(config, spec, 700), _module_tables(config, spec, 700)
    assert ours.keys() == theirs.keys()
    for k in ours:
        assert torch.equal(ours[k][0], theirs[k][0]) and torch.equal(ours[k][1], theirs[k][1]), k
