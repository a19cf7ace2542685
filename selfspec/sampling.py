"""Turning logits into a distribution and drawing from it.

Draft and target pass through the *same* transform, which is what makes speculative
sampling preserve the target distribution. Randomness always comes from an explicit
torch.Generator.
"""

from __future__ import annotations

import torch

from selfspec.config import SamplingConfig


def probs_from_logits(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """logits [..., V] (fp32) -> probabilities [..., V] after temperature, top-k and top-p."""
    x = logits / cfg.temperature
    if cfg.top_k is not None and cfg.top_k < x.shape[-1]:
        kth = torch.topk(x, cfg.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if cfg.top_p is not None and cfg.top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        cum = sorted_x.softmax(-1).cumsum(-1)
        # Drop a token when the tokens ranked above it already reach top_p; top-1 always stays.
        drop_sorted = (cum - sorted_x.softmax(-1)) >= cfg.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return x.softmax(-1)


def sample(probs: torch.Tensor, rng: torch.Generator) -> int:
    """One draw from probs [V]."""
    return int(torch.multinomial(probs, 1, generator=rng))


def make_rng(seed: int | None, device="cpu") -> torch.Generator:
    g = torch.Generator(device=device)
    if seed is None:
        g.seed()
    else:
        g.manual_seed(seed)
    return g
