"""Gumbel noise and picks with the key and positions as tensors (coupling.py's noise, the same
bits: Philox4x32-10 of (t / 4, pos lo, pos hi, NOISE_DOMAIN) under the key's two words), so that
one compiled step serves every seed and position without a recompile or a host read."""

from __future__ import annotations

import torch

from selfspec.coupling import NOISE_DOMAIN, _log32, philox4x32

_M32 = 0xFFFFFFFF


def key_words(key: int) -> tuple[int, int]:
    """A 64-bit noise key as its (lo, hi) 32-bit words."""
    return key & _M32, (key >> 32) & _M32


def noise(key: torch.Tensor, pos: torch.Tensor, vocab: int) -> torch.Tensor:
    """g(key, pos, t) for every token t < vocab: key [B, 2] int64 words, pos [B, T] int64 ->
    fp32 [B, T, vocab] (coupling.gumbel_noise_torch, broadcast)."""
    t = torch.arange(vocab, device=pos.device)
    p = pos[..., None]
    zero = torch.zeros_like(p)
    k0, k1 = key[:, 0, None, None], key[:, 1, None, None]
    out = philox4x32([t >> 2, p & _M32, (p >> 32) & _M32, zero + NOISE_DOMAIN], (k0, k1))
    word = t & 3
    b = torch.where(word == 0, out[0], torch.where(word == 1, out[1], torch.where(word == 2, out[2], out[3])))
    f32 = lambda v: torch.tensor(v, dtype=torch.float32, device=pos.device)  # noqa: E731
    w = (b >> 8).float() * f32(2.0**-24) + ((b & 0xFF).float() + f32(0.5)) * f32(2.0**-32)
    top = f32(1.0 - 2.0**-24)
    w = torch.where(w < top, w, top)
    s = f32(0.125)
    for c in (1 / 7, 1 / 6, 0.2, 0.25, 1 / 3, 0.5, 1.0):
        s = s * w + f32(c)
    e = torch.where(w < f32(0.0625), s * w, -_log32(f32(1.0) - w))
    return -_log32(e)


def picks(logits: torch.Tensor, pos: torch.Tensor, key: torch.Tensor | None, temperature: torch.Tensor | None) -> torch.Tensor:
    """The token each row of logits [B, T, V] (fp32) gives at positions pos [B, T]: its argmax
    (greedy: key None), else the Gumbel-max pick argmax(logits / T + g(key, pos)) (first index
    on ties, as csrc/gumbel.c)."""
    if key is None:
        return logits.argmax(-1)
    score = logits / temperature[:, None, None] + noise(key, pos, logits.shape[-1])
    return score.argmax(-1)
