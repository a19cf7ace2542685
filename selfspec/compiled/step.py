"""One speculative step as tensor operations: draft K tokens, verify them in a bucket of W rows,
accept, commit. No host read inside (the host reads the returned [B, 1 + K + 1] once per step).

    state: pending [B] (the token whose KV is not in the cache yet), pos [B] (its position),
           active [B] (a finished sequence no longer advances), key [B, 2], temperature [B]
    draft: K passes of one row each (early exit: layers < E, the exit hidden states kept; layer
           skip: every layer, the skip set skipped), picks by argmax or Gumbel-max
    verify: the pending token and the K drafts, padded to W rows, through the full model
           (early exit: only the last draft through layers < E, then layers E.. over all rows)
    accept: n = the drafts before the first that differs from the target's pick at its row
           (greedy prefix, or Gumbel-max coupling: the same rule over picks); the new tokens
           are the target's picks of rows 0..n (a draft before n equals its row's pick)
    commit: pending = pick n, pos += n + 1 (active rows); rejected KV rows stay, unseen
           behind the mask until overwritten (cache.py's rollback, without a host value)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from selfspec.compiled import forward as fw
from selfspec.compiled.noise import picks
from selfspec.compiled.weights import StaticWeights

BUCKETS = (1, 2, 4, 8, 16)  # verify widths; K + 1 rounds up to one


def bucket(rows: int) -> int:
    """The smallest verify bucket holding `rows` rows."""
    for b in BUCKETS:
        if rows <= b:
            return b
    raise ValueError(f"a verify of {rows} rows is past the largest bucket ({BUCKETS[-1]})")


@dataclass(frozen=True)
class Plan:
    """What a step drafts with: strategy "autoregressive" | "early-exit" | "layer-skip"."""

    strategy: str
    k: int = 0  # drafts per step
    exit_layer: int = 0  # early exit: draft with layers 0..exit_layer-1
    skip_attn: frozenset[int] = frozenset()  # layer skip: sub-layers skipped while drafting
    skip_mlp: frozenset[int] = frozenset()

    @property
    def width(self) -> int:
        return bucket(self.k + 1)


@dataclass
class StepState:
    """A batch's device state between steps (fixed addresses: a captured graph reads them)."""

    cache: fw.StaticCache
    pending: torch.Tensor  # [B] int64
    pos: torch.Tensor  # [B] int64
    active: torch.Tensor  # [B] bool
    key: torch.Tensor  # [B, 2] int64: the noise key's words (sampling)
    temperature: torch.Tensor  # [B] fp32 (sampling)


def _draft(w: StaticWeights, plan: Plan, st: StepState, sampled: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """plan.k drafts [B] each, and the exit hidden states [B, 1, H] of their inputs (early exit)."""
    L = plan.exit_layer if plan.strategy == "early-exit" else w.num_layers
    token, drafts, exits = st.pending, [], []
    for j in range(plan.k):
        P = (st.pos + j)[:, None]  # [B, 1]
        h = fw.layers(w, fw.embed(w, token[:, None]), P, st.cache, 0, L, plan.skip_attn, plan.skip_mlp)
        exits.append(h)
        lg = fw.logits(w, h)
        token = picks(lg, P + 1, st.key if sampled else None, st.temperature)[:, 0]
        drafts.append(token)
    return drafts, exits


def _verify(w: StaticWeights, plan: Plan, st: StepState, drafts: list[torch.Tensor], exits: list[torch.Tensor]) -> torch.Tensor:
    """The full model's logits [B, W, V] for the pending token and the drafts (padded rows after)."""
    W, K = plan.width, plan.k
    B = st.pos.shape[0]
    P = st.pos[:, None] + torch.arange(W, device=st.pos.device)  # [B, W]
    if plan.strategy == "early-exit" and K:
        last = fw.layers(w, fw.embed(w, drafts[-1][:, None]), P[:, K : K + 1], st.cache, 0, plan.exit_layer)
        h = torch.cat(exits + [last], dim=1)  # [B, K+1, H]: the exit-query cache and the last draft
        h = torch.cat([h, h.new_zeros(B, W - K - 1, h.shape[-1])], dim=1)
        h = fw.layers(w, h, P, st.cache, plan.exit_layer, w.num_layers)
    else:
        ids = torch.stack([st.pending, *drafts], dim=1)  # [B, K+1]
        ids = torch.cat([ids, ids.new_zeros(B, W - K - 1)], dim=1)
        h = fw.layers(w, fw.embed(w, ids), P, st.cache, 0, w.num_layers)
    return fw.logits(w, h)


def run_step(w: StaticWeights, plan: Plan, sampled: bool, st: StepState) -> torch.Tensor:
    """One step over the batch (module doc) -> [B, 1 + K + 1] int64: n, then the picks of rows
    0..K (the new tokens are the first n + 1). Updates st's pending and pos in place."""
    K = plan.k
    drafts, exits = _draft(w, plan, st, sampled)
    lg = _verify(w, plan, st, drafts, exits)
    P = st.pos[:, None] + torch.arange(K + 1, device=st.pos.device)
    t = picks(lg[:, : K + 1], P + 1, st.key if sampled else None, st.temperature)  # [B, K+1]
    if K:
        same = torch.stack(drafts, dim=1) == t[:, :K]
        n = same.long().cumprod(dim=1).sum(dim=1)  # [B]: the accepted prefix
    else:
        n = torch.zeros_like(st.pos)
    st.pending.copy_(t.gather(1, n[:, None])[:, 0])
    st.pos.add_(torch.where(st.active, n + 1, torch.zeros_like(n)))
    return torch.cat([n[:, None], t], dim=1)
