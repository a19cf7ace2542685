"""Accepting drafts: small pure functions named after the math.

Greedy: the longest prefix of the draft that equals the target's argmax, plus one target
token (the correction, or the bonus when everything was accepted).

Sampling (Leviathan et al. 2023; Chen et al. 2023): draft token x ~ q is accepted with
probability min(1, p(x)/q(x)); on the first rejection the replacement is drawn from
norm(max(p - q, 0)); if all k drafts pass, a bonus token is drawn from p_{k+1}. The output
is then distributed exactly as sampling from p alone.
"""

from __future__ import annotations

import torch

from selfspec.sampling import sample


def greedy_accept(draft: list[int], target_logits: torch.Tensor) -> tuple[int, int]:
    """draft: k token ids; target_logits [k+1, V]. -> (number accepted, next token)."""
    targets = target_logits.argmax(-1).tolist()
    n = 0
    while n < len(draft) and draft[n] == targets[n]:
        n += 1
    return n, targets[n]


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(p - q, 0)); falls back to p if p <= q everywhere (then rejection has prob 0)."""
    r = (p - q).clamp_min(0.0)
    total = r.sum()
    return r / total if total > 0 else p


def speculative_accept(
    draft: list[int], draft_probs: torch.Tensor, target_probs: torch.Tensor, rng: torch.Generator
) -> tuple[int, int]:
    """draft_probs [k, V] (q, the distribution each draft token was drawn from),
    target_probs [k+1, V] (p). -> (number accepted, next token)."""
    if draft:
        dev = target_probs.device
        idx = torch.arange(len(draft), device=dev)
        tok = torch.tensor(draft, device=dev)
        p_x = target_probs[idx, tok]
        q_x = draft_probs[idx, tok]
        u = torch.rand(len(draft), generator=rng, device=dev)
        # accept iff u < p/q, written without a division: u * q < p
        ok = (u * q_x < p_x).tolist()
    else:
        ok = []
    for i, accepted in enumerate(ok):
        if not accepted:
            return i, sample(residual_distribution(target_probs[i], draft_probs[i]), rng)
    return len(draft), sample(target_probs[len(draft)], rng)
