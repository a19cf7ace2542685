"""matmul: y = x @ w through csrc/gemm.c (plain, packed, pair or quantized weights), its
operand checks and scalar references (see the package doc for the numerics)."""

from __future__ import annotations

import ctypes

import torch

from selfspec.kernels import build
from selfspec.kernels.build import available, has_pairs
from selfspec.kernels.pool import threads
from selfspec.kernels.ggml_gemm import LAYOUT as _GGML_LAYOUT, GGMLWeight
from selfspec.kernels.weights import PackedWeight, QuantizedWeight


def _check(x, w) -> str | None:
    """None if (x, w) is acceptable, else the reason."""
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        return "x must be a 2-D tensor [M, K]"
    if x.dtype not in build._DTYPES:
        return f"unsupported activation dtype {x.dtype}"
    if x.device.type != "cpu":
        return "x must be on the CPU"
    if isinstance(w, (QuantizedWeight, GGMLWeight)):
        if w.device.type != "cpu":
            return "w must be on the CPU"
        if x.shape[1] != w.in_features:
            return f"shape mismatch: x {tuple(x.shape)} @ w {tuple(w.shape)}"
        return None
    if isinstance(w, PackedWeight):
        t = w.data
        k_rows = (w.in_features + 1) // 2 if w.pairs else w.in_features
        if (t.dim() != (4 if w.pairs else 3) or t.shape[1] != k_rows or t.shape[2] != build._TILE
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
    if t.dtype not in build._DTYPES:
        return f"unsupported weight dtype {t.dtype}"
    if t.device.type != "cpu":
        return "w must be on the CPU"
    if x.shape[1] != w.shape[0]:
        return f"shape mismatch: x {tuple(x.shape)} @ w {tuple(w.shape)}"
    return None


def operand(w) -> tuple[int, int, bool]:
    """(address, layout, bf16) of a checked weight as csrc/gemm.c's selfspec_gemm takes it:
    layout 0 a plain [K, N] tensor, 1 packed tiles, 2 bf16 pairs, 3 a QuantizedWeight's descriptor,
    4 bf16 pairs on AMX tiles, 5 a GGMLWeight's descriptor."""
    if isinstance(w, QuantizedWeight):
        return ctypes.addressof(w.desc), 3, False
    if isinstance(w, GGMLWeight):  # GGUF blocks: csrc/ggml_gemm.c
        return ctypes.addressof(w.desc), _GGML_LAYOUT, False
    if isinstance(w, PackedWeight):
        return w.data.data_ptr(), w.layout, w.data.dtype == torch.bfloat16
    return w.data_ptr(), 0, w.dtype == torch.bfloat16


def supports(x, w) -> bool:
    """available() and matmul(x, w) would accept these operands."""
    return available() and _check(x, w) is None


def matmul(x: torch.Tensor, w: torch.Tensor | PackedWeight | QuantizedWeight, *, num_threads: int | None = None) -> torch.Tensor:
    """y = x @ w with the fixed-order fp32 FMA chain described in the module doc.

    x: [M, K] bf16/fp32 CPU (made contiguous if needed). w: [K, N] bf16/fp32 contiguous CPU
    tensor, pack(w), or a QuantizedWeight (its own chains: csrc/quant.c). Returns [M, N] in x.dtype. Raises ValueError for bad operands and
    RuntimeError if the kernel is not available (check available()/supports() first).
    num_threads only changes speed, never results (default threads()).
    """
    why = _check(x, w)
    if why is not None:
        raise ValueError(f"kernels.matmul: {why}")
    if not available():
        raise RuntimeError(f"kernels.matmul: kernel not available ({build._load_error or 'disabled'})")
    fn, _ = build._load()
    m, k = x.shape
    n = w.shape[1]
    y = torch.empty(m, n, dtype=x.dtype)
    if m == 0 or n == 0:
        return y
    if k == 0:
        return y.zero_()
    x = x.detach().contiguous()
    nt = threads() if num_threads is None else int(num_threads)
    wp, layout, w_bf16 = operand(w)  # layout 3: selfspec_gemm hands a QuantizedWeight to quant.c's chains
    rc = fn(m, k, n, x.data_ptr(), x.dtype == torch.bfloat16, wp, w_bf16, layout, y.data_ptr(), y.dtype == torch.bfloat16, nt)
    if rc != 0:
        raise RuntimeError(f"kernels.matmul: kernel returned {rc}")
    return y


def _reference_fp32(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Scalar C reference of the same FMA chain (fp32 x, bf16 or fp32 plain w, fp32 out); tests only."""
    _, ref = build._load()
    x = x.float().contiguous()
    w = w.contiguous()
    y = torch.empty(x.shape[0], w.shape[1], dtype=torch.float32)
    ref(x.shape[0], x.shape[1], w.shape[1], x.data_ptr(), w.data_ptr(), w.dtype == torch.bfloat16, y.data_ptr())
    return y


def _reference_pairs(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Scalar C reference of the pair chain (x rounded to bf16, bf16 plain w, fp32 out); tests only."""
    build._load()
    x = x.float().contiguous()
    w = w.contiguous()
    y = torch.empty(x.shape[0], w.shape[1], dtype=torch.float32)
    build._blocks["pairs_ref"](x.shape[0], x.shape[1], w.shape[1], x.data_ptr(), w.data_ptr(), y.data_ptr())
    return y
