"""GGUF block weights multiplied as stored (csrc/ggml_gemm.c for the chain and its numerics):
GGMLWeight holds a matrix's rows of blocks, [out, in] as the file stores it, and stands for the
[in, out] weight that kernels.matmul(x, w) multiplies by (selfspec_gemm's layout 5)."""

from __future__ import annotations

import ctypes
import mmap
from collections.abc import Callable

import numpy as np
import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from selfspec.kernels import build, ggml

Q = GGMLQuantizationType
# the block types csrc/ggml_gemm.c multiplies (its activation blocks and fp32 lanes are 32 values:
# in % 32 == 0); F16 / BF16 rows multiply the activations unquantized
QUANTIZED = frozenset({Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_NL, Q.IQ4_XS})
TYPES = QUANTIZED | {Q.F16, Q.BF16}
PACKED = frozenset({Q.Q4_0, Q.Q5_0, Q.Q8_0, Q.IQ4_NL, Q.Q4_K, Q.Q6_K})  # repacked eight rows side by side (csrc/ggml_gemm.c "packed blocks")
PACK_ROWS = 2048  # rows packed at a time (a multiple of 8)
MAX_PARTS = 4
LAYOUT = 5  # selfspec_gemm's code for an ss_gweight


class _Part(ctypes.Structure):  # ss_gpart
    _fields_ = [("data", ctypes.c_void_p), ("rows", ctypes.c_long), ("row_bytes", ctypes.c_long),
                ("type", ctypes.c_int), ("packed", ctypes.c_int)]


class _Desc(ctypes.Structure):  # ss_gweight
    _fields_ = [("in_features", ctypes.c_long), ("out_features", ctypes.c_long), ("nparts", ctypes.c_int),
                ("pad", ctypes.c_int), ("part", _Part * MAX_PARTS)]


def why_not(qtype, cols: int) -> str | None:
    """None where rows of `cols` values of qtype can be multiplied as blocks, else the reason."""
    if qtype not in TYPES:
        return f"{Q(qtype).name} blocks are not multiplied natively (supported: {', '.join(sorted(t.name for t in TYPES))})"
    if cols % GGML_QUANT_SIZES[qtype][0] or cols % 32:
        return f"rows of {cols} values are not whole {Q(qtype).name} blocks"
    return None


class GGMLWeight:
    """A [in, out] weight as GGUF rows of blocks: parts [(uint8 [rows_i, row_bytes_i], qtype_i)],
    stacked over out (the fused q|k|v of a layer may mix block types). Read-only.

    The products read a part of PACKED type in the packed layout (a copy of as many bytes, made
    here, where the kernels run: eight rows side by side, the same bits); `parts` stays as given
    (rows(), dequantize()), and `packed` lists the parts copied. release(i, a, b), where given, is
    called once rows a..b-1 of part i are copied (PACK_ROWS at a time): the products never read
    them, so a loader can drop their pages from memory before the next slice is read."""

    __slots__ = ("parts", "in_features", "out_features", "desc", "stored", "packed", "_copies")

    def __init__(self, parts: list[tuple[np.ndarray, GGMLQuantizationType]], in_features: int,
                 release: Callable[[int, int, int], None] | None = None):
        if not 1 <= len(parts) <= MAX_PARTS:
            raise ValueError(f"GGMLWeight: 1 to {MAX_PARTS} parts, got {len(parts)}")
        self.parts, self.in_features = [], int(in_features)
        self.desc = _Desc(self.in_features, 0, len(parts))
        for i, (raw, qtype) in enumerate(parts):
            why = why_not(qtype, self.in_features)
            if why:
                raise ValueError(f"GGMLWeight: {why}")
            block, size = GGML_QUANT_SIZES[qtype]
            raw = np.ascontiguousarray(raw, dtype=np.uint8)
            if raw.ndim != 2 or raw.shape[1] != self.in_features // block * size:
                raise ValueError(f"GGMLWeight: part {i} is {raw.shape}, not rows of {self.in_features} {Q(qtype).name} values")
            self.parts.append((raw, Q(qtype)))
            self.desc.part[i] = _Part(raw.ctypes.data, raw.shape[0], raw.shape[1], int(qtype), 0)
        self.out_features = sum(r.shape[0] for r, _ in self.parts)
        self.desc.out_features = self.out_features
        self.stored = _Desc.from_buffer_copy(self.desc)  # the blocks as given (reference())
        self.packed, self._copies = [], []
        base = 0
        for i, (raw, qtype) in enumerate(self.parts):
            if qtype in PACKED and raw.shape[0] % 8 == 0 and base % 8 == 0 and (pack := _pack_fn()) is not None:
                copy = _anonymous(raw.shape)
                for a in range(0, raw.shape[0], PACK_ROWS):  # rows a.. of the copy are bytes a * row_bytes.. (C)
                    b = min(a + PACK_ROWS, raw.shape[0])
                    if pack(int(qtype), raw[a:b].ctypes.data, b - a, raw.shape[1], copy[a:b].ctypes.data):
                        raise ValueError(f"GGMLWeight: part {i} cannot be packed")
                    if release is not None:
                        release(i, a, b)
                self.desc.part[i] = _Part(copy.ctypes.data, raw.shape[0], raw.shape[1], int(qtype), 1)
                self.packed.append(i)
                self._copies.append(copy)
            base += raw.shape[0]

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.in_features, self.out_features))

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def dtype(self) -> torch.dtype:
        return torch.uint8

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r, _ in self.parts)

    @property
    def qtypes(self) -> list[str]:
        return [q.name for _, q in self.parts]

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the stored [out, in] matrix (= columns of the [in, out] weight),
        dequantized: fp32 [len(ids), in] (an embedding lookup reads only these blocks)."""
        ids = ids.reshape(-1).cpu().numpy().astype(np.int64)
        out = np.empty((len(ids), self.in_features), dtype=np.float32)
        base = 0
        for raw, qtype in self.parts:
            sel = (ids >= base) & (ids < base + raw.shape[0])
            if sel.any():
                out[sel] = ggml.dequantize(raw[ids[sel] - base], qtype, self.in_features)
            base += raw.shape[0]
        return torch.from_numpy(out)

    def columns(self, ids: torch.Tensor) -> torch.Tensor:
        """Columns `ids` of the [in, out] weight: fp32 [in, len(ids)]."""
        return self.rows(ids).t()

    def dequantize(self) -> torch.Tensor:
        """The fp32 [in, out] weight (tests; the gguf package's bits)."""
        return torch.cat([torch.from_numpy(ggml.dequantize(r, q, self.in_features)) for r, q in self.parts]).t().contiguous()

    def __repr__(self) -> str:
        return f"GGMLWeight(shape={tuple(self.shape)}, types={self.qtypes})"


def _anonymous(shape: tuple[int, ...]) -> np.ndarray:
    """uint8 zeros of shape in an anonymous mapping of their own: numpy's own allocation asks for
    transparent huge pages, whose faults cost several times the small pages' on the VMs measured
    (benchmarks/RESULTS.md), and a packed copy is written once."""
    n = int(np.prod(shape))
    return np.frombuffer(mmap.mmap(-1, max(n, 1)), dtype=np.uint8, count=n).reshape(shape)


def _pack_fn():
    """csrc/ggml_gemm.c selfspec_ggml_pack, or None without the kernels (or with them switched off)."""
    if not build.available():
        return None
    fn = build._blocks["dll"].selfspec_ggml_pack
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_void_p]
    return fn


def operand(w: GGMLWeight) -> int:
    return ctypes.addressof(w.desc)


def reference(x: torch.Tensor, w: GGMLWeight) -> torch.Tensor:
    """Scalar C of the same chain (fp32 x and out; csrc/ggml_gemm.c selfspec_ggemm_ref); tests only."""
    build._load()
    fn = build._blocks["dll"].selfspec_ggemm_ref
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    x = x.float().contiguous()
    y = torch.empty(x.shape[0], w.out_features)
    if fn(x.shape[0], x.data_ptr(), ctypes.addressof(w.stored), y.data_ptr()):
        raise ValueError("ggml_gemm.reference: malformed weight")
    return y
