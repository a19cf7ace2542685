import os
import platform
import shutil

import pytest
import torch

from selfspec import kernels
from selfspec.kernels import build


def _buildable() -> bool:
    """The kernels must build here: x86-64 with AVX-512 F/BW/VL, or AVX2 + FMA + F16C, a compiler,
    not disabled."""
    return (os.environ.get("SELFSPEC_NO_KERNELS", "") in ("", "0") and platform.machine() in ("x86_64", "AMD64")
            and build.isa() is not None and shutil.which(os.environ.get("CC", "gcc")) is not None)


# Skipped only where the CPU cannot run them; where it can, a failed build fails the tests
# (test_kernels_build_where_the_cpu_can) instead of silently testing nothing.
needs_kernels = pytest.mark.skipif(not _buildable(), reason="this CPU/toolchain cannot run the kernels")


def test_kernels_build_where_the_cpu_can():
    """CI must not quietly run the torch fallback on a machine our kernels were written for."""
    if not _buildable():
        pytest.skip("no x86-64 CPU with AVX2 (or AVX-512) and a C compiler here")
    assert kernels.available(), f"the kernels did not build on a capable CPU: {kernels.load_error()}"
    if "avx512_bf16" in kernels._cpu_flags():
        assert kernels.has_pairs(), "the CPU has AVX512-BF16 but the pair (VDPBF16PS) path was not compiled in"

SHAPES = [(640, 1536), (1024, 640), (64, 200), (37, 1), (130, 67)]  # incl. N % 64 != 0 tails


def _operands(k, n, xdt, wdt, m=17, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(xdt)
    w = (torch.randn(k, n, generator=g) / k**0.5).to(wdt)
    return x, w


@needs_kernels
@pytest.mark.parametrize("k,n", SHAPES)
@pytest.mark.parametrize("xdt", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("wdt", [torch.bfloat16, torch.float32])
def test_row_invariance_bitwise(k, n, xdt, wdt):
    x, w = _operands(k, n, xdt, wdt)
    full = kernels.matmul(x, w)
    assert full.dtype == xdt and full.shape == (17, n)
    packed = kernels.pack(w, pairs=False)  # plain tiles: the very same chain as plain w
    assert torch.equal(kernels.matmul(x, packed), full)
    for m in range(1, 18):
        assert torch.equal(kernels.matmul(x[:m], w), full[:m]), m
        assert torch.equal(kernels.matmul(x[:m], packed), full[:m]), m
        # a single row, alone and on one thread, equals that row of the 17-row pass
        assert torch.equal(kernels.matmul(x[m - 1 : m], w, num_threads=1), full[m - 1 : m]), m


@needs_kernels
@pytest.mark.parametrize("wdt", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m", [1, 5, 6, 7, 17])  # register-blocked path up to 6 rows, scratch path above
def test_matches_scalar_fma_chain_bitwise(wdt, m):
    x, w = _operands(640, 300, torch.float32, wdt, m=m)
    ref = kernels._reference_fp32(x, w)
    assert torch.equal(kernels.matmul(x, w), ref)
    assert torch.equal(kernels.matmul(x, kernels.pack(w, pairs=False)), ref)
    # bf16 output is the RNE rounding of that same fp32 accumulator
    xb = x.bfloat16()
    assert torch.equal(kernels.matmul(xb, w), kernels._reference_fp32(xb, w).bfloat16())


@needs_kernels
@pytest.mark.parametrize("wdt", [torch.bfloat16, torch.float32])
def test_bits_do_not_depend_on_alignment_or_threads(wdt):
    """Operands at odd addresses (views into a larger buffer), 1-3 threads, repeated: one result."""
    x, w = _operands(200, 130, torch.float32, wdt, m=9)
    ref = kernels._reference_fp32(x, w)
    for offset in (0, 1, 3):
        buf = torch.zeros(x.numel() + offset)
        xo = buf[offset:].view(x.shape)
        xo.copy_(x)
        wbuf = torch.zeros(w.numel() + offset, dtype=wdt)
        wo = wbuf[offset:].view(w.shape)
        wo.copy_(w)
        for threads in (1, 2, 3):
            assert torch.equal(kernels.matmul(xo, wo, num_threads=threads), ref), (offset, threads)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_norm_rows_is_row_invariant_and_correct(dtype):
    g = torch.Generator().manual_seed(1)
    h = (torch.randn(9, 200, generator=g) * 3).to(dtype)
    w = torch.randn(200, generator=g)
    full = kernels.norm_rows(h, w, 1e-6)
    assert full.dtype == dtype and full.shape == h.shape
    for t in range(9):
        assert torch.equal(kernels.norm_rows(h[t : t + 1], w, 1e-6), full[t : t + 1])
    ref = torch.nn.functional.rms_norm(h.float(), (200,), w, 1e-6)
    tol = 1e-5 if dtype == torch.float32 else 2**-7
    assert ((full.float() - ref).abs() / ref.abs().clamp_min(1.0)).max().item() < tol


@needs_kernels
def test_softcap_is_position_invariant_and_close_to_tanh():
    g = torch.Generator().manual_seed(2)
    y = torch.randn(3, 37, generator=g) * 40  # 37: rows straddle the 16-lane vectors
    ref = torch.tanh(y.double() / 30.0) * 30.0
    full = kernels.softcap_(y.clone(), 30.0)
    assert (full.double() - ref).abs().max().item() < 1e-5 * 30
    for t in range(3):  # a row alone (another lane alignment) gives the same bits
        assert torch.equal(kernels.softcap_(y[t].clone(), 30.0), full[t])


@needs_kernels
@pytest.mark.parametrize("k,n", SHAPES)
@pytest.mark.parametrize("xdt", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("wdt", [torch.bfloat16, torch.float32])
def test_close_to_float64(k, n, xdt, wdt):
    x, w = _operands(k, n, xdt, wdt)
    ref = x.double() @ w.double()
    y = kernels.matmul(x, w).double()
    scale = (x.double().abs() @ w.double().abs()).clamp_min(1e-30)  # sum |x||w|: the error scale
    rel = ((y - ref).abs() / scale).max().item()
    # fp32 accumulation error ~ K * 2^-24 in the worst case; bf16 output adds a 2^-9 rounding
    tol = (2**-8 if xdt == torch.bfloat16 else 0.0) + k * 2**-24
    assert rel <= tol, rel
    torch_ref = (x.float() @ w.float()).to(xdt).double()
    assert ((y - torch_ref).abs() / scale).max().item() <= 2 * tol


needs_pairs = pytest.mark.skipif(not kernels.has_pairs(), reason="no AVX512-BF16 pair path here")


@pytest.fixture
def pairs_threshold():
    """Restores the pair path's row threshold (the loader's timed choice) after a test."""
    kept = build.pairs_many_min()
    yield build.set_pairs_many_min
    build.set_pairs_many_min(kept)


@needs_pairs
@pytest.mark.parametrize("k,n", SHAPES)
@pytest.mark.parametrize("xdt", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("many_min", [13, build.NEVER], ids=["scratch-from-13", "direct-only"])
def test_pairs_chain_is_row_invariant_and_matches_reference(k, n, xdt, many_min, pairs_threshold):
    """The VDPBF16PS layout: every M and thread count gives the bits of the scalar reference
    chain, denormals included, whichever row strategy the loader chose (direct tiles for
    every M, or the widened-scratch path from 13 rows: both are forced here)."""
    pairs_threshold(many_min)
    x, w = _operands(k, n, xdt, torch.bfloat16, m=20)
    x[0, 0], w[0, 0] = 1e-39, 1e-39  # bf16 denormals: VDPBF16PS treats them as zero
    p = kernels.pack(w)
    assert p.pairs and p.data.shape == ((n + 63) // 64, (k + 1) // 2, 64, 2)
    full = kernels.matmul(x, p)
    ref = kernels._reference_pairs(x, w)
    assert torch.equal(full, ref.to(xdt))
    for m in range(1, 21):
        assert torch.equal(kernels.matmul(x[:m], p), full[:m]), m
        assert torch.equal(kernels.matmul(x[m - 1 : m], p, num_threads=1), full[m - 1 : m]), m
    # the layout round-trips, and column gathers (the tied embedding) need no unpacking
    assert torch.equal(p.unpack(), w)
    ids = torch.tensor([0, n // 2, n - 1])
    assert torch.equal(p.columns(ids), w[:, ids])
    assert torch.equal(kernels.pack_rows(w.t().contiguous()).data, p.data)
    # close to exact arithmetic: x rounded to bf16, then an fp32 accumulation
    exact = x.bfloat16().double() @ w.double()
    scale = (x.double().abs() @ w.double().abs()).clamp_min(1e-30)
    assert ((full.double() - exact).abs() / scale).max().item() <= (2**-8 if xdt == torch.bfloat16 else 0) + k * 2**-24


@needs_pairs
@pytest.mark.parametrize("k", [37, 64])
def test_pairs_round_fp32_activations_as_the_reference_does(k):
    """fp32 activations become bf16 16 lanes at a time (csrc/gemm.c x_pairs): ties to even,
    values that round up to infinity, -0, denormals, infinities and NaN give the scalar
    reference's bits, odd K (a half-filled last pair) included."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(4, k, generator=g)
    x[0, :8] = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 2 + 2**-7, -0.0, 1e-40, -1e-40, 2**-126])  # finite
    x[1, :4] = torch.tensor([3.3895e38, -3.3895e38, float("inf"), float("-inf")])  # round to / are infinite
    x[2, k - 1] = float("nan")
    w = torch.randn(k, 70, generator=g).bfloat16()
    p = kernels.pack(w)
    y, ref = kernels.matmul(x, p), kernels._reference_pairs(x, w)
    assert torch.equal(y[[0, 3]], ref[[0, 3]])
    torch.testing.assert_close(y, ref, rtol=0, atol=0, equal_nan=True)


@needs_kernels
def test_errors():
    x, w = _operands(64, 32, torch.float32, torch.bfloat16, m=2)
    with pytest.raises(ValueError):
        kernels.matmul(x, w[:32])  # K mismatch
    with pytest.raises(ValueError):
        kernels.matmul(x[0], w)  # 1-D x
    with pytest.raises(ValueError):
        kernels.matmul(x, w.t().contiguous().t())  # non-contiguous w
    with pytest.raises(ValueError):
        kernels.matmul(x.double(), w)
    with pytest.raises(ValueError):
        kernels.matmul(x, w.half())
    assert not kernels.supports(x, w.t().contiguous().t())
    assert kernels.supports(x, w)
    # non-contiguous x is accepted (copied)
    xt = torch.randn(64, 2).t()
    assert torch.equal(kernels.matmul(xt, w), kernels.matmul(xt.contiguous(), w))
    assert kernels.matmul(x[:0], w).shape == (0, 32)


def test_disabled_by_env(monkeypatch):
    monkeypatch.setenv("SELFSPEC_NO_KERNELS", "1")
    assert kernels.available() is False
    x, w = _operands(64, 32, torch.float32, torch.bfloat16, m=2)
    assert kernels.supports(x, w) is False
    with pytest.raises(RuntimeError):
        kernels.matmul(x, w)
    # pack/unpack need no compiled code, so a torch fallback can always use the packed form
    assert torch.equal(kernels.pack(w).unpack(), w)


def test_unavailable_without_compiler(monkeypatch, tmp_path):
    """A failed build (here: no compiler, empty cache) degrades to available() == False."""
    monkeypatch.setattr(kernels.build, "_lib", None)
    monkeypatch.setattr(kernels.build, "_load_error", None)
    monkeypatch.setenv("CC", "selfspec-no-such-compiler")
    monkeypatch.setenv("SELFSPEC_KERNEL_CACHE", str(tmp_path))
    monkeypatch.delenv("SELFSPEC_NO_KERNELS", raising=False)
    assert kernels.available() is False
    assert "not found" in kernels.load_error()


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_avx2_code_gives_the_avx512_bits(tmp_path, monkeypatch, dtype):
    """The kernels have AVX-512 and AVX2 code (csrc/simd.h) for the same chains: the library
    built with -mno-avx512f gives this build's bits for matmuls (1..13 rows, both weight dtypes,
    a partial tile), quantized matmuls and a whole layer loop. (Where this CPU has no
    AVX-512 both libraries are AVX2 code: the test then only checks a second build agrees.)"""
    import ctypes
    import subprocess

    import selfspec
    from selfspec import quant
    from helpers import build_hf

    cc = os.environ.get("CC", "gcc")
    lib = tmp_path / "libgemm_avx2.so"
    subprocess.run([cc, *build._FLAGS, "-mno-avx512f", *map(str, build._SRCS), "-o", str(lib)],
                   check=True, capture_output=True, timeout=300)
    alt = ctypes.CDLL(str(lib))
    alt.selfspec_gemm.argtypes = [ctypes.c_long] * 3 + [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int,
                                                         ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    alt.selfspec_qgemm.argtypes = [ctypes.c_long, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                   ctypes.c_int, ctypes.c_int]
    alt.selfspec_layers_batch.argtypes = ([ctypes.c_void_p] * 2 + [ctypes.c_long] * 2 + [ctypes.c_void_p, ctypes.c_long]
                                          + [ctypes.c_void_p, ctypes.c_long] + [ctypes.c_void_p] * 5 + [ctypes.c_int])
    bf = int(dtype == torch.bfloat16)
    g = torch.Generator().manual_seed(3)
    for k, n in ((640, 1536), (96, 200)):
        w = (torch.randn(k, n, generator=g) / k**0.5).to(dtype)
        for packed, wt in ((0, w), (1, kernels.pack(w, pairs=False).data)):
            for m in (1, 2, 3, 4, 5, 6, 7, 13):
                x = torch.randn(m, k, generator=g).to(dtype)
                y = torch.empty(m, n, dtype=dtype)
                assert alt.selfspec_gemm(m, k, n, x.data_ptr(), bf, wt.data_ptr(), bf, packed, y.data_ptr(), bf, 2) == 0
                assert torch.equal(y, kernels.matmul(x, wt if packed == 0 else kernels.pack(w, pairs=False))), (k, n, packed, m)
        for bits in (8, 4):
            qw = quant.quantize(w.float(), bits)
            for m in (1, 3, 5):
                x = torch.randn(m, k, generator=g).to(dtype)
                y = torch.empty(m, n, dtype=dtype)
                assert alt.selfspec_qgemm(m, x.data_ptr(), bf, ctypes.addressof(qw.desc), y.data_ptr(), bf, 2) == 0
                assert torch.equal(y, kernels.matmul(x, qw)), (bits, k, n, m)
    # whole layer loops: the alternative library reads the runtime's own layer descriptors
    monkeypatch.setattr("selfspec.kernels.weights.has_pairs", lambda: False)  # the FMA chain in both builds
    hf = build_hf("gemma3", seed=1, hidden_size=128, intermediate_size=256, vocab_size=256)
    rt = selfspec.load(hf, dtype=str(dtype).removeprefix("torch.")).runtime
    L, mine, theirs = rt.num_layers, rt.new_cache(64), rt.new_cache(64)
    h = torch.randn(9, rt.spec.hidden_size, generator=g).to(dtype)
    a = rt.run_layers(h, 0, L, 0, mine)  # this build, through the runtime (sliding and global layers)
    b = h.clone()
    kt, v = theirs.kt, theirs.v
    seg = (ctypes.c_long * 8)(0, 9, 0, theirs.capacity, kt.data_ptr(), v.data_ptr(),
                              kt.stride(0) * kt.element_size(), v.stride(0) * v.element_size())
    windows, kinds, _ = rt._layer_table
    cos = (ctypes.c_void_p * len(rt._rope))(*[c.data_ptr() for c, _ in rt._rope.values()])
    sin = (ctypes.c_void_p * len(rt._rope))(*[s.data_ptr() for _, s in rt._rope.values()])
    assert alt.selfspec_layers_batch(rt.blocks._dims_ptr, rt.blocks._layer_array, 0, L, b.data_ptr(), 9, ctypes.addressof(seg), 1,
                                     windows, kinds, cos, sin, (ctypes.c_ubyte * L)(), 2) == 0
    assert torch.equal(a, b) and torch.equal(mine.kt, theirs.kt) and torch.equal(mine.v, theirs.v)



# ---- the kernels' thread pool (csrc/pool.c, kernels/pool.py) --------------------------------

@needs_kernels
def test_concurrent_callers_get_the_solo_bits():
    """Threads calling the kernels at once share one pool: one runs its region on the team, the
    others inline (csrc/pool.c). Every caller must still get exactly the bits of a solo call,
    for the bf16/fp32 gemm, the int8/int4 matmuls and a multi-row (several-region) call."""
    import threading

    from selfspec import quant
    cases = []
    for i, (k, n) in enumerate([(640, 1536), (130, 67), (1024, 640)]):
        x, w = _operands(k, n, torch.bfloat16, torch.bfloat16, m=7, seed=i)
        cases.append((x, kernels.pack(w)))
        cases.append((x.float(), quant.quantize(w.float(), 8)))
        cases.append((x.float(), quant.quantize(w.float(), 4)))
    want = [kernels.matmul(x, w, num_threads=2) for x, w in cases]
    errors: list[str] = []

    def worker(seed: int) -> None:
        for r in range(40):
            j = (seed + r) % len(cases)
            x, w = cases[j]
            got = kernels.matmul(x, w, num_threads=2 + (r % 3))
            if not torch.equal(got, want[j]):
                errors.append(f"thread {seed} call {r} case {j}")

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:5]


@needs_kernels
def test_compute_scope_gives_torch_one_thread_and_the_kernels_the_rest():
    threads = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        with kernels.compute_scope() as n:
            assert n == 3 and kernels.threads() == 3 and torch.get_num_threads() == 1
            with kernels.compute_scope() as inner:  # re-entrant: the outer count stays
                assert inner == 3 and torch.get_num_threads() == 1
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 3 and kernels.threads() == 3
        with pytest.raises(ValueError):
            with kernels.compute_scope():
                raise ValueError("a failure inside the scope")
        assert torch.get_num_threads() == 3 and kernels.threads() == 3
    finally:
        torch.set_num_threads(threads)


@needs_kernels
def test_a_forked_child_runs_the_kernels():
    """pool.c's workers do not survive fork; the child must make its own instead of waiting
    forever for the parent's (a hang here is the failure)."""
    import multiprocessing as mp

    x, w = _operands(640, 1536, torch.bfloat16, torch.bfloat16, m=3)
    packed = kernels.pack(w)
    want = kernels.matmul(x, packed, num_threads=2)  # the parent's workers exist now
    ctx = mp.get_context("fork")
    with ctx.Pool(1) as p:
        got = p.apply_async(_child_matmul, (x, packed)).get(timeout=120)
    assert torch.equal(got, want)


def _child_matmul(x, w):
    return kernels.matmul(x, w, num_threads=2)
