"""Fused decoder layers (csrc/blocks.c): a forward pass's whole layer loop in one C call, and
the row-wise final norm and logit soft-cap."""

from __future__ import annotations

import ctypes
import threading

import torch

from selfspec.kernels import build
from selfspec.kernels.build import available
from selfspec.kernels.gemm import operand
from selfspec.kernels.ggml_gemm import LAYOUT as _GGML_LAYOUT, GGMLWeight
from selfspec.kernels.pool import threads
from selfspec.kernels.weights import PackedWeight, QuantizedWeight


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
    """Fused attention and MLP sub-layers, a pass's layers in one C call (residual stream,
    cache and matrices in one storage dtype, bf16 or fp32; fp32 in between).

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
            raise RuntimeError(f"kernels not available ({build._load_error or 'disabled'})")
        if dtype not in build._DTYPES:
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
                if isinstance(w, (QuantizedWeight, GGMLWeight)):  # a drafting copy (3) or GGUF blocks (5): descriptors
                    setattr(s, name, ctypes.addressof(w.desc))
                    setattr(s, flag, 3 if isinstance(w, QuantizedWeight) else _GGML_LAYOUT)
                    self._keep.append(w)
                    continue
                t = w.data if isinstance(w, PackedWeight) else w
                if t.dtype != dtype or not t.is_contiguous():
                    raise ValueError(f"FusedBlocks: {name} must be a contiguous {dtype} matrix")
                setattr(s, name, t.data_ptr())
                setattr(s, flag, w.layout if isinstance(w, PackedWeight) else 0)
                self._keep.append(t)
            for name in _VECTORS:
                if L.get(name) is not None:
                    v = L[name].detach().float().contiguous()
                    setattr(s, name, v.data_ptr())
                    self._keep.append(v)
            self.layers.append(s)
        self._dims_ptr = ctypes.addressof(self.dims)
        self._layer_ptrs = [ctypes.addressof(s) for s in self.layers]
        self._run = build._blocks["layers"]
        self._layer_array = (ctypes.c_void_p * len(self.layers))(*self._layer_ptrs)

    def run(self, h: torch.Tensor, start: int, end: int, segs_ptr: int, nseg: int, windows, rope, cos, sin, skip,
            threads: int) -> None:
        """Layers start..end-1 over h [T, H] (contiguous, self.dtype, updated in place) in one C
        call (csrc/blocks.c, selfspec_layers_batch): the attention and MLP calls below, in order.
        segs_ptr/nseg: a segment table (cache.SegmentTable's layout); windows (c_long), rope
        (c_int), skip (c_ubyte): one entry per layer; cos/sin: c_void_p arrays of the [T, D]
        fp32 rotary tables that rope[i] indexes."""
        rc = self._run(self._dims_ptr, self._layer_array, start, end, h.data_ptr(), h.shape[0], segs_ptr, nseg,
                       windows, rope, cos, sin, skip, threads)
        if rc:
            raise RuntimeError(f"kernels: layer loop returned {rc}")


def rope_rows(tables, pos: int) -> tuple[ctypes.Array, ctypes.Array]:
    """The layer loop's cos and sin arguments: the address of row `pos` of each [len, D] fp32
    table (cos, sin) in `tables` (rows pos.. are contiguous; no tensor view on the decode path)."""
    tables = list(tables)
    at = lambda t: t.data_ptr() + pos * t.stride(0) * t.element_size()  # noqa: E731
    return (ctypes.c_void_p * len(tables))(*[at(c) for c, _ in tables]), (ctypes.c_void_p * len(tables))(*[at(s) for _, s in tables])


class StepArgmax:
    """Runtime.step_token's C call (csrc/blocks.c, selfspec_step_argmax): the embedding, layers,
    final norm, head, soft-cap and argmax of a few rows, the kernels the primitives call, in the
    same order. A layer pass streams every weight through the caches and evicts the interpreter's
    and torch's code, so the handful of small ops around it cost a noticeable share of a draft token
    on the default model; here they are loops in C. Scratch is per thread.

    embed: the embedding rows, a plain [V, H] tensor or (tied) the packed LM head [H, V], in the
    blocks' dtype; embed_scale: None or the factor (rounded to that dtype) the rows are scaled by."""

    def __init__(self, blocks: FusedBlocks, embed, embed_scale: float | None, final_norm: torch.Tensor, eps: float,
                 softcap: float | None):
        packed = isinstance(embed, PackedWeight)
        self.emb = embed.data if packed else embed.contiguous()
        self.emb_kind = (2 if embed.pairs else 1) if packed else 0
        if self.emb.dtype != blocks.dtype:
            raise ValueError("StepArgmax: embeddings must be in the blocks' storage dtype")
        self.blocks, self.scale, self.eps, self.cap = blocks, embed_scale or 0.0, eps, softcap or 0.0
        self.norm = final_norm.detach().float().contiguous()
        self._local = threading.local()

    def _scratch(self, rows: int, n: int) -> tuple[torch.Tensor, ...]:
        """h, xn [rows, H] and y [rows, n] in the storage dtype, yf [rows, n] fp32, out [rows]
        int64: grown when needed, kept per thread."""
        bufs = getattr(self._local, "bufs", None)
        if bufs is None or bufs[0].shape[0] < rows or bufs[2].shape[1] < n:
            H, dt = self.blocks.dims.hidden, self.blocks.dtype
            r = max(rows, bufs[0].shape[0] if bufs else 0)
            n = max(n, bufs[2].shape[1] if bufs else 0)
            bufs = self._local.bufs = (torch.empty(r, H, dtype=dt), torch.empty(r, H, dtype=dt), torch.empty(r, n, dtype=dt),
                                       torch.empty(r, n, dtype=torch.float32), torch.empty(r, dtype=torch.long))
        return bufs

    def run(self, tokens: list[int], seg: list[int], end: int, arrays, rope, head, logits: bool = False) -> list[int] | torch.Tensor:
        """seg: cache.segment_row's 8 numbers; arrays: Runtime._layer_arrays' (windows, rope
        kinds, skip flags); rope: rope_rows' (cos, sin) at the first token's position; head:
        [H, N], anything matmul takes. -> the rows' argmaxes, or with `logits` the fp32 logits
        [T, N] themselves (a copy: the scratch is the next call's)."""
        head = head if isinstance(head, (PackedWeight, QuantizedWeight)) else head.contiguous()
        hp, layout, _ = operand(head)
        T, n = len(tokens), head.shape[1]
        h, xn, y, yf, out = self._scratch(T, n)
        windows, kinds, skip = arrays
        segs, toks = (ctypes.c_long * 8)(*seg), (ctypes.c_long * T)(*tokens)
        rc = build._blocks["step_argmax"](
            ctypes.addressof(self.blocks.dims), self.blocks._layer_array, end, self.emb.data_ptr(), self.emb_kind, toks, T,
            self.scale, ctypes.addressof(segs), windows, kinds, *rope, skip, self.norm.data_ptr(), self.eps, hp, layout, n,
            self.cap, h.data_ptr(), xn.data_ptr(), y.data_ptr(), yf.data_ptr(), out.data_ptr(), threads())
        if rc:
            raise RuntimeError(f"kernels: step returned {rc}")
        return yf.view(-1)[: T * n].view(T, n).clone() if logits else out[:T].tolist()  # the C call's rows are N apart


def norm_rows(h: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of every row of h [T, H] (bf16/fp32, CPU) times w (fp32 [H]), in h's dtype:
    fp32 arithmetic with the fused blocks' fixed per-row reduction (row-invariant)."""
    if not available():
        raise RuntimeError(f"kernels.norm_rows: kernel not available ({build._load_error or 'disabled'})")
    if h.dtype not in build._DTYPES or h.dim() != 2 or h.device.type != "cpu":
        raise ValueError("kernels.norm_rows: h must be a 2-D bf16/fp32 CPU tensor")
    h = h.detach().contiguous()
    w = w.detach().float().contiguous()
    if w.shape != (h.shape[1],):
        raise ValueError(f"kernels.norm_rows: weight shape {tuple(w.shape)} does not match rows of {h.shape[1]}")
    out = torch.empty_like(h)
    rc = build._blocks["norm_rows"](h.data_ptr(), h.dtype == torch.float32, h.shape[0], h.shape[1], w.data_ptr(), eps, out.data_ptr())
    if rc:
        raise RuntimeError(f"kernels.norm_rows: returned {rc}")
    return out


def softcap_(y: torch.Tensor, cap: float) -> torch.Tensor:
    """y = cap * tanh(y / cap) in place (fp32 contiguous CPU); each element's arithmetic is the
    same wherever it sits in the tensor (row-invariant)."""
    if y.dtype != torch.float32 or not y.is_contiguous() or y.device.type != "cpu":
        raise ValueError("kernels.softcap_: y must be a contiguous fp32 CPU tensor")
    rc = build._blocks["softcap"](y.data_ptr(), y.numel(), cap)
    if rc:
        raise RuntimeError(f"kernels.softcap_: returned {rc}")
    return y
