"""Low-bit copies of the model's own weights, for drafting (verification never uses them).

    int8: w[k, n] = s[n] * q[k, n],                  q in -127..127, one scale per output column
    int4: w[k, n] = s[g, n] * (u[k, n] - z[g, n]),   u in 0..15, g = k // group (rows), z a real zero point
          (s and z stored in fp16: 4 bytes per group and column, on top of 0.5 per weight)

Both quantizers pick, per column (int8) or per (group, column) (int4), the clipping range from a
grid that minimises the squared error of the dequantised weights (MSE clipping); plain absmax /
min-max is the grid's first point, so the search can only do better. The result is a
kernels.QuantizedWeight, multiplied without being dequantised in memory (csrc/quant.c: the
activations are quantized to int8 per row in blocks of 32 k and the products summed with integer
dot products, VNNI vpdpbusd).

Layouts (csrc/quant.c), 64-column tiles, NB = ceil(N / 64):
    int8: u = q + 128 as [NB, ceil(K/4), 64, 4] uint8: 4 consecutive k of a column side by side
    int4: [NB, ceil(K/8), 64, 4] bytes: byte i of column c in k-row j holds u[8j + i] (low nibble)
          and u[8j + 4 + i] (high nibble)
"""

from __future__ import annotations

import torch

from selfspec.kernels import QuantizedWeight, quant_errors

TILE = 64  # columns per tile (csrc/quant.c)
INT4_GROUP = 64  # rows per int4 group, the kernel's QG (csrc/quant.c): 0.5625 bytes a weight (0.28x bf16)
INT8_CLIPS = tuple(1.0 - 0.025 * i for i in range(13))  # absmax x 1.0 .. 0.7
INT4_CLIPS = tuple(1.0 - 0.05 * i for i in range(10))  # range x 1.0 .. 0.55


def _pack8(q: torch.Tensor) -> torch.Tensor:
    """int8 q [K, N] -> u = q + 128 as [ceil(N/64), ceil(K/4), 64, 4] uint8 (padding 128: q = 0):
    each tile of columns one contiguous stream, 4 consecutive k of a column side by side (one
    int32 lane of vpdpbusd)."""
    k, n = q.shape
    nb, k4 = (n + TILE - 1) // TILE, (k + 3) // 4
    padded = torch.full((k4 * 4, nb * TILE), 128, dtype=torch.uint8)
    padded[:k, :n] = (q.to(torch.int16) + 128).to(torch.uint8)
    return padded.view(k4, 4, nb, TILE).permute(2, 0, 3, 1).contiguous()


def _pack4(u: torch.Tensor) -> torch.Tensor:
    """u [K, N] in 0..15 -> [ceil(N/64), ceil(K/8), 64, 4] bytes (padding 0): byte i of column c
    in k-row j holds u[8j + i, c] (low nibble) and u[8j + 4 + i, c] (high nibble)."""
    k, n = u.shape
    nb, k8 = (n + TILE - 1) // TILE, (k + 7) // 8
    padded = torch.zeros(k8 * 8, nb * TILE, dtype=torch.uint8)
    padded[:k, :n] = u
    p = padded.view(k8, 2, 4, nb, TILE)
    return (p[:, 0] | (p[:, 1] << 4)).permute(2, 0, 3, 1).contiguous()


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
    return QuantizedWeight(_pack8(q), s, None, k, n, bits=8)


def quantize_int4(w: torch.Tensor, group: int = INT4_GROUP, clips: tuple[float, ...] = INT4_CLIPS) -> QuantizedWeight:
    """w [K, N] -> int4 in groups of `group` rows with a real zero point per (group, column);
    the [min, max] range is shrunk around its centre by the grid factor that minimises the MSE.
    The kernel needs group == INT4_GROUP (its activation block); others only dequantize()."""
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
    return QuantizedWeight(_pack4(u), best_s, best_z, k, n, bits=4, group=group)


def quantize(w: torch.Tensor, bits: int, group: int = INT4_GROUP) -> QuantizedWeight:
    if bits == 8:
        return quantize_int8(w)
    if bits == 4:
        return quantize_int4(w, group)
    raise ValueError(f"bits must be 4 or 8, got {bits}")


def quantize_columns(w: torch.Tensor, bits: int, group: int = INT4_GROUP, chunk: int = 16384):
    """quantize(w) for a wide w [K, N] (an LM head), 16k columns at a time: the quantizers work
    per column, so this is the same result with a fraction of the temporary memory."""
    if w.shape[1] <= chunk:
        return quantize(w, bits, group)
    parts = [quantize(w[:, i : i + chunk], bits, group) for i in range(0, w.shape[1], chunk)]
    cat = lambda name, dim: torch.cat([getattr(p, name) for p in parts], dim)  # noqa: E731
    return QuantizedWeight(cat("q", 0), cat("scale", -1), None if bits == 8 else cat("zero", -1),
                                   w.shape[0], w.shape[1], bits, parts[0].group)
