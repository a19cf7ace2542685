"""The model runtime: our own layer loop over weights taken from a transformers model.

Primitives (what drafting and verification are built from):
  embed(ids)                      -> h [T, H]
  run_layers(h, start, end, pos)  -> h after layers start..end-1, KV written at pos..pos+T-1
  logits(h, head=None)            -> [T, V] (or [T, N] through a restricted draft head)
  argmax(h)                       -> the full head's argmax token per row (greedy; no [T, V] rows)
  step_token(tokens, pos, end)    -> embed, run_layers, logits and their argmaxes (or the logits) in one C call
Sub-layers can be skipped per call (`skip_attn`, `skip_mlp`: the residual passes through).

Tensors carry no batch dimension. Several sequences go through one pass with
run_layers_batch: their rows concatenated, each run of rows (a segment) with its own KVCache
and positions (cache.SegmentTable); the matmuls stream every weight once for all rows and
each row is computed exactly as alone (selfspec/batch uses it). A verify pass over T positions must
produce *bit-identical* rows to T single-token steps (so speculative greedy output equals
autoregressive output exactly, not just up to rounding).

On the CPU (bf16 and fp32, x86-64 with AVX2 + FMA, or AVX-512) that holds by construction: fused
attention / MLP sub-layers, a pass's layers in one C call (kernels.FusedBlocks, csrc/blocks.c),
whose matmuls are the fixed-chain kernel (csrc/gemm.c) and whose attention loops over exactly
the visible keys in order; the final norm, LM head and soft-cap are the same kernels. Every row
is computed alone with fixed reduction orders, whatever T, the thread count, alignment or the BLAS.

Elsewhere (CUDA; a CPU where the kernel cannot build) the torch path below is used and the
guarantee rests on the BLAS picking the same kernel for every row count, which we encourage:
  * every matmul is `x @ w` with w stored [in, out] (BLAS's transposed-B kernels
    switch algorithms with the row count) and x padded to a fixed minimum row count;
  * attention always spans the cache's full capacity under a mask (see cache.py).
On such a CPU a warning says once that exact losslessness then depends on the BLAS.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import functools
import logging

import torch
import torch.nn.functional as F

from selfspec.architectures import ModelSpec, rotary_tables, weights_from_state_dict
from selfspec import kernels
from selfspec.cache import KVCache, SegmentTable, segment_row
from selfspec.config import MAX_SPECULATIONS
from selfspec.errors import SelfSpecError
from selfspec.greedy_head import screened_head
from selfspec.sampled_head import HeadRows, head_rows
from selfspec.quant import INT4_GROUP, quantize


_MATRICES = ("wqkv", "wo", "w_gate_up", "w_down")
_log = logging.getLogger("selfspec")
_warned_no_kernels = False


def _warn_no_kernels(reason: str) -> None:
    """Once per process: a CPU runtime without our kernels is exact only as far as the BLAS is."""
    global _warned_no_kernels
    if not _warned_no_kernels:
        _warned_no_kernels = True
        _log.warning("selfspec: the CPU kernels are unavailable here (%s); decoding runs on torch, so bit-exact "
                     "speculative output on the CPU now depends on the BLAS choosing the same kernels for every "
                     "row count", reason)


def _pad_rows(x: torch.Tensor, n: int) -> torch.Tensor:
    """x [..., rows, cols] with zero rows appended up to n rows."""
    r = x.shape[-2]
    return x if r >= n else torch.cat([x, x.new_zeros(*x.shape[:-2], n - r, x.shape[-1])], dim=-2)


def _torch_mm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None, min_rows: int = 2) -> torch.Tensor:
    """x [T, in] @ w [in, out] (+ b), with x padded to at least min_rows rows (module doc)."""
    y = (_pad_rows(x, min_rows) @ w)[: x.shape[0]]
    return y if b is None else y + b


def _kernel_mm(x: torch.Tensor, w, b: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract through selfspec.kernels: one fixed-order FMA chain per output element,
    row-invariant by construction, faster than torch's bf16 matmul at decode sizes."""
    y = kernels.matmul(x, w)
    return y if b is None else y + b


def _layout(dtype: torch.dtype, device: torch.device) -> tuple[bool, bool]:
    """(on our CPU kernels, the layer matrices on AMX tiles): one choice per runtime."""
    uses = device.type == "cpu" and dtype in (torch.bfloat16, torch.float32) and kernels.available()
    return uses, uses and dtype == torch.bfloat16 and kernels.amx()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, HF's rotate_half convention: x [..., T, D]; cos/sin [T, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class Runtime:
    def __init__(self, spec: ModelSpec, weights: dict, hf_config, dtype: torch.dtype, device: torch.device):
        self.spec = spec
        self.dtype = dtype
        self.device = torch.device(device)
        self.layers: list[dict] = weights["layers"]
        self.final_norm: torch.Tensor = weights["final_norm"]
        self.embed_weight: torch.Tensor | None = weights["embed"]  # [V, H] if untied
        self.hf_config = hf_config
        # The CPU goes through our kernels when they compiled here; CUDA through torch (one choice per runtime)
        self.uses_kernels, amx = _layout(dtype, self.device)
        if self.device.type == "cpu" and not self.uses_kernels:
            _warn_no_kernels(self.kernels_missing())
        # Row padding: CPU BLAS agrees for any >= 2 rows; cuBLAS picks kernels by shape (static shapes on CUDA)
        self.min_rows = 2 if self.device.type == "cpu" else 2 * MAX_SPECULATIONS
        self._mm = _kernel_mm if self.uses_kernels else functools.partial(_torch_mm, min_rows=self.min_rows)
        pairs = dtype == torch.bfloat16 and kernels.has_pairs()  # the arithmetic's name: equal names, equal bits
        self.numerics = f"{self.device.type}-torch" if not self.uses_kernels else "cpu-amx" if amx else "cpu-bf16pairs" if pairs else "cpu-fma"
        self.head = weights["head"]  # [H, V]; the matrices come laid out for self._mm (from_state_dict)
        self._rope: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._rope_len = 0
        self._layer_table = self._step = None  # _layer_arrays' C arrays, step_token's kernels.StepArgmax: on first use
        self._last_masks: tuple = (None, {})
        s = spec
        self._q, self._kv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        self._act = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh")}[s.activation]
        self._embed_scale = None if s.embed_scale is None else torch.tensor(s.embed_scale, dtype=dtype).item()
        # CPU: fused sub-layers (kernels.FusedBlocks), all of a pass's layers in one C call, instead of ~30 torch ops each.
        self.blocks = None
        if self.uses_kernels:
            self.blocks = kernels.FusedBlocks(
                hidden=s.hidden_size, heads=s.num_heads, kv_heads=s.num_kv_heads, head_dim=s.head_dim,
                inter=self.layers[0]["w_down"].shape[0], eps=s.rms_norm_eps, attn_scale=s.attn_scale,
                activation=s.activation, qk_norm=s.qk_norm, sandwich=s.sandwich_norms, layers=self.layers, dtype=dtype)
        self._ensure_rope(1)  # the rotary tables (and the transformers modules they come from) at load, not at the first prompt

    def compute_scope(self):
        """kernels.compute_scope() where this runtime runs on the kernels (torch's threads kept
        off their cores for the scope: kernels/pool.py); nothing on the torch path."""
        return kernels.compute_scope() if self.uses_kernels else contextlib.nullcontext()

    def warm_up(self) -> None:
        """One short pass, so that a first prompt does not pay one-time costs (the OpenMP thread team,
        first touches of code and buffers); a 4-position cache: it sits beside every weight touched."""
        with torch.inference_mode(), self.compute_scope():
            ids = torch.zeros(2, dtype=torch.long, device=self.device)
            cache = KVCache(self.spec.num_layers, self.spec.num_kv_heads, self.spec.head_dim, 4, self.dtype, self.device)
            self.forward(ids, 0, cache)
            self.forward(ids[:1], 2, cache)

    @classmethod
    def from_state_dict(cls, spec: ModelSpec, state_dict, hf_config, dtype=torch.float32, device="cpu"):
        """From a state dict or a loading.Checkpoint: each matrix goes straight into the layout
        self._mm reads (no second copy of the weights): on the kernels 64-column tiles, bf16 pairs
        where the CPU has them, the layers (not the head: kernels' doc) on AMX tiles if it has those."""
        uses_kernels, amx = _layout(dtype, torch.device(device))
        pack = functools.partial(kernels.pack_parts, dtype=dtype) if uses_kernels else None
        weights = weights_from_state_dict(spec, state_dict, dtype, device, pack and functools.partial(pack, amx=amx), pack)
        return cls(spec, weights, hf_config, dtype, torch.device(device))

    @property
    def num_layers(self) -> int:
        return self.spec.num_layers

    def new_cache(self, total_tokens: int) -> KVCache:
        cap = KVCache.capacity_for(total_tokens)
        self._ensure_rope(cap)
        s = self.spec
        return KVCache(s.num_layers, s.num_kv_heads, s.head_dim, cap, self.dtype, self.device)

    def _ensure_rope(self, length: int) -> None:
        if length <= self._rope_len:
            return
        length = max(length, 2 * self._rope_len, 1024)  # grow geometrically: rarely recompute
        tables = rotary_tables(self.hf_config, self.spec, length)
        # HF casts cos/sin to the activation dtype before use; we do the same once here. The
        # fused blocks compute in fp32 between bf16 matmuls, so they get the fp32 tables.
        dt = torch.float32 if self.blocks is not None else self.dtype
        self._rope = {k: (c.to(self.device, dt).contiguous(), s.to(self.device, dt).contiguous()) for k, (c, s) in tables.items()}
        self._rope_len = length

    # ---- primitives -------------------------------------------------------------------

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [T] -> [T, H]."""
        if self.embed_weight is not None:
            h = self.embed_weight[ids]
        else:
            h = self.head_columns(ids).t()  # tied: the head's columns are the embeddings
        if self._embed_scale is not None:
            h = h * self._embed_scale
        return h.contiguous()

    def weight_bytes(self) -> int:
        """Bytes of weights one decode step reads (layers + LM head; the embedding is a gather)."""
        return sum(kernels.nbytes(t) for L in self.layers for t in L.values()) + kernels.nbytes(self.head) + kernels.nbytes(self.final_norm)

    def kernels_missing(self) -> str:
        """Why this runtime does not run on selfspec's kernels, in words (for one-line errors)."""
        if self.device.type != "cpu":
            return f"the model is on {self.device.type}"
        return kernels.load_error() or ("disabled by SELFSPEC_NO_KERNELS" if not kernels.available() else f"{self.dtype} weights")

    def quantized(self, bits: int, group: int = INT4_GROUP, made: dict | None = None) -> "Runtime":
        """A drafting copy of this runtime whose layer matrices are `bits`-bit copies of its own
        (selfspec.quant; int4 in groups of `group` rows). Embeddings, norms, rotary tables and
        the LM head are shared (drafts pass the head they draft with: Runtime.logits(head=)),
        and it reads and writes the same KVCache layout, so a draft attends to the verifier's
        exact keys and values. CPU kernels only. `made`: {"<layer>.<matrix>": QuantizedWeight}
        made earlier (quant_store), used where present."""
        if not self.uses_kernels:
            raise SelfSpecError("quantized drafting needs selfspec's CPU kernels (x86-64 with AVX2 or AVX-512); "
                                f"they are unavailable here ({self.kernels_missing()})")
        if bits == 4 and group != INT4_GROUP:
            raise ValueError(f"int4 copies use groups of {INT4_GROUP} rows (the kernel's activation block), got {group}")
        made = made or {}

        def copy_of(i: int, k: str):
            w = made.get(f"{i}.{k}")
            if w is not None and (w.bits, w.group if bits == 4 else 0, w.shape) == (bits, group if bits == 4 else 0, self.layers[i][k].shape):
                return w
            return quantize(self.weight(i, k), bits, group)

        q = copy.copy(self)  # shallow: spec, embeddings, norms, head and rope tables are shared
        q.layers = [{k: copy_of(i, k) if k in _MATRICES else w for k, w in L.items()} for i, L in enumerate(self.layers)]
        q._step = None  # its own blocks
        q.blocks = kernels.FusedBlocks(
            hidden=self.spec.hidden_size, heads=self.spec.num_heads, kv_heads=self.spec.num_kv_heads,
            head_dim=self.spec.head_dim, inter=self.layers[0]["w_down"].shape[0], eps=self.spec.rms_norm_eps,
            attn_scale=self.spec.attn_scale, activation=self.spec.activation, qk_norm=self.spec.qk_norm,
            sandwich=self.spec.sandwich_norms, layers=q.layers, dtype=self.dtype)
        return q

    def head_weight(self) -> torch.Tensor:
        """The whole LM head as a plain [H, V] tensor (a copy when it is stored packed)."""
        return self.head.unpack() if isinstance(self.head, kernels.PackedWeight) else self.head

    def head_columns(self, ids: torch.Tensor) -> torch.Tensor:
        """Columns `ids` of the LM head: [H, len(ids)]."""
        if isinstance(self.head, kernels.PackedWeight):
            return self.head.columns(ids)
        return self.head.index_select(1, ids)

    def weight(self, i: int, name: str) -> torch.Tensor:
        """Layer i's matrix `name` as a plain [in, out] tensor, whatever its stored layout."""
        w = self.layers[i][name]
        return w.unpack() if isinstance(w, kernels.PackedWeight) else w

    def prepare_weight(self, w: torch.Tensor):
        """A [in, out] weight in the layout self._mm is fastest with (packed for the kernel:
        contiguous 64-column tiles, bf16 pairs for VDPBF16PS where the CPU has it)."""
        return kernels.pack(w) if self.uses_kernels else w

    def rms_norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """The model family's RMSNorm in torch ops (the torch path; differentiable, for training)."""
        # Both families normalise in fp32; Llama multiplies by w after casting back, Gemma before
        # (its (1 + w) is folded into w at load time). F.rms_norm is one fused op per norm.
        eps = self.spec.rms_norm_eps
        if self.spec.norm == "gemma" or x.dtype == torch.float32:
            return F.rms_norm(x.float(), (x.shape[-1],), w, eps).to(x.dtype)
        return w.to(x.dtype) * F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)

    def _attention(self, i: int, x: torch.Tensor, pos: int, cache: KVCache, mask: torch.Tensor) -> torch.Tensor:
        s, L = self.spec, self.layers[i]
        T = x.shape[0]
        qkv = self._mm(self.rms_norm(x, L["attn_norm"]), L["wqkv"], L.get("bqkv"))
        q, k, v = qkv.split([self._q, self._kv, self._kv], dim=-1)
        q = q.view(T, s.num_heads, s.head_dim).transpose(0, 1)  # [nh, T, D]
        k = k.view(T, s.num_kv_heads, s.head_dim).transpose(0, 1)  # [nkv, T, D]
        v = v.view(T, s.num_kv_heads, s.head_dim).transpose(0, 1)
        if s.qk_norm:
            q = self.rms_norm(q, L["q_norm"])
            k = self.rms_norm(k, L["k_norm"])
        cos, sin = self._rope[s.rope_kinds[i]]
        cos, sin = cos[pos : pos + T], sin[pos : pos + T]
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        cache.write(i, pos, k, v)
        # Group the query heads that share a kv head: [nkv, g*T, D], rows padded as in _mm
        # so decode and verify hit the same matmul kernel.
        g, nkv, C = s.group_size, s.num_kv_heads, cache.capacity
        rows, min_rows = g * T, self.min_rows * (g if self.min_rows > 2 else 1)
        qg = q.reshape(nkv, rows, s.head_dim)
        scores = self._bmm(qg, cache.kt[i], min_rows)  # [nkv, rows, C]
        scores = (scores.float() * s.attn_scale).view(nkv, g, T, C).masked_fill(~mask, float("-inf"))
        probs = scores.softmax(-1).to(x.dtype).view(nkv, rows, C)
        out = self._bmm(probs, cache.v[i], min_rows)  # [nkv, rows, D]
        out = out.reshape(s.num_heads, T, s.head_dim).transpose(0, 1).reshape(T, self._q)
        out = self._mm(out, L["wo"], L.get("bo"))
        if s.sandwich_norms:
            out = self.rms_norm(out, L["post_attn_norm"])
        return out

    def _bmm(self, a: torch.Tensor, b: torch.Tensor, min_rows: int) -> torch.Tensor:
        """Per kv head a[h] [rows, k] @ b[h] [k, n] -> [heads, rows, n], row-invariant like _mm."""
        if self.uses_kernels:  # b[h] is a contiguous slice of the cache
            return torch.stack([kernels.matmul(a[h], b[h]) for h in range(a.shape[0])])
        return torch.matmul(_pad_rows(a, min_rows), b)[:, : a.shape[1]]

    def _mlp(self, i: int, x: torch.Tensor) -> torch.Tensor:
        L = self.layers[i]
        gu = self._mm(self.rms_norm(x, L["mlp_norm"]), L["w_gate_up"], L.get("b_gate_up"))
        gate, up = gu.chunk(2, dim=-1)
        out = self._mm(self._act(gate) * up, L["w_down"], L.get("b_down"))
        if self.spec.sandwich_norms:
            out = self.rms_norm(out, L["post_mlp_norm"])
        return out

    def masks(self, pos: int, t: int, cache: KVCache) -> dict[int | None, torch.Tensor]:
        """Attention masks of the torch path for rows pos..pos+t-1, per window size; the last
        ones are kept, so a caller timing layer by layer does not rebuild them every call."""
        key = (id(cache), cache.capacity, pos, t)
        if self._last_masks[0] != key:
            self._last_masks = (key, {w: cache.mask(pos, t, w) for w in set(self.spec.sliding_windows)})
        return self._last_masks[1]

    def run_layers(
        self,
        h: torch.Tensor,
        start: int,
        end: int,
        pos: int,
        cache: KVCache,
        skip_attn: frozenset[int] = frozenset(),
        skip_mlp: frozenset[int] = frozenset(),
        capture: dict[int, torch.Tensor | None] | None = None,
    ) -> torch.Tensor:
        """h [T, H] holds positions pos..pos+T-1 at the input of layer `start`; -> h after layer
        end-1, KV written at pos..pos+T-1. `capture`: layer indices (its keys) whose input h is
        wanted; each is filled with a copy [T, H] (the one layer loop every caller shares)."""
        if self.blocks is not None:
            h = h.contiguous().clone()  # updated in place below; callers keep their input
            T = h.shape[0]
            if pos + T > self._rope_len:
                raise ValueError(f"run_layers: positions up to {pos + T} beyond the rotary tables ({self._rope_len}); make the cache with new_cache")
            seg = (ctypes.c_long * 8)(*segment_row(cache, pos, T))  # one sequence: no SegmentTable to build
            rope = kernels.rope_rows(self._rope.values(), pos)
            self._fused_layers(h, start, end, ctypes.addressof(seg), 1, rope, skip_attn, skip_mlp, capture)
            return h
        masks = self.masks(pos, h.shape[0], cache)
        windows = self.spec.sliding_windows
        for i in range(start, end):
            if capture is not None and i in capture:
                capture[i] = h.clone()
            if i not in skip_attn:
                h = h + self._attention(i, h, pos, cache, masks[windows[i]])
            if i not in skip_mlp:
                h = h + self._mlp(i, h)
        return h

    def _layer_arrays(self, skip_attn: frozenset[int], skip_mlp: frozenset[int]):
        """The fused blocks' per-layer C arrays: sliding windows, rotary kinds (made once) and
        the skip flags of this skip set (kept per set)."""
        if self._layer_table is None:
            n, kinds = self.num_layers, list(self._rope)
            self._layer_table = ((ctypes.c_long * n)(*[w or 0 for w in self.spec.sliding_windows]),
                                 (ctypes.c_int * n)(*[kinds.index(k) for k in self.spec.rope_kinds]), {})
        windows, kinds, skips = self._layer_table
        skip = skips.get((skip_attn, skip_mlp))
        if skip is None:
            skip = skips[(skip_attn, skip_mlp)] = (ctypes.c_ubyte * self.num_layers)(
                *[(i in skip_attn) | 2 * (i in skip_mlp) for i in range(self.num_layers)])
        return windows, kinds, skip

    def step_token(self, tokens: list[int], pos: int, cache: KVCache, end: int, head=None, skip_attn: frozenset[int] = frozenset(),
                   skip_mlp: frozenset[int] = frozenset(), logits: bool = False) -> list[int] | torch.Tensor | None:
        """logits(run_layers(embed(tokens), 0, end, pos, cache, skip_attn, skip_mlp), head).argmax(-1).tolist() in one
        C call (kernels.StepArgmax), or with `logits` those logits [T, N]; None where the fused blocks do not run."""
        if self.blocks is None or pos + len(tokens) > self._rope_len:
            return None
        if self._step is None:
            s = self.spec
            self._step = kernels.StepArgmax(self.blocks, self.head if self.embed_weight is None else self.embed_weight,
                                            self._embed_scale, self.final_norm, s.rms_norm_eps, s.final_logit_softcap)
        return self._step.run(tokens, segment_row(cache, pos, len(tokens)), end, self._layer_arrays(skip_attn, skip_mlp),
                              kernels.rope_rows(self._rope.values(), pos), self.head if head is None else head, logits)

    def _fused_layers(self, h: torch.Tensor, start: int, end: int, segs_ptr: int, nseg: int, rope: tuple,
                      skip_attn: frozenset[int], skip_mlp: frozenset[int], capture: dict | None = None) -> None:
        """Layers start..end-1 of the fused blocks over h in place, one C call per stretch between
        captured layers. rope: kernels.rope_rows' (cos, sin) of h's [T, D] fp32 rows."""
        windows, kinds, skip = self._layer_arrays(skip_attn, skip_mlp)
        cos, sin = rope
        cuts = sorted(i for i in capture if start <= i < end) if capture else []
        a, threads = start, kernels.threads()
        for b in cuts + [end]:
            if b > a:
                self.blocks.run(h, a, b, segs_ptr, nseg, windows, kinds, cos, sin, skip, threads)
            if b < end:
                capture[b] = h.clone()
            a = b

    def run_layers_batch(
        self,
        h: torch.Tensor,
        start: int,
        end: int,
        segs: SegmentTable,
        skip_attn: frozenset[int] = frozenset(),
        skip_mlp: frozenset[int] = frozenset(),
    ) -> torch.Tensor:
        """run_layers for several sequences in one pass: h [T, H] is the concatenation of their
        rows in `segs` order (each segment: its own cache, positions pos..pos+rows-1). On the
        CPU kernels every weight matrix streams once for all T rows and each row is computed
        exactly as in a solo run_layers call (batch invariance: csrc/blocks.c). Elsewhere the
        segments run one after another through run_layers (exact, and no faster than solo)."""
        if self.blocks is None:
            parts, r0 = [], 0
            for cache, pos, rows in segs.segments:
                parts.append(self.run_layers(h[r0 : r0 + rows], start, end, pos, cache, skip_attn, skip_mlp))
                r0 += rows
            return torch.cat(parts) if parts else h
        h = h.contiguous().clone()
        if max((p + r for _, p, r in segs.segments), default=0) > self._rope_len:
            raise ValueError(f"run_layers_batch: positions beyond the rotary tables ({self._rope_len}); make the caches with new_cache")
        idx = torch.tensor(segs.positions(), dtype=torch.long)
        rows = [(c.index_select(0, idx), s.index_select(0, idx)) for c, s in self._rope.values()]  # [T, D] per row
        self._fused_layers(h, start, end, segs.ptr, segs.count, kernels.rope_rows(rows, 0),
                           skip_attn, skip_mlp)
        return h

    def logits(self, h: torch.Tensor, head=None) -> torch.Tensor:
        """Final norm + LM head. h [T, H] -> [T, V] (fp32). `head` is a [H, N] slice of the
        LM head for a restricted draft vocabulary, from prepare_weight(head_columns(ids))."""
        cap = self.spec.final_logit_softcap
        if self.uses_kernels:  # row-invariant by construction (module doc)
            x = kernels.norm_rows(h, self.final_norm, self.spec.rms_norm_eps)
            out = self._mm(x, self.head if head is None else head).float()
            return kernels.softcap_(out, cap) if cap else out
        out = self._mm(self.rms_norm(h, self.final_norm), self.head if head is None else head).float()
        return torch.tanh(out / cap) * cap if cap else out

    def argmax(self, h: torch.Tensor) -> list[int]:
        """Greedy: the argmax token of each row of h [T, H] under the full head (first index on
        ties), exactly logits(h).argmax(-1), through the int8-screened head where it applies
        (greedy_head.py: half the head's bytes, and no [T, V] rows)."""
        screen = screened_head(self)
        if screen is None:
            return self.logits(h).argmax(-1).tolist()
        x = kernels.norm_rows(h, self.final_norm, self.spec.rms_norm_eps)
        return screen.argmax(x, lambda rows: self._mm(x[rows], self.head).float())

    def forward(self, ids: torch.Tensor, pos: int, cache: KVCache, last_only: bool = False,
                argmax_only: bool = False, picks_only: bool = False) -> torch.Tensor | list[int] | HeadRows:
        """Full model on ids [T] at positions pos..; returns fp32 logits [T or 1, V], or with argmax_only
        (greedy) their argmax tokens (Runtime.argmax), with picks_only (Gumbel-max picks only) sampled_head's rows."""
        h = self.run_layers(self.embed(ids), 0, self.num_layers, pos, cache)
        return self.head_output(h[-1:] if last_only else h, argmax_only, picks_only)

    def head_output(self, h: torch.Tensor, argmax_only: bool = False, picks_only: bool = False) -> torch.Tensor | list[int] | HeadRows:
        """The head's output for the last layer's rows h [T, H], as forward returns it."""
        return self.argmax(h) if argmax_only else head_rows(self, h, screened_head(self)) if picks_only else self.logits(h)
