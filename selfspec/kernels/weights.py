"""Weights as the kernels read them: 64-column tiles (PackedWeight, pack, pack_rows) and
quantized copies (QuantizedWeight; csrc/quant.c for the layouts and chains)."""

from __future__ import annotations

import ctypes
import functools

import torch

from selfspec.kernels import build
from selfspec.kernels.build import available, has_pairs
from selfspec.kernels.pool import threads


class PackedWeight:
    """w [K, N] stored as data [ceil(N/64), K, 64] (tile t holds columns 64t..64t+63, zero padded),
    or, with pairs=True (bf16 only), as data [ceil(N/64), ceil(K/2), 64, 2]: rows 2j and 2j+1 of
    each column side by side, for the VDPBF16PS path (x is then rounded to bf16 first). amx (pairs
    only): the same data, multiplied on AMX tiles, a chain of its own (csrc/gemm.c, gemm_amx)."""

    __slots__ = ("data", "in_features", "out_features", "pairs", "amx")

    def __init__(self, data: torch.Tensor, in_features: int, out_features: int, pairs: bool = False, amx: bool = False):
        if amx and not pairs:
            raise ValueError("PackedWeight: the AMX chain needs the pair layout")
        self.data = data
        self.in_features = in_features
        self.out_features = out_features
        self.pairs = pairs
        self.amx = amx

    @property
    def layout(self) -> int:
        """selfspec_gemm's layout code: 1 tiles, 2 pairs (VDPBF16PS), 4 pairs on AMX tiles."""
        return 4 if self.amx else 2 if self.pairs else 1

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
            d = d.transpose(2, 3).reshape(d.shape[0], -1, build._TILE)
        return d.permute(1, 0, 2).reshape(d.shape[1], -1)[:k, :n].contiguous()

    def columns(self, ids: torch.Tensor) -> torch.Tensor:
        """Columns `ids` of w: [K, len(ids)] (a gather, no unpacking of the rest)."""
        d = self.data[ids // build._TILE, :, ids % build._TILE]  # [n, K] or [n, K2, 2]
        return d.reshape(len(ids), -1)[:, : self.in_features].t()

    def __repr__(self) -> str:
        return f"PackedWeight(shape={tuple(self.shape)}, dtype={self.dtype}, pairs={self.pairs}, amx={self.amx})"


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
        b = self.q.permute(1, 3, 0, 2)  # [NB, K4 or K8, 64, 4] -> [K4|K8, 4, NB, 64]
        if self.bits == 8:  # u = q + 128, byte i of k-row j: k = 4j + i
            q = b.reshape(-1, b.shape[2] * b.shape[3])[:k, :n].float() - 128
            return q * self.scale
        u = torch.stack([b & 0xF, b >> 4], dim=1)  # [K8, 2, 4, NB, 64]: k = 8j + 4 * (high nibble) + i
        u = u.reshape(-1, b.shape[2] * b.shape[3])[:k, :n].float()
        g = torch.arange(k, device=u.device) // self.group
        return self.scale.float()[g] * (u - self.zero.float()[g])

    def __repr__(self) -> str:
        return f"QuantizedWeight(shape={tuple(self.shape)}, bits={self.bits}, group={self.group})"


def nbytes(w) -> int:
    """Bytes of a weight in any of its stored forms (tensor, PackedWeight with its padding, QuantizedWeight)."""
    if isinstance(w, QuantizedWeight) or hasattr(w, "parts"):  # QuantizedWeight, ggml_gemm.GGMLWeight
        return w.nbytes
    t = w.data if isinstance(w, PackedWeight) else w
    return t.numel() * t.element_size()


def _qgemm_ref(x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    """Scalar C reference of the quantized chains (fp32 x and out); tests only."""
    build._load()
    x = x.float().contiguous()
    y = torch.empty(x.shape[0], w.out_features)
    build._blocks["qgemm_ref"](x.shape[0], x.data_ptr(), ctypes.addressof(w.desc), y.data_ptr())
    return y


def quant_errors(w: torch.Tensor, group: int, s: torch.Tensor, z: torch.Tensor | None, lo: float, hi: float) -> torch.Tensor | None:
    """Squared errors of candidate quantizations of w [K, N] (fp32): s, z [C, G, N] -> err
    [C, G, N] (csrc/quant.c selfspec_quant_errors), or None when not available()."""
    if not available():
        return None
    fn = build._blocks["dll"].selfspec_quant_errors
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] + [ctypes.c_long] * 3 + [ctypes.c_void_p] * 2 + [ctypes.c_int, ctypes.c_float,
                                                                                    ctypes.c_float, ctypes.c_void_p, ctypes.c_int]
    w, s = w.float().contiguous(), s.float().contiguous()
    z = None if z is None else z.float().contiguous()
    err = torch.empty_like(s)
    rc = fn(w.data_ptr(), w.shape[0], w.shape[1], group, s.data_ptr(), 0 if z is None else z.data_ptr(), s.shape[0],
            lo, hi, err.data_ptr(), threads())
    if rc:
        raise RuntimeError(f"kernels.quant_errors: returned {rc}")
    return err


def pack(w: torch.Tensor, pairs: bool | None = None, amx: bool = False) -> PackedWeight:
    """Re-lay w [K, N] (bf16 or fp32, CPU) as 64-column tiles for matmul. Plain tiles give results
    bit-identical to matmul with the plain w. pairs (default: has_pairs() for bf16 weights) uses
    the pair layout and so the VDPBF16PS chain (see csrc/gemm.c), which has its own bits; amx
    (needs amx()) the same layout on AMX tiles, whose chain is another one again."""
    if amx and not build.amx():
        raise ValueError("pack: no AMX pair path here (kernels.amx() is False)")
    if not isinstance(w, torch.Tensor) or w.dim() != 2:
        raise ValueError("pack expects a 2-D tensor [K, N]")
    if w.dtype not in build._DTYPES:
        raise ValueError(f"pack: unsupported weight dtype {w.dtype}")
    if w.device.type != "cpu":
        raise ValueError("pack: weight must be on the CPU")
    if pairs is None:
        pairs = w.dtype == torch.bfloat16 and has_pairs()
    if pairs and w.dtype != torch.bfloat16:
        raise ValueError("pack: the pair layout needs bf16 weights")
    k, n = w.shape
    nb = (n + build._TILE - 1) // build._TILE
    kp = k + (k % 2 if pairs else 0)
    with torch.no_grad():
        padded = torch.zeros(kp, nb * build._TILE, dtype=w.dtype)
        padded[:k, :n] = w
        if pairs:  # [K2, 2, NB, 64] -> [NB, K2, 64, 2]
            data = padded.view(kp // 2, 2, nb, build._TILE).permute(2, 0, 3, 1).contiguous()
        else:
            data = padded.view(k, nb, build._TILE).permute(1, 0, 2).contiguous()
    return PackedWeight(data, k, n, pairs, amx and pairs)


CHUNK_BYTES = 8 << 20  # a part is read, cast and placed this many bytes of rows at a time (a multiple of 64 rows)


@functools.cache
def _malloc_trim():
    try:
        return ctypes.CDLL(None).malloc_trim  # glibc
    except (OSError, AttributeError):
        return None


def release_freed() -> None:
    """Give the heap's freed pages back to the OS (glibc's malloc_trim; elsewhere nothing).
    A load allocates and frees chunks of rows between its long-lived weights, and glibc keeps
    the freed ones resident once its mmap threshold has grown past their size: without this the
    loader's peak on a 600 MB fp32 model wandered between runs, well above the weights."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def chunk_rows(row_bytes: int) -> int:
    """Rows per chunk: about CHUNK_BYTES, whole 64-row tiles (the fast path of pack_parts)."""
    return max(build._TILE, CHUNK_BYTES // max(1, row_bytes) // build._TILE * build._TILE)


def pack_parts(parts, dtype: torch.dtype, pairs: bool | None = None, amx: bool = False) -> PackedWeight:
    """pack(torch.cat(parts).t().to(dtype)) without the concatenation, the transpose or a full
    copy of any part: parts are [N_i, K] row sources (a tensor, or anything with .shape and
    row slicing, e.g. a checkpoint tensor read lazily), HF's [out, in] layout; the fused
    matrix's column n is row n of the stacked parts. Each part is read _CHUNK_ROWS rows at a
    time and written straight into its tiles, so loading a model never holds a second copy of
    a weight (the same bits as pack: each element is placed, not computed)."""
    k = int(parts[0].shape[1])
    if any(int(p.shape[1]) != k for p in parts):
        raise ValueError("pack_parts: parts must share their row length K")
    if dtype not in build._DTYPES:
        raise ValueError(f"pack_parts: unsupported weight dtype {dtype}")
    if pairs is None:
        pairs = dtype == torch.bfloat16 and has_pairs()
    if pairs and dtype != torch.bfloat16:
        raise ValueError("pack_parts: the pair layout needs bf16 weights")
    if amx and not build.amx():
        raise ValueError("pack_parts: no AMX pair path here (kernels.amx() is False)")
    n = sum(int(p.shape[0]) for p in parts)
    nb, kp, tile = -(-n // build._TILE), k + (k % 2 if pairs else 0), build._TILE
    padded = n % tile != 0 or kp != k
    alloc = torch.zeros if padded else torch.empty
    # lanes[t, j] is the k-stream of column 64 t + j: [K2, 2] (pairs) or [K] (strided views of data)
    data = alloc(nb, kp // 2, tile, 2, dtype=dtype) if pairs else alloc(nb, k, tile, dtype=dtype)
    lanes = data.permute(0, 2, 1, 3) if pairs else data.permute(0, 2, 1)
    g, step = 0, chunk_rows(4 * k)  # g: the fused matrix's column of the next row; step: rows of up to fp32 in flight
    with torch.no_grad():
        for part in parts:
            rows_total = int(part.shape[0])
            for r0 in range(0, rows_total, step):
                rows = part[r0:min(rows_total, r0 + step)].to(dtype)  # [m, K]
                m = rows.shape[0]
                if pairs:
                    if kp != k:
                        rows = torch.cat([rows, rows.new_zeros(m, 1)], 1)
                    rows = rows.reshape(m, kp // 2, 2)
                if g % tile == 0 and m % tile == 0:  # whole tiles: one strided copy
                    lanes[g // tile:(g + m) // tile] = rows.reshape(m // tile, tile, *rows.shape[1:])
                else:
                    idx = torch.arange(g, g + m)
                    lanes[idx // tile, idx % tile] = rows
                g += m
    return PackedWeight(data, k, n, pairs, amx and pairs)


def pack_rows(w_t: torch.Tensor, pairs: bool | None = None) -> PackedWeight:
    """pack(w_t.t()) without materialising the transpose: w_t is [N, K] (e.g. an LM head
    stored one row per token). One pass over memory instead of two strided ones."""
    n, k = w_t.shape
    if pairs is None:
        pairs = w_t.dtype == torch.bfloat16 and has_pairs()
    if n % build._TILE or (pairs and k % 2):
        return pack(w_t.t(), pairs)
    with torch.no_grad():
        if pairs:  # [NB, 64, K2, 2] -> [NB, K2, 64, 2]
            data = w_t.reshape(n // build._TILE, build._TILE, k // 2, 2).permute(0, 2, 1, 3).contiguous()
        else:
            data = w_t.reshape(n // build._TILE, build._TILE, k).permute(0, 2, 1).contiguous()
    return PackedWeight(data, k, n, pairs)
