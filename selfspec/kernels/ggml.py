"""GGUF blocks to fp32 (csrc/ggml_dequant.c: the gguf package's numpy dequantizer's bits, on the
kernels' threads), and that numpy dequantizer itself for the block types the C code does not
handle or where the kernels are not available."""

from __future__ import annotations

import ctypes

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as numpy_dequantize

from selfspec.kernels import build
from selfspec.kernels.pool import threads

Q = GGMLQuantizationType
# the block types csrc/ggml_dequant.c reads
NATIVE = frozenset({Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q5_0, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K})

_entry: dict = {}


def _dequant_fn():
    if not build.available():
        return None
    if not _entry:
        with build._lock:
            fn = build._blocks["dll"].selfspec_ggml_dequant
            fn.restype = ctypes.c_int
            fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p, ctypes.c_int]
            _entry["dequant"] = fn
    return _entry["dequant"]


def dequantize(raw: np.ndarray, qtype: GGMLQuantizationType, cols: int, native: bool = True) -> np.ndarray:
    """Rows of blocks, uint8 [m, row_bytes] -> float32 [m, cols] (native=False: gguf's numpy)."""
    m = raw.shape[0]
    fn = _dequant_fn() if native and qtype in NATIVE else None
    if fn is None:
        if qtype == Q.F32:
            return raw.view(np.float32).reshape(m, cols)
        return numpy_dequantize(raw, qtype).astype(np.float32, copy=False).reshape(m, cols)
    raw = np.ascontiguousarray(raw)
    out = np.empty((m, cols), dtype=np.float32)
    block, size = GGML_QUANT_SIZES[qtype]
    if raw.size != m * cols // block * size:
        raise ValueError(f"dequantize: {raw.size} bytes are not {m} rows of {cols} {qtype.name} values")
    if fn(int(qtype), raw.ctypes.data, raw.size // size, out.ctypes.data, threads()) != 0:  # pragma: no cover
        raise ValueError(f"dequantize: block type {qtype.name} not handled")
    return out
