"""Drafting with a cheaper version of the model whose KV is not the verifier's: some
sub-layers skipped (Draft & Verify), and/or a low-bit copy of its weights (quantized.py).
The draft attends to the verifier's exact keys/values for every committed position and writes
its own rows only for the positions it drafts; verification recomputes every layer for the
pending token and all drafts in one pass, overwriting those rows."""

from __future__ import annotations

import torch

from selfspec.drafters.base import Draft, Step
from selfspec.drafters.tokenwise import TokenDrafter


class LayerSkipDrafter(TokenDrafter):
    """Draft with `draft_rt` (the model itself, or a quantized copy sharing its cache layout)
    over layers 0..exit-1, skipping cfg.skip_attn / cfg.skip_mlp sub-layers (their residual
    passes through), then the draft head."""

    name = "layer-skip"

    def __init__(self, runtime, cfg, eos_ids=(), draft_rt=None):
        super().__init__(runtime, cfg, eos_ids)
        self.draft_rt = draft_rt if draft_rt is not None else runtime
        self.exit = cfg.exit_layer or runtime.num_layers
        self.skip_attn, self.skip_mlp = frozenset(cfg.skip_attn), frozenset(cfg.skip_mlp)

    def draft(self, step: Step) -> Draft:
        d = Draft()
        rt, token = self.draft_rt, step.tokens[-1]
        for j in range(step.k):
            h = rt.embed(torch.tensor([token], device=rt.device))
            h = rt.run_layers(h, 0, self.exit, step.pos + j, step.cache, self.skip_attn, self.skip_mlp)
            if not self._choose(rt.logits(h, head=self.draft_head)[0], step, d):
                break
            token = d.tokens[-1]
        return d
