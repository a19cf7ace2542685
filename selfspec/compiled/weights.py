"""The compiled backend's weights: plain torch tensors read from a Runtime (never modified).

The CPU runtime keeps its matrices packed for its C kernels (kernels.PackedWeight); the compiled
step is pure torch, so it takes plain [in, out] copies of them where they are packed and the
runtime's own tensors where they are not (the torch path's layout is already [in, out]).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from selfspec.architectures import ModelSpec, rotary_tables
from selfspec.runtime import Runtime

# keys of a runtime layer that are matrices (the rest: norms and biases, plain tensors already)
_MATRICES = ("wqkv", "wo", "w_gate_up", "w_down")


@dataclass
class StaticWeights:
    spec: ModelSpec
    layers: list[dict[str, torch.Tensor]]
    final_norm: torch.Tensor  # [H] fp32
    head: torch.Tensor  # [H, V]
    embed: torch.Tensor  # [V, H] (a tied model: the head transposed, one copy)
    embed_scale: float | None
    rope: dict[str, tuple[torch.Tensor, torch.Tensor]]  # kind -> cos, sin [capacity, D] in the compute dtype
    dtype: torch.dtype
    device: torch.device

    @property
    def num_layers(self) -> int:
        return self.spec.num_layers


def static_weights(rt: Runtime, length: int, device: torch.device | str | None = None) -> StaticWeights:
    """rt's weights as plain tensors on `device` (default: rt's), rotary tables for `length` positions."""
    dev = torch.device(device or rt.device)
    layers = []
    for i, layer in enumerate(rt.layers):
        layers.append({k: (rt.weight(i, k) if k in _MATRICES else v).to(dev) for k, v in layer.items()})
    head = rt.head_weight().to(dev)
    embed = rt.embed_weight.to(dev) if rt.embed_weight is not None else head.t().contiguous()
    return StaticWeights(rt.spec, layers, rt.final_norm.to(dev), head, embed, rt._embed_scale, rope_tables(rt, length, dev),
                         rt.dtype, dev)


def rope_tables(rt: Runtime, length: int, device: torch.device) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """cos, sin [length, D] per rotary kind, cast to the activation dtype once (as the runtime's torch path)."""
    tables = rotary_tables(rt.hf_config, rt.spec, length)
    return {k: (c.to(device, rt.dtype).contiguous(), s.to(device, rt.dtype).contiguous()) for k, (c, s) in tables.items()}
