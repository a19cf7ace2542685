"""The AMX pair path (opt-in, SELFSPEC_AMX=1; csrc/gemm.c gemm_amx): its own chain (TDPBF16PS
per 16 pairs of k, chunks in increasing k), which must give every row the same bits whatever
the row count, thread count and tails, stay close to exact arithmetic, and keep greedy
speculative decoding identical to autoregressive decoding. Skipped where the CPU, the
compiler or the kernel (arch_prctl) gives no AMX-BF16."""

from __future__ import annotations

import pytest
import torch

from selfspec import kernels
from selfspec.kernels import build

from helpers import ar_generate
from test_engine import N_NEW, STRATEGIES, _cfg, _prompts, _token_frequencies, draft_model_dir  # noqa: F401
from test_kernels import SHAPES, _operands, needs_pairs


def _amx_possible() -> bool:
    if not kernels.has_pairs() or "amx_bf16" not in build._cpu_flags():
        return False
    was = kernels.amx()
    ok = build.set_amx(True)
    build.set_amx(was)
    return ok


needs_amx = pytest.mark.skipif(not (kernels.has_pairs() and _amx_possible()), reason="no AMX-BF16 pair path here")
pytestmark = [needs_pairs, needs_amx]


@pytest.fixture
def amx_on():
    """AMX for the test, then back to what the process had (the suite runs without it)."""
    was = kernels.amx()
    assert build.set_amx(True)
    yield
    build.set_amx(was)


@pytest.mark.parametrize("k,n", SHAPES + [(48, 130), (2048, 640)])
@pytest.mark.parametrize("xdt", [torch.bfloat16, torch.float32])
def test_amx_chain_is_row_and_thread_invariant(k, n, xdt, amx_on):
    """Rows 1..40 (one tile block, several, a padded last one), one thread or all, K pairs
    not a multiple of 16 and N not of 64: row m always has the bits of the 40-row product."""
    x, w = _operands(k, n, xdt, torch.bfloat16, m=40)
    p = kernels.pack(w)
    assert p.pairs and kernels.amx()
    full = kernels.matmul(x, p)
    for m in (1, 2, 3, 7, 15, 16, 17, 31, 33, 40):
        assert torch.equal(kernels.matmul(x[:m], p), full[:m]), m
        assert torch.equal(kernels.matmul(x[m - 1 : m], p, num_threads=1), full[m - 1 : m]), m
    # close to exact arithmetic: x rounded to bf16, then an fp32 accumulation (the rounding
    # inside an instruction is the hardware's, so a bound, not bits)
    exact = x.bfloat16().double() @ w.double()
    scale = (x.double().abs() @ w.double().abs()).clamp_min(1e-30)
    assert ((full.double() - exact).abs() / scale).max().item() <= (2**-8 if xdt == torch.bfloat16 else 0) + k * 2**-24


def test_switching_back_gives_the_vdpbf16_bits():
    x, w = _operands(640, 256, torch.float32, torch.bfloat16, m=7)
    p = kernels.pack(w)
    was = kernels.amx()
    try:
        assert build.set_amx(True)
        on = kernels.matmul(x, p)
        assert kernels.build_id().endswith("+amx")  # costs measured under one chain are not the other's
        assert not build.set_amx(False)
        assert torch.equal(kernels.matmul(x, p), kernels._reference_pairs(x, w))
        assert not torch.equal(on, kernels._reference_pairs(x, w))  # a chain of its own (measured)
    finally:
        build.set_amx(was)


@pytest.mark.parametrize("arch", ["gemma3", "llama3"])
def test_bfloat16_strategies_equal_autoregressive_on_amx(zoo, draft_model_dir, arch, amx_on):  # noqa: F811
    """Every draft strategy (early exit, layer skip, lookup, draft model, quantized) verifies
    on the AMX chain: the output is the AMX autoregressive output, token for token."""
    _, model = zoo.get(arch, dtype="bfloat16")
    assert model.runtime.uses_kernels
    _token_frequencies(model)
    for prompt in _prompts()[:2]:
        ar = ar_generate(model, prompt, max_new_tokens=N_NEW).token_ids
        for _, kw in STRATEGIES:
            assert model.generate(prompt, max_new_tokens=N_NEW, **_cfg(kw, draft_model_dir)).token_ids == ar, kw


@pytest.mark.slow
def test_default_model_auto_equals_autoregressive_on_amx(default_model_bf16, amx_on):
    m = default_model_bf16
    for prompt in ("def fibonacci(n):", "The history of the printing press"):
        ar = ar_generate(m, prompt, max_new_tokens=48).token_ids
        assert m.generate(prompt, max_new_tokens=48, strategy="auto").token_ids == ar
        assert m.generate(prompt, max_new_tokens=48, strategy="quantized").token_ids == ar
