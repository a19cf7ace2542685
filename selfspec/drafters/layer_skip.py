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

    def depth_signature(self) -> tuple:
        """What it drafts with (batch/passes.signature): the draft runtime to the exit, the
        draft head, the skipped sub-layers."""
        return (self.draft_rt, self.exit, self.draft_head, self.skip_attn, self.skip_mlp)

    def draft(self, step: Step) -> Draft:
        return self.draft_guessed(step)

    def draft_guessed(self, step: Step, guess=None) -> Draft:
        """Exactly draft(step)'s tokens, computed faster where `guess(drafted so far)` foretells
        them (e.g. a prompt-lookup copy; None or [] : plain token-by-token drafting). A pass
        over [last token, guess...] gives the draft's own choice after every guessed prefix
        (rows are computed as alone: the kernels are row-invariant, and the rng is drawn from
        in the same order); its rows are used while the guess agrees with those choices, and
        the next pass starts at the first disagreement. A right guess of m tokens costs one
        (m+1)-row pass instead of m+1 one-row passes. Rows written past a disagreement hold the
        guess's keys and values; the next pass (or verification) overwrites them: the cache is
        indexed by position."""
        rt, d = self.draft_rt, Draft()
        # one C call a pass (Runtime.step_token): the argmaxes where they are all a token needs,
        # else the logits; None where the fused blocks do not run (the primitives from then on)
        argmaxes = step.sampling.greedy and self.threshold is None and not step.drafts_processed
        fused = True
        while len(d.tokens) < step.k:
            j = len(d.tokens)
            g = guess(d.tokens)[: step.k - j - 1] if guess is not None else []
            ids = [(d.tokens or step.tokens)[-1], *g]
            rows = rt.step_token(ids, step.pos + j, step.cache, self.exit, self.draft_head, self.skip_attn,
                                 self.skip_mlp, logits=not argmaxes) if fused else None
            if rows is None:
                fused = False
                h = rt.embed(torch.tensor(ids, device=rt.device))
                h = rt.run_layers(h, 0, self.exit, step.pos + j, step.cache, self.skip_attn, self.skip_mlp)
                rows = rt.logits(h, head=self.draft_head)
            picked = fused and argmaxes  # row i: the draft's choice (or its logits) after ids[: i + 1]
            for i in range(len(ids)):
                if not (self._take(rows[i], d) if picked else self._choose(rows[i], step, d)):
                    return d
                if i == len(g) or d.tokens[-1] != g[i]:  # the next row's input is not the draft's token
                    break
        return d
