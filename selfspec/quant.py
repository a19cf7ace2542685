"""Low-bit copies of the model's own weights, for drafting (verification never uses them).

    int8: w[k, n] = s[n] * q[k, n],                  q in -127..127, one scale per output column
    int4: w[k, n] = s[g, n] * (u[k, n] - z[g, n]),   u in 0..15, g = k // group (rows), z a real zero point
          (s and z stored in fp16: 4 bytes per group and column, on top of 0.5 per weight)

Both quantizers pick, per column (int8) or per (group, column) (int4), the clipping range from a
grid that minimises the squared error of the dequantised weights (MSE clipping); plain absmax /
min-max is the grid's first point, so the search can only do better. The result is a
kernels.QuantizedWeight, multiplied without being dequantised in memory (csrc/quant.c).
"""

from __future__ import annotations

import torch

from selfspec.kernels import QuantizedWeight, quant_errors

TILE = 64  # columns per tile (csrc/quant.c)
INT4_GROUP = 64  # rows per int4 group: 0.5625 bytes a weight (0.28x bf16); group 32 agrees no better on the default model
INT8_CLIPS = tuple(1.0 - 0.025 * i for i in range(13))  # absmax x 1.0 .. 0.7
INT4_CLIPS = tuple(1.0 - 0.05 * i for i in range(10))  # range x 1.0 .. 0.55


def _tiles(q: torch.Tensor) -> torch.Tensor:
    """[K, N] -> [ceil(N/64), K, 64] (zero padded): each tile of columns one contiguous stream."""
    k, n = q.shape
    nb = (n + TILE - 1) // TILE
    padded = q.new_zeros(k, nb * TILE)
    padded[:, :n] = q
    return padded.view(k, nb, TILE).permute(1, 0, 2).contiguous()


def _errors(w: torch.Tensor, group: int, s: torch.Tensor, z: torch.Tensor | None, lo: float, hi: float) -> torch.Tensor:
    """err [C, G, N]: the squared error of quantizing w [K, N] (fp32) with each candidate
    (s, z) [C, G, N] in groups of `group` rows: one fused pass in C where the kernels run,
    else torch (7 passes over w per candidate)."""
    err = quant_errors(w, group, s, z, lo, hi)
    if err is not None:
        return err
    k, n = w.shape
    ng = s.shape[1]
    wg = torch.cat([w, w.new_full((ng * group - k, n), float("nan"))]).view(ng, group, n)  # NaN rows: padding, dropped below
    out = []
    for c in range(s.shape[0]):
        sc, zc = s[c][:, None], (0.0 if z is None else z[c][:, None])
        u = torch.round(wg / sc + zc).clamp(lo, hi)
        out.append(((u - zc) * sc - wg).square().nan_to_num(0.0).sum(1))
    return torch.stack(out)


def quantize_int8(w: torch.Tensor, clips: tuple[float, ...] = INT8_CLIPS) -> QuantizedWeight:
    """w [K, N] (any float dtype) -> int8 with one scale per column, clipping by MSE."""
    w = w.detach().float()
    k, n = w.shape
    amax = w.abs().amax(0).clamp_min(1e-12)  # [N]
    cand = torch.stack([amax * c / 127 for c in clips])[:, None]  # [C, 1, N]
    best = _errors(w, k, cand, None, -127, 127)[:, 0].argmin(0)  # [N]; ties: the first (widest) candidate
    s = cand[:, 0].gather(0, best[None])[0]
    q = torch.round(w / s).clamp(-127, 127).to(torch.int8)
    return QuantizedWeight(_tiles(q), s, None, k, n, bits=8)


def quantize_int4(w: torch.Tensor, group: int = INT4_GROUP, clips: tuple[float, ...] = INT4_CLIPS) -> QuantizedWeight:
    """w [K, N] -> int4 in groups of `group` rows with a real zero point per (group, column);
    the [min, max] range is shrunk around its centre by the grid factor that minimises the MSE."""
    w = w.detach().float()
    k, n = w.shape
    ng = (k + group - 1) // group
    wg = torch.cat([w, w[-1:].expand(ng * group - k, n)]) if ng * group > k else w  # pad with a copy of the last row
    wg = wg.view(ng, group, n)
    lo, hi = wg.amin(1), wg.amax(1)  # [G, N]
    mid, half = (hi + lo) / 2, ((hi - lo) / 2).clamp_min(1e-12)
    # s and z are stored as fp16 (normal range): candidates are quantized with the stored values
    s = torch.stack([((2 * half * c) / 15).clamp_min(2**-14).half().float() for c in clips])  # [C, G, N]
    z = torch.stack([(-(mid - half * c) / sc).half().float() for c, sc in zip(clips, s)])
    best = _errors(w, group, s, z, 0, 15).argmin(0)[None]  # [1, G, N]
    best_s, best_z = s.gather(0, best)[0], z.gather(0, best)[0]
    u = torch.round(wg / best_s[:, None] + best_z[:, None]).clamp(0, 15).view(ng * group, n)[:k].to(torch.uint8)
    t = _tiles(u)  # [NB, K, 64]
    packed = (t[..., :32] | (t[..., 32:] << 4)).contiguous()  # column c (low nibble) and c + 32 (high) share a byte
    return QuantizedWeight(packed, best_s, best_z, k, n, bits=4, group=group)


def quantize(w: torch.Tensor, bits: int, group: int = INT4_GROUP) -> QuantizedWeight:
    if bits == 8:
        return quantize_int8(w)
    if bits == 4:
        return quantize_int4(w, group)
    raise ValueError(f"bits must be 4 or 8, got {bits}")
