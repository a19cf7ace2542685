"""Exit adapters (Kangaroo-style): a small trained block on top of an early layer.

The draft for the `exit-adapter` strategy is

    h_E   = layers 0..E-1 (the model's own, KV shared with verification)
    a     = h_E + out(attention(rope(q), rope(k), v))    with q|k|v = rms_norm(h_E) @ qkv
                                                          (only when heads > 0)
    h'    = a + down(silu(up(rms_norm(a) * norm)))       # this module, [T, H] -> [T, H]
    draft = final norm + LM head (optionally restricted to the draft vocabulary) on h'

The attention (causal, its own rotary table, its own small KV cache at inference: see
AdapterCache) lets the draft look back at earlier positions' layer-E states, which the
layers E..L-1 it stands in for do; the MLP alone sees one position. The model itself is
never changed, so verification by the full model keeps the output identical to the
original model's; the adapter only has to make drafts agree more often. `down` and `out`
start at zero: an untrained adapter is exactly plain early exit.

File format: one safetensors file with tensors `norm` [H], `up` [H, I], `down` [I, H], and
with attention `attn_norm` [H], `qkv` [H, 3*heads*head_dim], `out` [heads*head_dim, H]
(fp32, stored [in, out] like the runtime's weights) and metadata
{"format", "exit_layer", "hidden_size", "inner_size", "model_fingerprint", "draft_vocab",
"eps", "heads", "head_dim", "rope_theta"} (files without the last three have no attention).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file

from selfspec.errors import SelfSpecError
from selfspec.profiles import atomic_write_bytes
from selfspec.runtime import apply_rotary

FORMAT = "selfspec-exit-adapter/1"


@dataclass(frozen=True)
class AdapterMeta:
    exit_layer: int
    hidden_size: int
    inner_size: int
    model_fingerprint: str = ""
    draft_vocab: int | None = None  # the restricted draft vocabulary it was trained with
    eps: float = 1e-6
    heads: int = 0  # attention heads; 0 = the MLP alone
    head_dim: int = 64
    rope_theta: float = 10000.0


@dataclass
class AdapterWeights:
    """The matrices the block multiplies by: the parameters themselves (training), or bf16
    copies packed for selfspec.kernels.matmul (the CPU runtime's drafts)."""

    up: torch.Tensor
    down: torch.Tensor
    qkv: torch.Tensor | None = None
    out: torch.Tensor | None = None


class AdapterCache:
    """Keys and values of the adapter's attention, one row per position (fp32, [heads,
    capacity, head_dim]); position-indexed like the model's KVCache, so a rejected draft is
    simply overwritten by the next step's."""

    def __init__(self, meta: AdapterMeta, capacity: int, device):
        self.k = torch.empty(meta.heads, capacity, meta.head_dim, device=device)  # head-major: contiguous key runs
        self.v = torch.empty(meta.heads, capacity, meta.head_dim, device=device)
        self.cos, self.sin = rope_table(meta, 0, capacity, device)  # once per generation, not per draft


class ExitAdapter(torch.nn.Module):
    def __init__(self, meta: AdapterMeta):
        super().__init__()
        self.meta = meta
        H, I, A = meta.hidden_size, meta.inner_size, meta.heads * meta.head_dim
        self.norm = torch.nn.Parameter(torch.ones(H))
        self.up = torch.nn.Parameter(torch.randn(H, I) * H**-0.5)
        self.down = torch.nn.Parameter(torch.zeros(I, H))  # zero: starts as plain early exit
        if meta.heads:
            self.attn_norm = torch.nn.Parameter(torch.ones(H))
            self.qkv = torch.nn.Parameter(torch.randn(H, 3 * A) * H**-0.5)
            self.out = torch.nn.Parameter(torch.zeros(A, H))  # zero, for the same reason

    def weights(self) -> AdapterWeights:
        if self.meta.heads:
            return AdapterWeights(self.up, self.down, self.qkv, self.out)
        return AdapterWeights(self.up, self.down)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """h [T, H] (one sequence at positions 0..T-1) or [B, T, H] (B such sequences), any
        float dtype -> the same shape and dtype; the block computes in fp32."""
        return self.block(h, self.weights(), torch.matmul)

    def block(self, h: torch.Tensor, w: AdapterWeights, matmul, pos: int = 0, cache: AdapterCache | None = None) -> torch.Tensor:
        """The block with the weights and the matmul given. With a cache, h [T, H] holds
        positions pos..pos+T-1 of one sequence: their keys/values are written to the cache
        and they attend to every cached position up to their own."""
        x = h.float()
        if self.meta.heads:
            x = x + matmul(self._attention(F.rms_norm(x, (x.shape[-1],), self.attn_norm, self.meta.eps), w, matmul, pos, cache), w.out)
        y = F.rms_norm(x, (x.shape[-1],), self.norm, self.meta.eps)
        return (x + matmul(F.silu(matmul(y, w.up)), w.down)).to(h.dtype)

    def _attention(self, a: torch.Tensor, w: AdapterWeights, matmul, pos: int, cache: AdapterCache | None) -> torch.Tensor:
        """a [..., T, H] -> concatenated head outputs [..., T, heads*head_dim]. Without a cache:
        whole sequences from position 0. With one: positions pos..pos+T-1 of one sequence,
        whose keys/values are written to the cache before they attend to every cached key."""
        nh, d = self.meta.heads, self.meta.head_dim
        T = a.shape[-2]
        qkv = matmul(a, w.qkv).unflatten(-1, (3, nh, d)).movedim(-4, -2)  # [..., 3, nh, T, d]
        cos, sin = rope_table(self.meta, 0, T, a.device) if cache is None else (cache.cos[pos : pos + T], cache.sin[pos : pos + T])
        q, k = apply_rotary(qkv[..., :2, :, :, :], cos, sin).unbind(-4)  # each [..., nh, T, d]
        v = qkv[..., 2, :, :, :]
        if cache is not None:
            cache.k[:, pos : pos + T], cache.v[:, pos : pos + T] = k, v
            k, v = cache.k[:, : pos + T], cache.v[:, : pos + T]
        # explicit ops rather than scaled_dot_product_attention: at one query per draft its
        # set-up costs more than the arithmetic
        scores = torch.matmul(q, k.transpose(-1, -2)) * d**-0.5  # [..., nh, T, pos+T]
        if T > 1:  # causal; a single query sees every cached key anyway
            keys = torch.arange(pos + T, device=a.device)
            scores = scores.masked_fill(keys[None, :] > (pos + torch.arange(T, device=a.device))[:, None], float("-inf"))
        return torch.matmul(scores.softmax(-1), v).transpose(-3, -2).flatten(-2)


def rope_table(meta: AdapterMeta, start: int, stop: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of the adapter's rotary angles for positions start..stop-1: each [T, head_dim]."""
    d = meta.head_dim
    inv = meta.rope_theta ** (-torch.arange(0, d, 2, device=device, dtype=torch.float32) / d)  # [d/2]
    ang = torch.arange(start, stop, device=device, dtype=torch.float32)[:, None] * inv  # [T, d/2]
    ang = torch.cat([ang, ang], -1)
    return ang.cos(), ang.sin()


def save_adapter(adapter: ExitAdapter, path: str | os.PathLike) -> None:
    """Atomic: a temporary file beside `path`, then rename."""
    tensors = {k: v.detach().float().cpu().contiguous() for k, v in adapter.state_dict().items()}
    meta = {"format": FORMAT, **{k: json.dumps(v) for k, v in asdict(adapter.meta).items()}}
    tmp = Path(path).with_name(f".{Path(path).name}.build")
    save_file(tensors, str(tmp), metadata=meta)
    try:
        atomic_write_bytes(path, tmp.read_bytes())
    finally:
        tmp.unlink(missing_ok=True)


def load_adapter(path: str | os.PathLike, device="cpu") -> ExitAdapter:
    try:
        with safe_open(str(path), "pt", device=str(device)) as f:
            raw = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except FileNotFoundError as e:
        raise SelfSpecError(f"exit adapter not found: {path}") from e
    except Exception as e:
        raise SelfSpecError(f"cannot read exit adapter {path}: {e}") from e
    if raw.get("format") != FORMAT:
        raise SelfSpecError(f"{path} is not a selfspec exit adapter (expected format {FORMAT})")
    try:
        meta = AdapterMeta(**{k: json.loads(v) for k, v in raw.items() if k != "format"})
        adapter = ExitAdapter(meta)
        adapter.load_state_dict(tensors)
    except (TypeError, RuntimeError, ValueError) as e:
        raise SelfSpecError(f"bad exit adapter {path}: {e}") from e
    return adapter.to(device).eval().requires_grad_(False)


def draft_logits(runtime, h: torch.Tensor, head_columns: torch.Tensor) -> torch.Tensor:
    """Differentiable twin of Runtime.logits for training: final norm + head [H, N] in
    plain torch ops (the runtime's fast path is not autograd-aware). -> fp32 [T, N]."""
    x = runtime.rms_norm(h.float(), runtime.final_norm.float())
    out = x @ head_columns.float()
    cap = runtime.spec.final_logit_softcap
    return torch.tanh(out / cap) * cap if cap else out


def prepared_weights(adapter: "ExitAdapter", runtime) -> AdapterWeights:
    """The adapter's matrices as `runtime` multiplies them: on the kernel path, copies in the
    runtime's dtype laid out for kernels.matmul (a small share of a draft token where
    fp32 torch ops cost most of one; only the drafts change, never the verified output), else the parameters."""
    w = adapter.weights()
    if not runtime.uses_kernels:
        return w
    return AdapterWeights(**{k: None if t is None else runtime.prepare_weight(t.detach().to(runtime.dtype).contiguous())
                             for k, t in vars(w).items()})
