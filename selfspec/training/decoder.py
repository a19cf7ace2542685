"""Run a transformers causal LM's decoder layers ourselves, for training: layer dropout per
sample, hidden states of any layers, and the model's own final norm + LM head on them.

We call the model's modules directly (`model.model.embed_tokens`, `model.model.layers[i]`,
`model.model.rotary_emb`, `model.model.norm`, `model.lm_head`) with the arguments the
model's own forward would pass; nothing in transformers is patched. What differs between
architectures (per-layer sliding windows, per-layer-type rotary tables, final logit
soft-capping) comes from selfspec's ModelSpec, the same description the runtime uses.

Shapes: ids [B, T] -> hidden states [B, T, H] -> logits [B, T, V] (or [B, T, N] over a
vocabulary subset). Every sequence starts at position 0 (packed training sequences).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from selfspec.architectures import ModelSpec


class Decoder:
    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.spec = ModelSpec.from_hf_config(model.config)
        self.base = model.model
        self.layers = list(self.base.layers)
        self.num_layers = len(self.layers)
        self.eager = getattr(model.config, "_attn_implementation", "eager") == "eager"
        self.softcap = self.spec.final_logit_softcap

    # ---- the pieces of a forward pass ----------------------------------------------------

    def _position_embeddings(self, h: torch.Tensor, T: int) -> tuple[torch.Tensor, dict]:
        pos = torch.arange(T, device=h.device)[None]  # [1, T]: broadcast over the batch
        rope = self.base.rotary_emb
        tables = {kind: (rope(h, pos) if kind == "default" else rope(h, pos, kind)) for kind in set(self.spec.rope_kinds)}
        return pos, tables

    def _masks(self, T: int, device, dtype) -> dict[int | None, torch.Tensor | None]:
        """Per sliding window: None (plain causal: sdpa's fused causal path) or a [1, 1, T, T]
        mask, boolean for sdpa, additive for eager attention."""
        q = torch.arange(T, device=device)[:, None]
        k = torch.arange(T, device=device)[None, :]
        out: dict[int | None, torch.Tensor | None] = {}
        for w in set(self.spec.sliding_windows):
            allowed = k <= q
            if w is not None:
                allowed &= k > q - w
            if not self.eager and (w is None or w >= T):
                out[w] = None
            elif self.eager:
                out[w] = torch.zeros(T, T, device=device, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)[None, None]
            else:
                out[w] = allowed[None, None]
        return out

    def hidden_states(self, ids: torch.Tensor, keep: torch.Tensor | None = None, collect: set[int] | None = None) -> dict[int, torch.Tensor]:
        """Outputs of the layers in `collect` (default: every layer) for ids [B, T].

        keep [B, L] bool: sample b runs layer l only where keep[b, l]; a dropped layer is
        skipped entirely for that sample (its residual stream passes through unchanged), and
        only the kept rows are computed."""
        B, T = ids.shape
        collect = set(range(self.num_layers)) if collect is None else collect
        h = self.base.embed_tokens(ids)
        pos, tables = self._position_embeddings(h, T)
        masks = self._masks(T, h.device, h.dtype)
        out: dict[int, torch.Tensor] = {}
        last = max(collect) if collect else -1
        for i, layer in enumerate(self.layers[: last + 1]):
            kw = dict(attention_mask=masks[self.spec.sliding_windows[i]], position_embeddings=tables[self.spec.rope_kinds[i]], position_ids=pos)
            if keep is None or bool(keep[:, i].all()):
                h = layer(h, **kw)
            else:
                rows = keep[:, i].nonzero().squeeze(1)
                if rows.numel():
                    h = h.index_copy(0, rows, layer(h.index_select(0, rows), **kw).to(h.dtype))
            if i in collect:
                out[i] = h
        return out

    def logits(self, h: torch.Tensor, vocab: torch.Tensor | None = None) -> torch.Tensor:
        """The model's own final norm + LM head on any layer's output -> fp32 logits
        [..., V], or [..., N] over the ids in `vocab` (rows of the head)."""
        x = self.base.norm(h)
        head = self.model.lm_head
        if vocab is None:
            out = head(x)
        else:
            out = F.linear(x, head.weight.index_select(0, vocab), None if head.bias is None else head.bias.index_select(0, vocab))
        out = out.float()
        if self.softcap:
            out = torch.tanh(out / self.softcap) * self.softcap
        return out
