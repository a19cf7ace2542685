"""The model forward of the compiled backend: pure torch over static buffers, batched.

Every tensor has a batch dimension B (a step's sequences, each with its own positions); a pass
runs T rows per sequence at positions P [B, T] (any, e.g. a sequence's pos..pos+T-1). Keys and
values live in one static buffer per side, [layers, B, capacity, kv_heads, head_dim], written
at P by `index_copy_` (no host value decides where), read whole under a mask built from P.

Row invariance (a verify row equals the single-token step at its position, bit for bit): every
matmul pads each sequence's rows to ROWS, the largest verify bucket, so a pass of any width runs
the same matmul shapes per batch bucket; attention spans the whole capacity under the mask; the
other operations are row-wise. tests/test_compiled.py checks the consequence on generations.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from selfspec.compiled.weights import StaticWeights
from selfspec.runtime import apply_rotary

ROWS = 16  # the largest verify bucket; MAX_SPECULATIONS + 1 rounds up to it


@dataclass
class StaticCache:
    k: torch.Tensor  # [L, B, C, kv_heads, D]
    v: torch.Tensor  # [L, B, C, kv_heads, D]

    @staticmethod
    def new(w: StaticWeights, batch: int, capacity: int) -> "StaticCache":
        s = w.spec
        shape = (s.num_layers, batch, capacity, s.num_kv_heads, s.head_dim)
        # zeros: masked keys multiply finite values by probability 0
        return StaticCache(torch.zeros(shape, dtype=w.dtype, device=w.device), torch.zeros(shape, dtype=w.dtype, device=w.device))

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    def rows(self, b: int) -> "StaticCache":
        """Sequence b's buffers as a batch of one (views: writes land in this cache)."""
        return StaticCache(self.k[:, b : b + 1], self.v[:, b : b + 1])


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """x [..., T, n] with zero rows appended up to `rows` (T >= rows: x itself)."""
    t = x.shape[-2]
    return x if t >= rows else F.pad(x, (0, 0, 0, rows - t))


def mm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """x [B, T, in] @ w [in, out] (+ b), each sequence's rows padded to ROWS (module doc)."""
    B, T, n = x.shape
    xp = _pad_rows(x, ROWS)
    y = (xp.reshape(-1, n) @ w).view(B, xp.shape[1], -1)[:, :T]
    return y if b is None else y + b


def bmm(a: torch.Tensor, b: torch.Tensor, rows: int) -> torch.Tensor:
    """a [B, h, r, k] @ b [B, h, k, n] with a's rows padded to `rows`: -> [B, h, r, n]."""
    r = a.shape[-2]
    return torch.matmul(_pad_rows(a, rows), b)[..., :r, :]


def rms_norm(w: StaticWeights, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The family's RMSNorm, as Runtime.rms_norm: fp32 inside; Llama scales after the cast back."""
    eps = w.spec.rms_norm_eps
    if w.spec.norm == "gemma" or x.dtype == torch.float32:
        return F.rms_norm(x.float(), (x.shape[-1],), weight, eps).to(x.dtype)
    return weight.to(x.dtype) * F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)


def masks(w: StaticWeights, P: torch.Tensor, capacity: int) -> dict[int | None, torch.Tensor]:
    """Boolean [B, T, C] per window size: the row at position p sees key j iff j <= p (and
    j > p - window)."""
    keys = torch.arange(capacity, device=P.device)
    q = P[..., None]
    causal = keys <= q
    return {win: causal if win is None else causal & (keys > q - win) for win in set(w.spec.sliding_windows)}


def attention(w: StaticWeights, i: int, x: torch.Tensor, P: torch.Tensor, cache: StaticCache, mask: torch.Tensor) -> torch.Tensor:
    s, L = w.spec, w.layers[i]
    B, T, _ = x.shape
    nh, nkv, D, g = s.num_heads, s.num_kv_heads, s.head_dim, s.group_size
    qkv = mm(rms_norm(w, x, L["attn_norm"]), L["wqkv"], L.get("bqkv"))
    q, k, v = qkv.split([nh * D, nkv * D, nkv * D], dim=-1)
    q = q.reshape(B, T, nh, D).transpose(1, 2)  # [B, nh, T, D]
    k = k.reshape(B, T, nkv, D).transpose(1, 2)  # [B, nkv, T, D]
    if s.qk_norm:
        q, k = rms_norm(w, q, L["q_norm"]), rms_norm(w, k, L["k_norm"])
    cos, sin = w.rope[s.rope_kinds[i]]
    cos, sin = cos[P][:, None], sin[P][:, None]  # [B, 1, T, D]
    q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    C = cache.capacity
    idx = (torch.arange(B, device=P.device)[:, None] * C + P).reshape(-1)  # [B*T] rows of the flattened buffer
    cache.k[i].view(B * C, nkv, D).index_copy_(0, idx, k.transpose(1, 2).reshape(B * T, nkv, D))
    cache.v[i].view(B * C, nkv, D).index_copy_(0, idx, v.reshape(B * T, nkv, D))
    keys = cache.k[i].permute(0, 2, 3, 1)  # [B, nkv, D, C]
    values = cache.v[i].transpose(1, 2)  # [B, nkv, C, D]
    qg = q.reshape(B, nkv, g * T, D)  # the query heads sharing a kv head, stacked
    scores = bmm(qg, keys, g * ROWS)
    scores = (scores.float() * s.attn_scale).view(B, nkv, g, T, C).masked_fill(~mask[:, None, None], float("-inf"))
    probs = scores.softmax(-1).to(x.dtype).view(B, nkv, g * T, C)
    out = bmm(probs, values, g * ROWS)  # [B, nkv, g*T, D]
    out = out.reshape(B, nh, T, D).transpose(1, 2).reshape(B, T, nh * D)
    out = mm(out, L["wo"], L.get("bo"))
    return rms_norm(w, out, L["post_attn_norm"]) if s.sandwich_norms else out


def mlp(w: StaticWeights, i: int, x: torch.Tensor) -> torch.Tensor:
    s, L = w.spec, w.layers[i]
    gate, up = mm(rms_norm(w, x, L["mlp_norm"]), L["w_gate_up"], L.get("b_gate_up")).chunk(2, dim=-1)
    act = F.silu(gate) if s.activation == "silu" else F.gelu(gate, approximate="tanh" if s.activation == "gelu_tanh" else "none")
    out = mm(act * up, L["w_down"], L.get("b_down"))
    return rms_norm(w, out, L["post_mlp_norm"]) if s.sandwich_norms else out


def layers(w: StaticWeights, h: torch.Tensor, P: torch.Tensor, cache: StaticCache, start: int, end: int,
           skip_attn: frozenset[int] = frozenset(), skip_mlp: frozenset[int] = frozenset()) -> torch.Tensor:
    """h [B, T, H] at positions P [B, T] entering layer `start` -> h after layer end-1 (KV written at P)."""
    m = masks(w, P, cache.capacity)
    for i in range(start, end):
        if i not in skip_attn:
            h = h + attention(w, i, h, P, cache, m[w.spec.sliding_windows[i]])
        if i not in skip_mlp:
            h = h + mlp(w, i, h)
    return h


def embed(w: StaticWeights, ids: torch.Tensor) -> torch.Tensor:
    """ids [B, T] -> [B, T, H]."""
    h = w.embed[ids]
    return h if w.embed_scale is None else h * w.embed_scale


def logits(w: StaticWeights, h: torch.Tensor) -> torch.Tensor:
    """Final norm + LM head: h [B, T, H] -> fp32 [B, T, V] (soft-capped where the model caps)."""
    out = mm(rms_norm(w, h, w.final_norm), w.head).float()
    cap = w.spec.final_logit_softcap
    return torch.tanh(out / cap) * cap if cap else out
