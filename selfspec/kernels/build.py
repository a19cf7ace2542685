"""Building and loading the C library (csrc/*.c): compiled on first use, keyed by a hash of
the sources, flags, compiler and CPU; every entry point registered here. Any failure makes
available() False and callers use torch (see the package doc)."""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import torch

_CSRC = Path(__file__).parent.parent / "csrc"
_SRCS = [_CSRC / name for name in ("pool.c", "gemm.c", "blocks.c", "quant.c", "sampling.c", "screen.c", "gumbel.c", "ggml_dequant.c", "ggml_gemm.c")]
_HEADERS = [_CSRC / "simd.h", _CSRC / "pool.h"]
_FLAGS = ["-O3", "-march=native", "-pthread", "-shared", "-fPIC"]  # threads: csrc/pool.c, not OpenMP
# The kernels are written for AVX-512 (F, BW, VL) and for AVX2 + FMA + F16C (csrc/simd.h); both
# compute the same chains. A CPU with only part of AVX-512 builds the AVX2 code.
NEEDED_CPU_FLAGS = ("avx2", "fma", "f16c")
_AVX512 = ("avx512f", "avx512bw", "avx512vl")
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


def _flags() -> list[str]:
    """The compiler flags for this CPU: its own ISA, minus AVX-512 unless all of F/BW/VL are there."""
    return _FLAGS + ([] if set(_AVX512) <= _cpu_flags() else ["-mno-avx512f"])


def isa() -> str | None:
    """Which vector code the kernels run here: "avx512", "avx2", or None (they cannot build)."""
    flags = _cpu_flags()
    return "avx512" if set(_AVX512) <= flags else "avx2" if set(NEEDED_CPU_FLAGS) <= flags else None


def _build() -> Path:
    cc = os.environ.get("CC", "gcc")
    if shutil.which(cc) is None:
        raise RuntimeError(f"compiler {cc!r} not found")
    src = b"\0".join(p.read_bytes() for p in _SRCS + _HEADERS)
    flags = _flags()
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    h = hashlib.sha256()
    for part in (src, " ".join(flags).encode(), version.encode(), platform.machine().encode(),
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
        r = subprocess.run([cc, *flags, *map(str, _SRCS), "-o", tmp], capture_output=True, text=True, timeout=120)
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
            missing = [f for f in NEEDED_CPU_FLAGS if f not in _cpu_flags()]
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
            dll.selfspec_layers_batch.restype = ctypes.c_int
            dll.selfspec_layers_batch.argtypes = ([ctypes.c_void_p] * 2 + [ctypes.c_long] * 2 + [ctypes.c_void_p, ctypes.c_long]
                                                  + [ctypes.c_void_p, ctypes.c_long] + [ctypes.c_void_p] * 5 + [ctypes.c_int])
            dll.selfspec_step_argmax.restype = ctypes.c_int
            dll.selfspec_step_argmax.argtypes = ([ctypes.c_void_p] * 2 + [ctypes.c_long, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p,
                                                  ctypes.c_long, ctypes.c_float] + [ctypes.c_void_p] * 7 + [ctypes.c_float, ctypes.c_void_p,
                                                  ctypes.c_int, ctypes.c_long, ctypes.c_float] + [ctypes.c_void_p] * 5 + [ctypes.c_int])
            dll.selfspec_norm_rows.restype = ctypes.c_int
            dll.selfspec_norm_rows.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_long, ctypes.c_long, ctypes.c_void_p,
                                               ctypes.c_float, ctypes.c_void_p]
            dll.selfspec_softcap.restype = ctypes.c_int
            dll.selfspec_softcap.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_float]
            dll.selfspec_qgemm_ref.restype = ctypes.c_int
            dll.selfspec_qgemm_ref.argtypes = [ctypes.c_long] + [ctypes.c_void_p] * 3
            dll.selfspec_act_residual.restype = ctypes.c_int
            dll.selfspec_act_residual.argtypes = [ctypes.c_long] * 2 + [ctypes.c_void_p, ctypes.c_int, ctypes.c_int] + [ctypes.c_void_p] * 2
            dll.selfspec_screen_candidates.restype = ctypes.c_int
            dll.selfspec_screen_candidates.argtypes = ([ctypes.c_long] * 2 + [ctypes.c_void_p] * 4 + [ctypes.c_int, ctypes.c_void_p,
                                                       ctypes.c_long, ctypes.c_void_p, ctypes.c_int])
            dll.selfspec_screen_qgemm.restype = ctypes.c_int
            dll.selfspec_screen_qgemm.argtypes = [ctypes.c_long, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
            dll.selfspec_screen_quantize.restype = ctypes.c_int
            dll.selfspec_screen_quantize.argtypes = ([ctypes.c_long] * 2 + [ctypes.c_void_p] + [ctypes.c_int] * 2
                                                     + [ctypes.c_double] * 2 + [ctypes.c_void_p] * 3 + [ctypes.c_int])
            dll.selfspec_exact_columns.restype = ctypes.c_int
            dll.selfspec_exact_columns.argtypes = ([ctypes.c_long] * 3 + [ctypes.c_void_p] * 2 + [ctypes.c_int] * 3
                                                   + [ctypes.c_void_p] * 2 + [ctypes.c_long, ctypes.c_void_p, ctypes.c_int])
            dll.selfspec_screen_pick.restype = ctypes.c_int
            dll.selfspec_screen_pick.argtypes = ([ctypes.c_long] * 3 + [ctypes.c_void_p] * 2 + [ctypes.c_int] * 3
                                                 + [ctypes.c_void_p] * 2 + [ctypes.c_long] + [ctypes.c_void_p] * 6 + [ctypes.c_int])
            dll.selfspec_screen_bounds.restype = ctypes.c_int
            dll.selfspec_screen_bounds.argtypes = ([ctypes.c_long] + [ctypes.c_void_p] * 2 + [ctypes.c_double] * 2 + [ctypes.c_int]
                                                   + [ctypes.c_void_p] * 3 + [ctypes.c_int])
            dll.selfspec_at_least.restype = ctypes.c_long
            dll.selfspec_at_least.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_float, ctypes.c_void_p, ctypes.c_long, ctypes.c_int]
            dll.selfspec_at_least_space.restype = ctypes.c_long
            dll.selfspec_at_least_space.argtypes = [ctypes.c_long, ctypes.c_int]
            dll.selfspec_gumbel_reach.restype = ctypes.c_long
            dll.selfspec_gumbel_reach.argtypes = ([ctypes.c_void_p] * 2 + [ctypes.c_long, ctypes.c_float, ctypes.c_uint64, ctypes.c_int64]
                                                  + [ctypes.c_void_p] * 2 + [ctypes.c_long, ctypes.c_void_p, ctypes.c_int])
            _lib = (fn, ref)
            _blocks.update(layers=dll.selfspec_layers_batch, step_argmax=dll.selfspec_step_argmax,
                           norm_rows=dll.selfspec_norm_rows, softcap=dll.selfspec_softcap,
                           qgemm_ref=dll.selfspec_qgemm_ref,
                           pairs=bool(dll.selfspec_has_pairs()), pairs_ref=dll.selfspec_gemm_pairs_ref)
            _blocks["dll"] = dll  # sampling_functions() registers its own entry points
            dll.selfspec_set_pairs_many_min.argtypes = [ctypes.c_long]
            dll.selfspec_pairs_many_min.restype = ctypes.c_long
            if _blocks["pairs"]:
                _tune_pairs(fn, dll)  # pairs_many_min() reads the choice back from the library
            dll.selfspec_amx_init.restype = ctypes.c_int
            _blocks["amx"] = _blocks["pairs"] and _env_amx() and dll.selfspec_amx_init() == 1
        except Exception as e:  # noqa: BLE001 - any failure means "use torch"
            _load_error = f"{type(e).__name__}: {e}"
            _lib = False
    return _lib or None


NEVER = 1 << 40  # a pairs_many_min no M reaches


def _tune_pairs(fn, dll, m: int = 16, k: int = 640, n: int = 2048, repeats: int = 5) -> int:
    """Time the pair path's two row strategies on an [m, k] x [k, n] product (a decoder
    matrix with a verification's or a small batch's rows) and keep the faster one from
    `m` rows on: the scratch path must win by 10% to be used. A few milliseconds, once per
    process. Both strategies give the same bits (tests/test_kernels.py), so this only
    chooses speed."""
    k2 = (k + 1) // 2
    gen = torch.Generator().manual_seed(0)
    w = (torch.randn(-(-n // _TILE), k2, _TILE, 2, generator=gen) * 0.02).to(torch.bfloat16)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    y = torch.empty(m, n, dtype=torch.bfloat16)

    def best(many_min: int) -> float:
        dll.selfspec_set_pairs_many_min(many_min)
        ts = []
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            fn(m, k, n, x.data_ptr(), 1, w.data_ptr(), 1, 2, y.data_ptr(), 1, 0)
            ts.append(time.perf_counter() - t0)
        return min(ts[1:])

    direct, many = best(NEVER), best(m)
    choice = m if many < 0.9 * direct else NEVER
    dll.selfspec_set_pairs_many_min(choice)
    return choice


def set_pairs_many_min(m: int) -> None:
    """Force the pair path's row threshold (tests: both strategies must give the same bits)."""
    _load()
    dll = _blocks.get("dll")
    if dll is not None:
        dll.selfspec_set_pairs_many_min(m)


def pairs_many_min() -> int | None:
    """The pair path's current row threshold (None without the kernel)."""
    _load()
    dll = _blocks.get("dll")
    return None if dll is None else int(dll.selfspec_pairs_many_min())


def _env_amx() -> bool:
    """SELFSPEC_AMX=0 keeps the layer matrices on VDPBF16PS; unset or 1: AMX where the CPU has it."""
    return os.environ.get("SELFSPEC_AMX", "1") not in ("0", "")


def amx() -> bool:
    """available(), the CPU has AMX-BF16, the kernel granted the tile state and SELFSPEC_AMX is not
    0: the runtime then packs its bf16 layer matrices for the AMX chain (pack(w, amx=True);
    csrc/gemm.c, gemm_amx). Read once per process, at the kernels' first use."""
    return available() and bool(_blocks.get("amx"))


def available() -> bool:
    """True when the compiled kernel is usable here (checks SELFSPEC_NO_KERNELS on every call)."""
    if os.environ.get("SELFSPEC_NO_KERNELS", "") not in ("", "0"):
        return False
    return _load() is not None


def build_id() -> str | None:
    """The loaded kernel build's id (changes with the C sources; "+amx" when the layers use the AMX
    chain: its costs are not the other's), None when not available()."""
    if not available():
        return None
    return f"{_build_id}+amx" if _blocks.get("amx") else _build_id


def load_error() -> str | None:
    """Why available() is False (None if it is True or was never asked)."""
    return _load_error


def has_pairs() -> bool:
    """available() and the CPU/compiler have the bf16 pair path (AVX512-BF16 VDPBF16PS)."""
    return available() and bool(_blocks.get("pairs"))


