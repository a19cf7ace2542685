"""The AMX pair path (csrc/gemm.c gemm_amx; the runtime's bf16 layer matrices where the CPU has
AMX-BF16, unless SELFSPEC_AMX=0): its own chain (TDPBF16PS per 16 pairs of k, chunks in
increasing k), which must give every row the same bits whatever the row count, thread count
and tails, stay close to exact arithmetic, and keep greedy speculative decoding identical to
autoregressive decoding. Skipped where the CPU, the compiler or the kernel (arch_prctl) gives
no AMX-BF16."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from selfspec import kernels

from helpers import ar_generate
from test_engine import N_NEW, STRATEGIES, _cfg, _prompts, _token_frequencies
from test_kernels import SHAPES, _operands, needs_pairs

needs_amx = pytest.mark.skipif(not kernels.amx(), reason="no AMX-BF16 pair path here (or SELFSPEC_AMX=0)")
pytestmark = [needs_pairs, needs_amx]
LAYER_MATRICES = ("wqkv", "wo", "w_gate_up", "w_down")


@pytest.mark.parametrize("k,n", SHAPES + [(48, 130), (2048, 640)])
@pytest.mark.parametrize("xdt", [torch.bfloat16, torch.float32])
def test_amx_chain_is_row_and_thread_invariant(k, n, xdt):
    """Rows 1..40 (one tile block, several, a padded last one), one thread or all, K pairs
    not a multiple of 16 and N not of 64: row m always has the bits of the 40-row product."""
    x, w = _operands(k, n, xdt, torch.bfloat16, m=40)
    p = kernels.pack(w, amx=True)
    assert p.pairs and p.amx and p.layout == 4
    full = kernels.matmul(x, p)
    for m in (1, 2, 3, 7, 15, 16, 17, 31, 33, 40):
        assert torch.equal(kernels.matmul(x[:m], p), full[:m]), m
        assert torch.equal(kernels.matmul(x[m - 1 : m], p, num_threads=1), full[m - 1 : m]), m
    # close to exact arithmetic: x rounded to bf16, then an fp32 accumulation (the rounding
    # inside an instruction is the hardware's, so a bound, not bits)
    exact = x.bfloat16().double() @ w.double()
    scale = (x.double().abs() @ w.double().abs()).clamp_min(1e-30)
    assert ((full.double() - exact).abs() / scale).max().item() <= (2**-8 if xdt == torch.bfloat16 else 0) + k * 2**-24


def test_a_chain_of_its_own_with_the_same_data():
    """The AMX weight holds the pair layout's very bytes (unpack, columns, the VDPBF16PS path all
    read it the same way); only its matmuls differ from VDPBF16PS's bits, and not by much."""
    x, w = _operands(640, 256, torch.float32, torch.bfloat16, m=7)
    p, q = kernels.pack(w, amx=True), kernels.pack(w)
    assert torch.equal(p.data, q.data) and torch.equal(p.unpack(), w) and not q.amx
    a, v = kernels.matmul(x, p), kernels.matmul(x, q)
    assert torch.equal(v, kernels._reference_pairs(x, w))
    assert not torch.equal(a, v)  # measured: TDPBF16PS's sum matches no sequential fp32 chain
    assert ((a - v).abs() / v.abs().clamp_min(1e-3)).max().item() < 1e-3
    assert kernels.build_id().endswith("+amx")  # costs measured with AMX layers are their own


def test_amx_needs_the_pair_layout():
    with pytest.raises(ValueError, match="pair layout"):
        kernels.PackedWeight(torch.zeros(1, 4, 64), 4, 64, pairs=False, amx=True)


@pytest.mark.parametrize("arch", ["gemma3", "llama3"])
def test_bfloat16_strategies_equal_autoregressive_on_amx(zoo, draft_model_dir, arch):  # noqa: F811
    """Every draft strategy (early exit, layer skip, lookup, draft model, quantized) verifies
    on the AMX chain: the output is the AMX autoregressive output, token for token."""
    _, model = zoo.get(arch, dtype="bfloat16")
    rt = model.runtime
    assert rt.uses_kernels and all(L[k].amx for L in rt.layers for k in LAYER_MATRICES)
    assert not rt.head.amx  # the LM head stays on VDPBF16PS (the greedy screen rescores with its chain)
    _token_frequencies(model)
    for prompt in _prompts()[:2]:
        ar = ar_generate(model, prompt, max_new_tokens=N_NEW).token_ids
        for _, kw in STRATEGIES:
            assert model.generate(prompt, max_new_tokens=N_NEW, **_cfg(kw, draft_model_dir)).token_ids == ar, kw


@pytest.mark.slow
def test_default_model_auto_equals_autoregressive_on_amx(default_model_bf16):
    m = default_model_bf16
    assert all(m.runtime.layers[0][k].amx for k in LAYER_MATRICES)
    for prompt in ("def fibonacci(n):", "The history of the printing press"):
        ar = ar_generate(m, prompt, max_new_tokens=48).token_ids
        assert m.generate(prompt, max_new_tokens=48, strategy="auto").token_ids == ar
        assert m.generate(prompt, max_new_tokens=48, strategy="quantized").token_ids == ar


def test_selfspec_amx_0_keeps_the_layers_on_vdpbf16():
    code = "from selfspec import kernels; print(kernels.available(), kernels.amx())"
    env = {**os.environ, "SELFSPEC_AMX": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.stdout.split() == ["True", "False"], out.stderr[-2000:]
