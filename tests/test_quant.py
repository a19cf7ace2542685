"""Quantized copies of the weights (selfspec/quant.py) and their kernels (csrc/quant.c): the
quantizers against the definitions, the kernel bits against a scalar reference of the same
chains, row and thread invariance."""

from __future__ import annotations

import pytest
import torch

from selfspec import kernels, quant

from test_kernels import needs_kernels

SHAPES = [(640, 1536), (130, 67), (64, 200), (37, 1), (96, 64)]  # incl. N % 64 tails, K % group tails


def _w(k: int, n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(k, n, generator=g) / k**0.5
    w[0, 0] = 4.0 / k**0.5  # an outlier: clipping must weigh it
    return w


@pytest.mark.parametrize("k,n", SHAPES)
def test_int8_matches_its_definition(k, n):
    w = _w(k, n)
    qw = quant.quantize_int8(w)
    assert qw.bits == 8 and qw.q.dtype == torch.int8 and qw.q.shape == ((n + 63) // 64, k, 64)
    deq = qw.dequantize()
    q = torch.round(deq / qw.scale)
    assert q.abs().max() <= 127 and torch.allclose(q * qw.scale, deq)  # s * q, q an integer in -127..127
    # each column's error is the best over the clipping grid, absmax (clip 1.0) included
    absmax = torch.round(w / (w.abs().amax(0) / 127)).clamp(-127, 127) * (w.abs().amax(0) / 127)
    assert (((deq - w) ** 2).sum(0) <= ((absmax - w) ** 2).sum(0) + 1e-12).all()
    assert (deq - w).abs().max() <= qw.scale.max() * 0.5 + (w.abs().amax(0) * (1 - min(quant.INT8_CLIPS))).max() + 1e-6


@pytest.mark.parametrize("group", [32, 64])
@pytest.mark.parametrize("k,n", SHAPES)
def test_int4_matches_its_definition(k, n, group):
    w = _w(k, n, seed=1)
    qw = quant.quantize_int4(w, group)
    assert qw.bits == 4 and qw.q.dtype == torch.uint8 and qw.q.shape == ((n + 63) // 64, k, 32)
    ng = (k + group - 1) // group
    assert qw.scale.shape == qw.zero.shape == (ng, n)
    deq = qw.dequantize()
    gi = torch.arange(k) // group
    u = deq / qw.scale.float()[gi] + qw.zero.float()[gi]
    assert torch.allclose(u, torch.round(u), atol=1e-3) and u.min() > -1e-3 and u.max() < 15 + 1e-3
    # no worse than plain min-max per group (the grid's first point)
    lo, hi = torch.stack([w[i * group:(i + 1) * group].amin(0) for i in range(ng)]), torch.stack([w[i * group:(i + 1) * group].amax(0) for i in range(ng)])
    s = (hi - lo) / 15
    minmax = ((torch.round((w - lo[gi]) / s[gi]).clamp(0, 15)) * s[gi] + lo[gi])
    assert ((deq - w) ** 2).sum() <= ((minmax - w) ** 2).sum() * (1 + 1e-5)
    assert (deq - w).abs().max() <= s.max() * 0.5 + (hi - lo).max() * 0.25  # rounding + at most the grid's clipping


@needs_kernels
@pytest.mark.parametrize("group", [64, 1000])  # int4 groups (a short last one) / a whole int8 column
@pytest.mark.parametrize("k,n", SHAPES)
def test_the_clipping_search_errors_match_torch(k, n, group, monkeypatch):
    """csrc/quant.c's one-pass error search against the torch definition (7 passes per
    candidate): the same sums up to summation order, hence the same choices off near-ties."""
    w = _w(k, n, seed=3)
    group = min(group, k)
    ng = (k + group - 1) // group
    g = torch.Generator().manual_seed(1)
    s = (torch.rand(5, ng, n, generator=g) + 0.5) * w.abs().max() / 8
    z = torch.round(torch.rand(5, ng, n, generator=g) * 15)
    for zz, lo, hi in ((None, -127, 127), (z, 0, 15)):
        c = kernels.quant_errors(w, group, s, zz, lo, hi)
        monkeypatch.setattr(quant, "quant_errors", lambda *a: None)
        t = quant._errors(w, group, s, zz, lo, hi)
        monkeypatch.undo()
        assert c.shape == t.shape == (5, ng, n)
        assert torch.allclose(c, t, rtol=1e-4, atol=1e-9), (c - t).abs().max()


@needs_kernels
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("k,n", SHAPES)
def test_kernel_bits_match_the_scalar_chain(bits, k, n):
    qw = quant.quantize(_w(k, n, seed=2), bits, group=32)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(9, k, generator=g)
    x[0, 0] = 1e-40  # a denormal input: FMAs keep it (no flush), as in the reference
    ref = kernels._qgemm_ref(x, qw)
    full = kernels.matmul(x, qw)
    assert torch.equal(full, ref)
    for m in range(1, 10):  # row blocks of 4 and the tails, every thread count: the same bits
        assert torch.equal(kernels.matmul(x[:m], qw), full[:m]), m
        assert torch.equal(kernels.matmul(x[m - 1:m], qw, num_threads=1), full[m - 1:m]), m
        assert torch.equal(kernels.matmul(x[m - 1:m], qw, num_threads=3), full[m - 1:m]), m
    # bf16 in and out: x widened exactly, the result rounded once
    xb = x.bfloat16()
    assert torch.equal(kernels.matmul(xb, qw), kernels._qgemm_ref(xb.float(), qw).bfloat16())
    # and it is the product with the dequantised weight, up to fp32 accumulation order
    exact = x.double() @ qw.dequantize().double()
    scale = (x.double().abs() @ qw.dequantize().double().abs()).clamp_min(1e-30)
    assert ((full.double() - exact).abs() / scale).max().item() <= 4 * k * 2**-24


def test_bad_bits():
    with pytest.raises(ValueError, match="bits must be 4 or 8"):
        quant.quantize(torch.ones(4, 4), 3)


@pytest.mark.parametrize("bits", [8, 4])
def test_degenerate_columns_stay_finite(bits):
    """All-zero, constant and tiny columns: finite scales and zero points, small errors."""
    w = torch.zeros(64, 70)
    w[:, 3] = 0.3
    w[:32, 5] = 1e-7
    qw = quant.quantize(w, bits)
    assert torch.isfinite(qw.scale.float()).all() and (qw.zero is None or torch.isfinite(qw.zero.float()).all())
    assert (qw.dequantize() - w).abs().max() < 2e-4
