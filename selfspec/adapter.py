"""Exit adapters (Kangaroo-style): a small trained block on top of an early layer.

The draft for the `exit-adapter` strategy is

    h_E   = layers 0..E-1 (the model's own, KV shared with verification)
    h'    = h_E + down(act(up(rms_norm(h_E) * norm)))         # this module, [T, H] -> [T, H]
    draft = final norm + LM head (optionally restricted to the draft vocabulary) on h'

The model itself is never changed, so verification by the full model keeps the output
identical to the original model's; the adapter only has to make drafts agree more often.
`down` starts at zero: an untrained adapter is exactly plain early exit.

File format: one safetensors file with tensors `norm` [H], `up` [H, I], `down` [I, H]
(fp32, stored [in, out] like the runtime's weights) and metadata
{"format", "exit_layer", "hidden_size", "inner_size", "model_fingerprint", "draft_vocab"}.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from selfspec.errors import SelfSpecError

FORMAT = "selfspec-exit-adapter/1"


@dataclass(frozen=True)
class AdapterMeta:
    exit_layer: int
    hidden_size: int
    inner_size: int
    model_fingerprint: str = ""
    draft_vocab: int | None = None  # the restricted draft vocabulary it was trained with
    eps: float = 1e-6


class ExitAdapter(torch.nn.Module):
    def __init__(self, meta: AdapterMeta):
        super().__init__()
        self.meta = meta
        H, I = meta.hidden_size, meta.inner_size
        self.norm = torch.nn.Parameter(torch.ones(H))
        self.up = torch.nn.Parameter(torch.randn(H, I) * H**-0.5)
        self.down = torch.nn.Parameter(torch.zeros(I, H))  # zero: starts as plain early exit

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """h [T, H] (any float dtype) -> [T, H] in h's dtype; the block computes in fp32."""
        return self.block(h, self.up, self.down, torch.matmul)

    def block(self, h: torch.Tensor, up, down, matmul) -> torch.Tensor:
        """The block with its two matrices and the matmul given, e.g. bf16 copies of up/down
        packed for selfspec.kernels.matmul on the CPU runtime (only drafts depend on it)."""
        x = F.rms_norm(h.float(), (h.shape[-1],), self.norm, self.meta.eps)
        return (h.float() + matmul(F.silu(matmul(x, up)), down)).to(h.dtype)


def save_adapter(adapter: ExitAdapter, path: str | os.PathLike) -> None:
    """Atomic: a temporary file beside `path`, then rename."""
    from safetensors.torch import save_file

    from selfspec.profiles import atomic_write_bytes

    tensors = {k: v.detach().float().cpu().contiguous() for k, v in adapter.state_dict().items()}
    meta = {"format": FORMAT, **{k: json.dumps(v) for k, v in asdict(adapter.meta).items()}}
    tmp = Path(path).with_name(f".{Path(path).name}.build")
    save_file(tensors, str(tmp), metadata=meta)
    try:
        atomic_write_bytes(path, tmp.read_bytes())
    finally:
        tmp.unlink(missing_ok=True)


def load_adapter(path: str | os.PathLike, device="cpu") -> ExitAdapter:
    from safetensors import safe_open

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
    x = runtime._norm(h.float(), runtime.final_norm.float())
    out = x @ head_columns.float()
    cap = runtime.spec.final_logit_softcap
    return torch.tanh(out / cap) * cap if cap else out
