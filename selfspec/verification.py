"""Accepting drafts: small pure functions named after the math.

Greedy: the longest prefix of the draft that equals the target's argmax, plus one target
token (the correction, or the bonus when everything was accepted).

Sampling (Leviathan et al. 2023; Chen et al. 2023): draft token x ~ q is accepted with
probability min(1, p(x)/q(x)); on the first rejection the replacement is drawn from
norm(max(p - q, 0)); if all k drafts pass, a bonus token is drawn from p_{k+1}. The output
is then distributed exactly as sampling from p alone.

Gumbel-max coupling (Daliri, Musco, Suresh 2024): with one noise g_t at each position (keyed
by seed, position and token: coupling.py), the target's token is argmax_t (log p_t +
g_t), exactly a draw from p, and the draft proposed argmax_t (log q_t + g_t) with the same noise.
A draft is accepted iff it is the target's token; the first mismatch is replaced by the
target's token (no residual draw), and the bonus is the target's token too. The output is then
autoregressive Gumbel-max sampling with that seed, token for token, whatever the draft: a
drafter changes only how many target tokens each step confirms. Acceptance per token is at
least (1 - TV)/(1 + TV) (TV: the total variation between p and q), near 1 - TV when they are
close; a copied (one-hot) draft x is accepted with probability p(x), as with rejection.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from selfspec.sampling import Dist, as_rows, residual_draw, uniforms


def greedy_accept(draft: list[int], targets: Sequence[int]) -> tuple[int, int]:
    """draft: k token ids; targets: the verifier's k+1 argmax tokens (Runtime.argmax). ->
    (number accepted, next token)."""
    n = 0
    while n < len(draft) and draft[n] == targets[n]:
        n += 1
    return n, targets[n]


def coupled_accept(draft: list[int], target_picks: Sequence[int]) -> tuple[int, int]:
    """Gumbel-max coupling: draft, k tokens each the argmax of the draft's log q + g; target_picks,
    the k+1 target tokens argmax of log p + g (coupling.GumbelPicks: made on first use). ->
    (number accepted, next token): the longest prefix where the draft is the target's token,
    then the target's token: greedy_accept's rule, over the target's Gumbel-max picks."""
    return greedy_accept(draft, target_picks)


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
