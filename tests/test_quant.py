"""Quantized copies of the weights (selfspec/quant.py) and their kernels (csrc/quant.c): the
quantizers against the definitions, the kernel bits against a scalar reference of the same
chains, row and thread invariance."""

from __future__ import annotations

import pytest
import torch

from selfspec import kernels, quant

from test_kernels import needs_kernels

SHAPES = [(640, 1536), (130, 67), (64, 200), (37, 1), (96, 64)]  # incl. N % 64 tails, K % group tails
KERNEL_SHAPES = SHAPES + [(200, 72), (72, 130), (643, 129), (5, 3)]  # K % 64, % 8, % 4 != 0


def _w(k: int, n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(k, n, generator=g) / k**0.5
    w[0, 0] = 4.0 / k**0.5  # an outlier: clipping must weigh it
    return w


@pytest.mark.parametrize("k,n", SHAPES)
def test_int8_matches_its_definition(k, n):
    w = _w(k, n)
    qw = quant.quantize_int8(w)
    assert qw.bits == 8 and qw.q.dtype == torch.uint8 and qw.q.shape == ((n + 63) // 64, (k + 3) // 4, 64, 4)
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
    assert qw.bits == 4 and qw.q.dtype == torch.uint8 and qw.q.shape == ((n + 63) // 64, (k + 7) // 8, 64, 4)
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


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("k,n", KERNEL_SHAPES)
def test_dequantize_inverts_the_packing(bits, k, n):
    """dequantize() gives back exactly the quantizer's values, whatever the K and N tails."""
    w = _w(k, n, seed=4)
    qw = quant.quantize(w, bits)
    deq = qw.dequantize()
    assert deq.shape == (k, n)
    if bits == 8:
        expect = torch.round(w / qw.scale).clamp(-127, 127) * qw.scale
    else:
        gi = torch.arange(k) // qw.group
        s, z = qw.scale.float()[gi], qw.zero.float()[gi]
        expect = s * (torch.round(w / s + z).clamp(0, 15) - z)
    assert torch.equal(deq, expect)
    # the padding (k >= K, n >= N) is the documented byte: int8 128 (q = 0), int4 0
    pad = torch.ones(qw.q.shape[1] * (4 if bits == 8 else 8), qw.q.shape[0] * 64, dtype=torch.bool)
    pad[:k, :n] = False
    if bits == 8:
        b = qw.q.permute(1, 3, 0, 2).reshape(pad.shape)
    else:
        b = qw.q.permute(1, 3, 0, 2)
        b = torch.stack([b & 0xF, b >> 4], 1).reshape(pad.shape)
    assert (b[pad] == (128 if bits == 8 else 0)).all()


def _activation_blocks(x: torch.Tensor) -> torch.Tensor:
    """absmax of x [M, K] per activation block of the kernels (csrc/quant.c QB consecutive k),
    broadcast back to [M, K]."""
    from selfspec.kernels import build
    build._load()
    qb = build._blocks["dll"].selfspec_quant_block()
    assert qb in (32, 64) and quant.INT4_GROUP % qb == 0
    m, k = x.shape
    nb = (k + qb - 1) // qb
    xp = torch.cat([x.abs(), x.new_zeros(m, nb * qb - k)], 1).view(m, nb, qb).amax(2)
    return xp.repeat_interleave(qb, 1)[:, :k]


@needs_kernels
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("k,n", KERNEL_SHAPES)
def test_kernel_bits_match_the_scalar_chain(bits, k, n):
    qw = quant.quantize(_w(k, n, seed=2), bits)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(20, k, generator=g)
    x[0, 0] = 1e-40  # a denormal input
    x[1, : min(k, 32)] = 0.0  # a block of zeros: sx = 0
    x[4, 32:64] = 0.0
    x[2, :] *= 1e-3
    x[3, -1] = 50.0  # an outlier in the last (short) block
    ref = kernels._qgemm_ref(x, qw)
    full = kernels.matmul(x, qw)
    assert torch.equal(full, ref)
    for m in range(1, 21):  # row blocks (6 or 4 rows) and the tails, every thread count: the same bits
        assert torch.equal(kernels.matmul(x[:m], qw), full[:m]), m
        assert torch.equal(kernels.matmul(x[:m], qw, num_threads=1), full[:m]), m
        assert torch.equal(kernels.matmul(x[m - 1:m], qw, num_threads=3), full[m - 1:m]), m
    # bf16 in and out: x widened exactly, the result rounded once
    xb = x.bfloat16()
    assert torch.equal(kernels.matmul(xb, qw), kernels._qgemm_ref(xb.float(), qw).bfloat16())
    assert torch.equal(kernels.matmul(xb, qw, num_threads=1).float(), kernels.matmul(xb.float(), qw).bfloat16().float())


@needs_kernels
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("k,n", KERNEL_SHAPES)
def test_kernel_is_the_product_with_the_dequantized_weight(bits, k, n):
    """y = x @ dequantize() up to the activations' quantization: each x[m, k] moves by at most
    half a step, absmax(block) / 254, so |y - x @ W| <= sum_k absmax(block of k) / 254 * |W[k, n]|
    (plus fp32 rounding: the fmaf chains over blocks, and for int4 the zero point's term, which
    cancels against the weights' sum); and the bound is tight enough to mean something (a
    fraction of |x| @ |W|, here with x spanning a decade inside each block)."""
    qw = quant.quantize(_w(k, n, seed=5), bits)
    g = torch.Generator().manual_seed(6)
    x = torch.randn(6, k, generator=g) * torch.logspace(-0.5, 0.5, k)[torch.randperm(k, generator=g)]
    y = kernels.matmul(x, qw).double()
    wd = qw.dequantize().double()
    exact = x.double() @ wd
    absw = x.double().abs() @ wd.abs()
    act = (_activation_blocks(x).double() / 254) @ wd.abs()
    fp = 2**-20 * absw
    if bits == 4:  # t = fmaf(-z, xs, acc) in units of sx * s: |z * xs| <= |z| * 127 * 64 per block
        gi = torch.arange(k) // qw.group
        zs = (qw.zero.double().abs() + 15)[gi] * qw.scale.double()[gi]  # [K, N]
        fp = fp + 2**-22 * 127 * (_activation_blocks(x).double() / 127) @ zs
    err = (y - exact).abs()
    assert (err <= act + fp + 1e-30).all(), (err - act - fp).max()
    assert (act + fp <= absw / 8).all()  # the bound is informative: a misread weight would break it
    assert err.sum() <= 0.5 * act.sum()  # rounding errors mostly cancel: well within the worst case


@needs_kernels
def test_int4_kernel_needs_groups_of_64():
    qw = quant.quantize_int4(_w(128, 64), group=32)
    with pytest.raises(RuntimeError, match="returned 2"):
        kernels.matmul(torch.ones(1, 128), qw)


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


@needs_kernels
def test_the_avx512bw_fallback_gives_the_same_bits(tmp_path):
    """Without AVX512-VNNI (csrc/quant.c compiled with -mno-avx512vnni) vpdpbusd is emulated
    with AVX512BW: exact integer sums, hence the very same bits."""
    import ctypes
    import shutil
    import subprocess

    from selfspec.kernels import build
    cc = shutil.which("gcc")
    if cc is None:
        pytest.skip("no gcc")
    srcs = [str(p) for p in build._SRCS if p.name in ("pool.c", "quant.c")]
    lib = tmp_path / "quant_bw.so"
    subprocess.run([cc, *build._FLAGS, "-mno-avx512vnni", *srcs, "-o", str(lib)],
                   check=True, capture_output=True, timeout=120)
    fn = ctypes.CDLL(str(lib)).selfspec_qgemm
    fn.argtypes = [ctypes.c_long, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    g = torch.Generator().manual_seed(7)
    for bits in (8, 4):
        for k, n in ((640, 1536), (200, 72), (643, 129)):
            qw = quant.quantize(_w(k, n, seed=8), bits)
            x = torch.randn(9, k, generator=g)
            y = torch.empty(9, n)
            assert fn(9, x.data_ptr(), 0, ctypes.addressof(qw.desc), y.data_ptr(), 0, 2) == 0
            assert torch.equal(y, kernels.matmul(x, qw)), (bits, k, n)


@needs_kernels
@pytest.mark.parametrize("bits", [8, 4])
def test_nan_and_inf_activations_follow_the_reference(bits):
    """The vector activation quantizer treats NaN and inf as the scalar one does (a NaN never
    wins the block's absmax and quantizes to -127; an inf block has sx = inf)."""
    qw = quant.quantize(_w(100, 70, seed=9), bits)
    x = torch.randn(4, 100, generator=torch.Generator().manual_seed(10))
    x[0, 3] = float("nan")
    x[1, 40] = float("inf")
    x[2, 70] = -float("inf")
    for xx in (x, x.bfloat16()):
        y = kernels.matmul(xx, qw).float()
        torch.testing.assert_close(y, kernels._qgemm_ref(xx.float(), qw).to(xx.dtype).float(), rtol=0, atol=0, equal_nan=True)
        assert torch.isfinite(y[3]).all()
