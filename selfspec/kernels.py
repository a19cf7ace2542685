"""A small-M matrix multiply for the CPU decode path: y[M, N] = x[M, K] @ w[K, N].

Why: torch's bf16 matmul (oneDNN) streams weights at ~12-20 GB/s for the tiny M of decode
and speculative verification; this kernel reaches ~25-30 GB/s on the 2-core AVX-512 box
(the LM head of Gemma 3 270M: ~12-13 ms instead of ~26 ms).

Numerics (the contract callers rely on):
  * every output element is ONE fp32 FMA chain in increasing k:
        acc = +0.0f; for k in 0..K-1: acc = fma(float(x[m, k]), float(w[k, n]), acc)
    bf16 -> fp32 conversions are exact; there is no split over K, no tree reduction.
  * so row m of the result is bit-identical whatever M is (verify over M rows == M
    single-row passes), whatever the thread count and whether w is plain or packed.
  * output dtype = x's dtype; bf16 output is round-to-nearest-even of the fp32 accumulator
    (NaN -> canonical NaN), like torch's float -> bfloat16 conversion.
  * results differ from torch's `x @ w` only by accumulation order (torch is not
    row-invariant anyway); both are fp32 accumulations of the same exact products.
  * pair layout (pack(w, pairs=True), the default for bf16 weights on CPUs with AVX512-BF16):
    x is first rounded to bf16 and the chain takes k two at a time, odd term then even term,
    with denormals treated as zero (VDPBF16PS's definition). Same guarantees (row-, thread-
    invariant, one chain per element), its own bits; ~1.2-1.4x faster at 2-9 rows, where the
    FMA path is compute-bound (speculative verification).

API:
  available() -> bool          the compiled kernel can be used (CPU, compiler, env)
  supports(x, w) -> bool       available() and these operands are acceptable to matmul
  matmul(x, w) -> Tensor       x [M, K] (bf16/fp32, CPU), w [K, N] tensor (bf16/fp32, CPU,
                               contiguous) or a PackedWeight; raises ValueError otherwise
  has_pairs() -> bool          the pair (VDPBF16PS) path is compiled in and usable
  pack(w) -> PackedWeight      w [K, N] re-laid out as [ceil(N/64), K, 64] (zero padded), or
                               [ceil(N/64), ceil(K/2), 64, 2] with pairs (see above):
                               each 64-column tile becomes one contiguous stream, ~20-30%
                               faster than the plain layout on large N (the LM head).
                               PackedWeight.unpack() gives back the [K, N] tensor.
  sampling_functions()         the entry points of csrc/sampling.c (one row's top-k/top-p
                               distribution and draws; used by selfspec/sampling.py), or None

The C source (csrc/gemm.c) is compiled on first use with gcc -O3 -march=native -fopenmp
into ~/.cache/selfspec/kernels/<hash>/libgemm.so (hash of source, flags, compiler and CPU
flags; written to a temp file then os.replace'd) and called through ctypes. Anything that
goes wrong (no gcc, no AVX-512, compile error, SELFSPEC_NO_KERNELS=1) makes available()
return False; callers then use torch. Work is split over N across OpenMP threads
(torch.get_num_threads() of them); the library links libgomp.so.1 which, torch being
imported first, resolves to the copy torch already loaded (one thread pool, not two).
No autograd: use under torch.no_grad() / inference_mode (results carry no grad_fn).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

__all__ = ["available", "has_pairs", "supports", "matmul", "pack", "pack_rows", "PackedWeight", "FusedBlocks", "norm_rows", "softcap_", "QuantizedWeight"]

_SRCS = [Path(__file__).with_name("csrc") / name for name in ("gemm.c", "blocks.c", "quant.c", "sampling.c")]
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"]
_NEEDED_CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "fma")
_TILE = 64  # columns per tile, must match NT in gemm.c
_DTYPES = (torch.bfloat16, torch.float32)

_lock = threading.Lock()
_lib = None  # ctypes function, or False once loading failed
_build_id: str | None = None  # hash of sources, flags, compiler and CPU (names the build)
_blocks: dict = {}  # the library's other entry points: fused sub-layers, pair path flag and reference
_load_error: str | None = None


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _cache_root() -> Path:
    base = os.environ.get("SELFSPEC_KERNEL_CACHE")
    if base:
        return Path(base)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "selfspec" / "kernels"


def _build() -> Path:
    cc = os.environ.get("CC", "gcc")
    if shutil.which(cc) is None:
        raise RuntimeError(f"compiler {cc!r} not found")
    src = b"\0".join(p.read_bytes() for p in _SRCS)
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    h = hashlib.sha256()
    for part in (src, " ".join(_FLAGS).encode(), version.encode(), platform.machine().encode(),
                 " ".join(sorted(_cpu_flags())).encode()):
        h.update(part)
        h.update(b"\0")
    global _build_id
    _build_id = h.hexdigest()[:20]
    out_dir = _cache_root() / _build_id
    lib = out_dir / "libgemm.so"
    if lib.exists():
        return lib
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".libgemm-", suffix=".so", dir=out_dir)
    os.close(fd)
    try:
        r = subprocess.run([cc, *_FLAGS, *map(str, _SRCS), "-o", tmp], capture_output=True, text=True, timeout=120)
        if r.returncode != 0:
            raise RuntimeError(f"compilation failed: {r.stderr.strip()[-2000:]}")
        os.replace(tmp, lib)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib


def _load():
    global _lib, _load_error
    if _lib is not None:
        return _lib or None
    with _lock:
        if _lib is not None:
            return _lib or None
        try:
            if platform.machine() not in ("x86_64", "AMD64"):
                raise RuntimeError(f"unsupported machine {platform.machine()}")
            missing = [f for f in _NEEDED_CPU_FLAGS if f not in _cpu_flags()]
            if missing:
                raise RuntimeError(f"CPU lacks {missing}")
            dll = ctypes.CDLL(str(_build()))
            fn = dll.selfspec_gemm
            fn.restype = ctypes.c_int
            fn.argtypes = [ctypes.c_long] * 3 + [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int,
                                                 ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
            ref = dll.selfspec_gemm_ref
            ref.restype = ctypes.c_int
            ref.argtypes = [ctypes.c_long] * 3 + [ctypes.c_void_p] * 2 + [ctypes.c_int, ctypes.c_void_p]
            dll.selfspec_gemm_pairs_ref.restype = ctypes.c_int
            dll.selfspec_gemm_pairs_ref.argtypes = [ctypes.c_long] * 3 + [ctypes.c_void_p] * 3
            dll.selfspec_has_pairs.restype = ctypes.c_int
            for name in ("selfspec_attn_block", "selfspec_mlp_block"):
                getattr(dll, name).restype = ctypes.c_int
            dll.selfspec_attn_block.argtypes = ([ctypes.c_void_p] * 3 + [ctypes.c_long] * 2 + [ctypes.c_void_p] * 2
                                                + [ctypes.c_long] * 2 + [ctypes.c_void_p] * 2 + [ctypes.c_int])
            dll.selfspec_mlp_block.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_long, ctypes.c_int]
            dll.selfspec_attn_block_batch.restype = ctypes.c_int
            dll.selfspec_attn_block_batch.argtypes = ([ctypes.c_void_p] * 3 + [ctypes.c_long, ctypes.c_void_p]
                                                      + [ctypes.c_long] * 3 + [ctypes.c_void_p] * 2 + [ctypes.c_int])
            dll.selfspec_norm_rows.restype = ctypes.c_int
            dll.selfspec_norm_rows.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_long, ctypes.c_long, ctypes.c_void_p,
                                               ctypes.c_float, ctypes.c_void_p]
            dll.selfspec_softcap.restype = ctypes.c_int
            dll.selfspec_softcap.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_float]
            dll.selfspec_qgemm.restype = ctypes.c_int
            dll.selfspec_qgemm.argtypes = [ctypes.c_long, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                           ctypes.c_int, ctypes.c_int]
            dll.selfspec_qgemm_ref.restype = ctypes.c_int
            dll.selfspec_qgemm_ref.argtypes = [ctypes.c_long] + [ctypes.c_void_p] * 3
            _lib = (fn, ref)
            _blocks.update(attn=dll.selfspec_attn_block, mlp=dll.selfspec_mlp_block, attn_batch=dll.selfspec_attn_block_batch,
                           norm_rows=dll.selfspec_norm_rows, softcap=dll.selfspec_softcap,
                           qgemm=dll.selfspec_qgemm, qgemm_ref=dll.selfspec_qgemm_ref,
                           pairs=bool(dll.selfspec_has_pairs()), pairs_ref=dll.selfspec_gemm_pairs_ref)
            _blocks["dll"] = dll  # sampling_functions() registers its own entry points
        except Exception as e:  # noqa: BLE001 - any failure means "use torch"
            _load_error = f"{type(e).__name__}: {e}"
            _lib = False
    return _lib or None


def available() -> bool:
    """True when the compiled kernel is usable here (checks SELFSPEC_NO_KERNELS on every call)."""
    if os.environ.get("SELFSPEC_NO_KERNELS", "") not in ("", "0"):
        return False
    return _load() is not None


def build_id() -> str | None:
    """The loaded kernel build's id (changes with the C sources), None when not available()."""
    return _build_id if available() else None


def load_error() -> str | None:
    """Why available() is False (None if it is True or was never asked)."""
    return _load_error


def has_pairs() -> bool:
    """available() and the CPU/compiler have the bf16 pair path (AVX512-BF16 VDPBF16PS)."""
    return available() and bool(_blocks.get("pairs"))


class PackedWeight:
    """w [K, N] stored as data [ceil(N/64), K, 64] (tile t holds columns 64t..64t+63, zero padded),
    or, with pairs=True (bf16 only), as data [ceil(N/64), ceil(K/2), 64, 2]: rows 2j and 2j+1 of
    each column side by side, for the VDPBF16PS path (x is then rounded to bf16 first)."""

    __slots__ = ("data", "in_features", "out_features", "pairs")

    def __init__(self, data: torch.Tensor, in_features: int, out_features: int, pairs: bool = False):
        self.data = data
        self.in_features = in_features
        self.out_features = out_features
        self.pairs = pairs

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.in_features, self.out_features))

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype

    @property
    def device(self) -> torch.device:
        return self.data.device

    def unpack(self) -> torch.Tensor:
        """The original [K, N] weight (contiguous), e.g. for a torch fallback."""
        k, n = self.in_features, self.out_features
        d = self.data
        if self.pairs:  # [NB, K2, 64, 2] -> [NB, K2, 2, 64] -> [NB, 2*K2, 64]
            d = d.transpose(2, 3).reshape(d.shape[0], -1, _TILE)
        return d.permute(1, 0, 2).reshape(d.shape[1], -1)[:k, :n].contiguous()

    def columns(self, ids: torch.Tensor) -> torch.Tensor:
        """Columns `ids` of w: [K, len(ids)] (a gather, no unpacking of the rest)."""
        d = self.data[ids // _TILE, :, ids % _TILE]  # [n, K] or [n, K2, 2]
        return d.reshape(len(ids), -1)[:, : self.in_features].t()

    def __repr__(self) -> str:
        return f"PackedWeight(shape={tuple(self.shape)}, dtype={self.dtype}, pairs={self.pairs})"


class _QDesc(ctypes.Structure):  # ss_qweight in csrc/quant.c
    _fields_ = [("q", ctypes.c_void_p), ("scale", ctypes.c_void_p), ("zero", ctypes.c_void_p),
                ("in_features", ctypes.c_long), ("out_features", ctypes.c_long), ("group", ctypes.c_long), ("bits", ctypes.c_int)]


class QuantizedWeight:
    """A [K, N] weight as int8 per output channel or int4 in groups of `group` rows with a zero
    point (selfspec.quant makes them; csrc/quant.c for the layouts and the chains). matmul
    multiplies by it without dequantising it in memory; dequantize() gives the fp32 [K, N]."""

    __slots__ = ("q", "scale", "zero", "in_features", "out_features", "group", "bits", "desc")

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, in_features: int,
                 out_features: int, bits: int, group: int = 0):
        # int8: fp32 scales per column; int4: fp16 scales and zero points per (group, column)
        sdt = torch.float32 if bits == 8 else torch.float16
        self.q, self.scale = q.contiguous(), scale.to(sdt).contiguous()
        self.zero = None if zero is None else zero.to(sdt).contiguous()
        self.in_features, self.out_features, self.bits, self.group = in_features, out_features, bits, group
        self.desc = _QDesc(self.q.data_ptr(), self.scale.data_ptr(), 0 if self.zero is None else self.zero.data_ptr(),
                           in_features, out_features, group, bits)

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.in_features, self.out_features))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.q, self.scale, self.zero) if t is not None)

    @property
    def device(self) -> torch.device:
        return self.q.device

    def dequantize(self) -> torch.Tensor:
        """The fp32 [K, N] weight this stands for (tests, torch fallback)."""
        k, n = self.in_features, self.out_features
        if self.bits == 8:
            q = self.q.permute(1, 0, 2).reshape(k, -1)[:, :n].float()  # [NB, K, 64] -> [K, N]
            return q * self.scale
        b = self.q.permute(1, 0, 2)  # [K, NB, 32]
        u = torch.cat([b & 0xF, b >> 4], dim=-1).reshape(k, -1)[:, :n].float()  # low nibbles: columns 0..31 of a tile
        g = torch.arange(k, device=u.device) // self.group
        return self.scale.float()[g] * (u - self.zero.float()[g])

    def __repr__(self) -> str:
        return f"QuantizedWeight(shape={tuple(self.shape)}, bits={self.bits}, group={self.group})"


def _qgemm_ref(x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    """Scalar C reference of the quantized chains (fp32 x and out); tests only."""
    _load()
    x = x.float().contiguous()
    y = torch.empty(x.shape[0], w.out_features)
    _blocks["qgemm_ref"](x.shape[0], x.data_ptr(), ctypes.addressof(w.desc), y.data_ptr())
    return y


def quant_errors(w: torch.Tensor, group: int, s: torch.Tensor, z: torch.Tensor | None, lo: float, hi: float) -> torch.Tensor | None:
    """Squared errors of candidate quantizations of w [K, N] (fp32): s, z [C, G, N] -> err
    [C, G, N] (csrc/quant.c selfspec_quant_errors), or None when not available()."""
    if not available():
        return None
    fn = _blocks["dll"].selfspec_quant_errors
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] + [ctypes.c_long] * 3 + [ctypes.c_void_p] * 2 + [ctypes.c_int, ctypes.c_float,
                                                                                    ctypes.c_float, ctypes.c_void_p, ctypes.c_int]
    w, s = w.float().contiguous(), s.float().contiguous()
    z = None if z is None else z.float().contiguous()
    err = torch.empty_like(s)
    rc = fn(w.data_ptr(), w.shape[0], w.shape[1], group, s.data_ptr(), 0 if z is None else z.data_ptr(), s.shape[0],
            lo, hi, err.data_ptr(), torch.get_num_threads())
    if rc:
        raise RuntimeError(f"kernels.quant_errors: returned {rc}")
    return err


def pack(w: torch.Tensor, pairs: bool | None = None) -> PackedWeight:
    """Re-lay w [K, N] (bf16 or fp32, CPU) as 64-column tiles for matmul. Plain tiles give results
    bit-identical to matmul with the plain w. pairs (default: has_pairs() for bf16 weights) uses
    the pair layout and so the VDPBF16PS chain (see csrc/gemm.c), which has its own bits."""
    if not isinstance(w, torch.Tensor) or w.dim() != 2:
        raise ValueError("pack expects a 2-D tensor [K, N]")
    if w.dtype not in _DTYPES:
        raise ValueError(f"pack: unsupported weight dtype {w.dtype}")
    if w.device.type != "cpu":
        raise ValueError("pack: weight must be on the CPU")
    if pairs is None:
        pairs = w.dtype == torch.bfloat16 and has_pairs()
    if pairs and w.dtype != torch.bfloat16:
        raise ValueError("pack: the pair layout needs bf16 weights")
    k, n = w.shape
    nb = (n + _TILE - 1) // _TILE
    kp = k + (k % 2 if pairs else 0)
    with torch.no_grad():
        padded = torch.zeros(kp, nb * _TILE, dtype=w.dtype)
        padded[:k, :n] = w
        if pairs:  # [K2, 2, NB, 64] -> [NB, K2, 64, 2]
            data = padded.view(kp // 2, 2, nb, _TILE).permute(2, 0, 3, 1).contiguous()
        else:
            data = padded.view(k, nb, _TILE).permute(1, 0, 2).contiguous()
    return PackedWeight(data, k, n, pairs)


def pack_rows(w_t: torch.Tensor, pairs: bool | None = None) -> PackedWeight:
    """pack(w_t.t()) without materialising the transpose: w_t is [N, K] (e.g. an LM head
    stored one row per token). One pass over memory instead of two strided ones."""
    n, k = w_t.shape
    if pairs is None:
        pairs = w_t.dtype == torch.bfloat16 and has_pairs()
    if n % _TILE or (pairs and k % 2):
        return pack(w_t.t(), pairs)
    with torch.no_grad():
        if pairs:  # [NB, 64, K2, 2] -> [NB, K2, 64, 2]
            data = w_t.reshape(n // _TILE, _TILE, k // 2, 2).permute(0, 2, 1, 3).contiguous()
        else:
            data = w_t.reshape(n // _TILE, _TILE, k).permute(0, 2, 1).contiguous()
    return PackedWeight(data, k, n, pairs)


def _check(x, w) -> str | None:
    """None if (x, w) is acceptable, else the reason."""
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        return "x must be a 2-D tensor [M, K]"
    if x.dtype not in _DTYPES:
        return f"unsupported activation dtype {x.dtype}"
    if x.device.type != "cpu":
        return "x must be on the CPU"
    if isinstance(w, QuantizedWeight):
        if w.device.type != "cpu":
            return "w must be on the CPU"
        if x.shape[1] != w.in_features:
            return f"shape mismatch: x {tuple(x.shape)} @ w {tuple(w.shape)}"
        return None
    if isinstance(w, PackedWeight):
        t = w.data
        k_rows = (w.in_features + 1) // 2 if w.pairs else w.in_features
        if (t.dim() != (4 if w.pairs else 3) or t.shape[1] != k_rows or t.shape[2] != _TILE
                or not t.is_contiguous() or (w.pairs and (t.shape[3] != 2 or t.dtype != torch.bfloat16))):
            return "malformed PackedWeight"
    elif isinstance(w, torch.Tensor):
        if w.dim() != 2:
            return "w must be a 2-D tensor [K, N]"
        if not w.is_contiguous():
            return "w must be contiguous (store it [K, N] row-major or pack() it)"
        t = w
    else:
        return "w must be a tensor or a PackedWeight"
    if t.dtype not in _DTYPES:
        return f"unsupported weight dtype {t.dtype}"
    if t.device.type != "cpu":
        return "w must be on the CPU"
    if x.shape[1] != w.shape[0]:
        return f"shape mismatch: x {tuple(x.shape)} @ w {tuple(w.shape)}"
    return None


def supports(x, w) -> bool:
    """available() and matmul(x, w) would accept these operands."""
    return available() and _check(x, w) is None


def matmul(x: torch.Tensor, w: torch.Tensor | PackedWeight | QuantizedWeight, *, num_threads: int | None = None) -> torch.Tensor:
    """y = x @ w with the fixed-order fp32 FMA chain described in the module doc.

    x: [M, K] bf16/fp32 CPU (made contiguous if needed). w: [K, N] bf16/fp32 contiguous CPU
    tensor, pack(w), or a QuantizedWeight (its own chains: csrc/quant.c). Returns [M, N] in x.dtype. Raises ValueError for bad operands and
    RuntimeError if the kernel is not available (check available()/supports() first).
    num_threads only changes speed, never results (default torch.get_num_threads()).
    """
    why = _check(x, w)
    if why is not None:
        raise ValueError(f"kernels.matmul: {why}")
    if not available():
        raise RuntimeError(f"kernels.matmul: kernel not available ({_load_error or 'disabled'})")
    fn, _ = _load()
    m, k = x.shape
    n = w.shape[1]
    y = torch.empty(m, n, dtype=x.dtype)
    if m == 0 or n == 0:
        return y
    if k == 0:
        return y.zero_()
    x = x.detach().contiguous()
    nt = torch.get_num_threads() if num_threads is None else int(num_threads)
    if isinstance(w, QuantizedWeight):
        rc = _blocks["qgemm"](m, x.data_ptr(), x.dtype == torch.bfloat16, ctypes.addressof(w.desc), y.data_ptr(),
                              y.dtype == torch.bfloat16, nt)
        if rc != 0:
            raise RuntimeError(f"kernels.matmul: quantized kernel returned {rc}")
        return y
    packed = isinstance(w, PackedWeight)
    wt = (w.data if packed else w).detach()
    layout = 2 if packed and w.pairs else int(packed)
    rc = fn(m, k, n, x.data_ptr(), x.dtype == torch.bfloat16, wt.data_ptr(), wt.dtype == torch.bfloat16,
            layout, y.data_ptr(), y.dtype == torch.bfloat16, nt)
    if rc != 0:
        raise RuntimeError(f"kernels.matmul: kernel returned {rc}")
    return y


def _reference_fp32(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Scalar C reference of the same FMA chain (fp32 x, bf16 or fp32 plain w, fp32 out); tests only."""
    _, ref = _load()
    x = x.float().contiguous()
    w = w.contiguous()
    y = torch.empty(x.shape[0], w.shape[1], dtype=torch.float32)
    ref(x.shape[0], x.shape[1], w.shape[1], x.data_ptr(), w.data_ptr(), w.dtype == torch.bfloat16, y.data_ptr())
    return y


def _reference_pairs(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Scalar C reference of the pair chain (x rounded to bf16, bf16 plain w, fp32 out); tests only."""
    _load()
    x = x.float().contiguous()
    w = w.contiguous()
    y = torch.empty(x.shape[0], w.shape[1], dtype=torch.float32)
    _blocks["pairs_ref"](x.shape[0], x.shape[1], w.shape[1], x.data_ptr(), w.data_ptr(), y.data_ptr())
    return y


# ---- fused decoder sub-layers (csrc/blocks.c) ------------------------------------------------

class _Dims(ctypes.Structure):
    _fields_ = [(n, ctypes.c_long) for n in ("hidden", "heads", "kv_heads", "head_dim", "inter")] + [
        ("eps", ctypes.c_float), ("attn_scale", ctypes.c_float),
        ("act", ctypes.c_int), ("qk_norm", ctypes.c_int), ("sandwich", ctypes.c_int), ("f32", ctypes.c_int)]


_WEIGHTS = ("wqkv", "wo", "w_gate_up", "w_down")
_VECTORS = ("bqkv", "bo", "b_gate_up", "b_down",
            "attn_norm", "q_norm", "k_norm", "post_attn_norm", "mlp_norm", "post_mlp_norm")


class _Layer(ctypes.Structure):
    _fields_ = ([(n, ctypes.c_void_p) for n in _WEIGHTS]
                + [(n, ctypes.c_int) for n in ("wqkv_packed", "wo_packed", "gu_packed", "down_packed")]
                + [(n, ctypes.c_void_p) for n in _VECTORS])


_ACTIVATIONS = {"silu": 0, "gelu": 1, "gelu_tanh": 2}


class FusedBlocks:
    """One C call per attention / MLP sub-layer (residual stream, cache and matrices in one
    storage dtype, bf16 or fp32; fp32 in between).

    Row-invariant like matmul (see csrc/blocks.c for the fixed reduction orders), so a verify
    pass over T rows equals T single-row steps bit for bit. `layers` are the runtime's layer
    dicts ([in, out] matrices of `dtype`, PackedWeights or QuantizedWeights, fp32 norm vectors,
    optional biases);
    the C structs hold raw pointers, so this object keeps every tensor it points at alive.
    """

    def __init__(self, *, hidden: int, heads: int, kv_heads: int, head_dim: int, inter: int, eps: float,
                 attn_scale: float, activation: str, qk_norm: bool, sandwich: bool, layers: list[dict],
                 dtype: torch.dtype = torch.bfloat16):
        if not available():
            raise RuntimeError(f"kernels not available ({_load_error or 'disabled'})")
        if dtype not in _DTYPES:
            raise ValueError(f"FusedBlocks: unsupported dtype {dtype}")
        self.dtype = dtype
        self.dims = _Dims(hidden, heads, kv_heads, head_dim, inter, eps, attn_scale,
                          _ACTIVATIONS[activation], int(qk_norm), int(sandwich), int(dtype == torch.float32))
        self._keep: list = []
        self.layers = []
        for L in layers:
            s = _Layer()
            for name, flag in zip(_WEIGHTS, ("wqkv_packed", "wo_packed", "gu_packed", "down_packed")):
                w = L[name]
                if isinstance(w, QuantizedWeight):  # a drafting copy: layout 3, the C side reads the descriptor
                    setattr(s, name, ctypes.addressof(w.desc))
                    setattr(s, flag, 3)
                    self._keep.append(w)
                    continue
                t = w.data if isinstance(w, PackedWeight) else w
                if t.dtype != dtype or not t.is_contiguous():
                    raise ValueError(f"FusedBlocks: {name} must be a contiguous {dtype} matrix")
                setattr(s, name, t.data_ptr())
                setattr(s, flag, (2 if w.pairs else 1) if isinstance(w, PackedWeight) else 0)
                self._keep.append(t)
            for name in _VECTORS:
                if L.get(name) is not None:
                    v = L[name].detach().float().contiguous()
                    setattr(s, name, v.data_ptr())
                    self._keep.append(v)
            self.layers.append(s)
        self._attn, self._mlp, self._attn_batch = _blocks["attn"], _blocks["mlp"], _blocks["attn_batch"]
        self._dims_ptr = ctypes.addressof(self.dims)
        self._layer_ptrs = [ctypes.addressof(s) for s in self.layers]

    def attention(self, i: int, h: torch.Tensor, pos: int, cache, window: int | None,
                  cos: torch.Tensor, sin: torch.Tensor, threads: int) -> None:
        """h [T, H] contiguous (self.dtype), updated in place; cache: a KVCache (self.dtype,
        contiguous) whose layer-i rows pos..pos+T-1 are written; cos/sin fp32 [T, D] for
        these positions."""
        kt, v = cache.kt, cache.v  # [L, kv, D, cap] / [L, kv, cap, D]: layer i by pointer, no views
        rc = self._attn(self._dims_ptr, self._layer_ptrs[i], h.data_ptr(), h.shape[0], pos,
                        kt.data_ptr() + i * kt.stride(0) * kt.element_size(), v.data_ptr() + i * v.stride(0) * v.element_size(),
                        cache.capacity, window or 0, cos.data_ptr(), sin.data_ptr(), threads)
        if rc:
            raise RuntimeError(f"kernels: attention block returned {rc}")

    def attention_batch(self, i: int, h: torch.Tensor, segs, window: int | None,
                        cos: torch.Tensor, sin: torch.Tensor, threads: int) -> None:
        """Several sequences at once (csrc/blocks.c, selfspec_attn_block_batch): h [T, H] is the
        concatenation of their rows, `segs` a SegmentTable (rows, position and KV cache of each
        sequence), cos/sin fp32 [T, D] the rotary rows of every row's own position."""
        rc = self._attn_batch(self._dims_ptr, self._layer_ptrs[i], h.data_ptr(), h.shape[0], segs.ptr, segs.count,
                              i, window or 0, cos.data_ptr(), sin.data_ptr(), threads)
        if rc:
            raise RuntimeError(f"kernels: batched attention block returned {rc}")

    def mlp(self, i: int, h: torch.Tensor, threads: int) -> None:
        """h [T, H] contiguous (self.dtype), updated in place."""
        rc = self._mlp(self._dims_ptr, self._layer_ptrs[i], h.data_ptr(), h.shape[0], threads)
        if rc:
            raise RuntimeError(f"kernels: MLP block returned {rc}")


def norm_rows(h: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of every row of h [T, H] (bf16/fp32, CPU) times w (fp32 [H]), in h's dtype:
    fp32 arithmetic with the fused blocks' fixed per-row reduction (row-invariant)."""
    if not available():
        raise RuntimeError(f"kernels.norm_rows: kernel not available ({_load_error or 'disabled'})")
    if h.dtype not in _DTYPES or h.dim() != 2 or h.device.type != "cpu":
        raise ValueError("kernels.norm_rows: h must be a 2-D bf16/fp32 CPU tensor")
    h = h.detach().contiguous()
    w = w.detach().float().contiguous()
    if w.shape != (h.shape[1],):
        raise ValueError(f"kernels.norm_rows: weight shape {tuple(w.shape)} does not match rows of {h.shape[1]}")
    out = torch.empty_like(h)
    rc = _blocks["norm_rows"](h.data_ptr(), h.dtype == torch.float32, h.shape[0], h.shape[1], w.data_ptr(), eps, out.data_ptr())
    if rc:
        raise RuntimeError(f"kernels.norm_rows: returned {rc}")
    return out


def softcap_(y: torch.Tensor, cap: float) -> torch.Tensor:
    """y = cap * tanh(y / cap) in place (fp32 contiguous CPU); each element's arithmetic is the
    same wherever it sits in the tensor (row-invariant)."""
    if y.dtype != torch.float32 or not y.is_contiguous() or y.device.type != "cpu":
        raise ValueError("kernels.softcap_: y must be a contiguous fp32 CPU tensor")
    rc = _blocks["softcap"](y.data_ptr(), y.numel(), cap)
    if rc:
        raise RuntimeError(f"kernels.softcap_: returned {rc}")
    return y


# ---- sampling (csrc/sampling.c): one row's distribution and draws, see selfspec/sampling.py ----

_sampling: dict = {}


def sampling_functions() -> dict | None:
    """{"dist": selfspec_sample_dist, "draw": selfspec_sample_draw} as ctypes functions, or
    None when not available()."""
    if not available():
        return None
    if not _sampling:
        with _lock:
            dll = _blocks["dll"]
            p, c_long, c_float, c_double = ctypes.c_void_p, ctypes.c_long, ctypes.c_float, ctypes.c_double
            dist = dll.selfspec_sample_dist
            dist.restype = ctypes.c_int
            dist.argtypes = [p, c_long, c_float, c_long, c_double, c_long, p, p, p, p]
            draw = dll.selfspec_sample_draw
            draw.restype = c_long
            draw.argtypes = [p, c_long, c_float, c_float, c_float, c_double, p,
                             p, p, c_long, c_float, c_float, c_float, c_double, p, c_double, p]
            _sampling.update(dist=dist, draw=draw)
    return _sampling
