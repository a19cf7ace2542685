"""Accepting drafts: small pure functions named after the math.

Greedy: the longest prefix of the draft that equals the target's argmax, plus one target
token (the correction, or the bonus when everything was accepted).

Sampling (Leviathan et al. 2023; Chen et al. 2023): draft token x ~ q is accepted with
probability min(1, p(x)/q(x)); on the first rejection the replacement is drawn from
norm(max(p - q, 0)); if all k drafts pass, a bonus token is drawn from p_{k+1}. The output
is then distributed exactly as sampling from p alone.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from selfspec.sampling import Dist, as_rows, residual_draw, uniforms


def greedy_accept(draft: list[int], targets: list[int]) -> tuple[int, int]:
    """draft: k token ids; targets: the verifier's k+1 argmax tokens (Runtime.argmax). ->
    (number accepted, next token)."""
    n = 0
    while n < len(draft) and draft[n] == targets[n]:
        n += 1
    return n, targets[n]


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(p - q, 0)) of probability vectors; p itself if p <= q everywhere (then
    rejection has probability 0). The dense form of sampling.residual_draw."""
    r = (p - q).clamp_min(0.0)
    total = r.sum()
    return r / total if total > 0 else p


def speculative_accept(
    draft: list[int], draft_dists: Sequence[Dist] | torch.Tensor, target_dists: Sequence[Dist] | torch.Tensor,
    rng: torch.Generator,
) -> tuple[int, int]:
    """draft_dists: k rows q (the distribution each draft token was drawn from), target_dists:
    k+1 rows p; Dists, or probability tensors [k, V] / [k+1, V]. -> (number accepted, next
    token). Target rows past the first rejection are never looked at (a lazy sampling.Rows
    never builds them)."""
    q, p = as_rows(draft_dists), as_rows(target_dists)
    u = uniforms(rng, len(draft)) if draft else []
    for i, x in enumerate(draft):
        # accept iff u < p/q, written without a division: u * q < p
        if not u[i] * q[i].prob(x) < p[i].prob(x):
            return i, residual_draw(p[i], q[i], rng)
    return len(draft), p[len(draft)].draw(rng)
