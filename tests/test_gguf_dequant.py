"""csrc/ggml_dequant.c against the gguf package's own dequantizer (gguf.quants.dequantize),
bit for bit, on random blocks of every block type it reads (any bytes are a valid block, but
for fp16 scales that are NaN or infinite: those are redrawn)."""

from __future__ import annotations

import numpy as np
import pytest
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from selfspec import kernels
from selfspec.kernels import ggml

Q = GGMLQuantizationType
# byte offsets of each block's fp16 scales
_HALVES = {Q.Q4_0: (0,), Q.Q5_0: (0,), Q.Q8_0: (0,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}

pytestmark = pytest.mark.skipif(not kernels.available(), reason="needs selfspec's kernels")


def _random_blocks(qtype, rows: int, blocks_per_row: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, blocks_per_row, size), dtype=np.uint8)
    for off in _HALVES.get(qtype, ()):  # finite scales of many magnitudes, both signs, subnormals too
        scales = rng.standard_normal((rows, blocks_per_row)) * 4.0 ** rng.integers(-9, 4, (rows, blocks_per_row))
        raw[..., off:off + 2] = scales.astype(np.float16)[..., None].view(np.uint8)
    if qtype in (Q.F16, Q.BF16):
        raw = rng.standard_normal((rows, blocks_per_row)).astype(np.float32)
        raw = (raw.astype(np.float16) if qtype == Q.F16 else (raw.view(np.uint32) >> 16).astype(np.uint16)).view(np.uint8)
        return raw.reshape(rows, -1)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("qtype", sorted(ggml.NATIVE - {Q.F32}, key=int))
def test_dequantization_is_gguf_bit_for_bit(qtype):
    block, _ = GGML_QUANT_SIZES[qtype]
    for rows, per_row, seed in ((3, 2, 0), (70, 9, 1)):  # 70 x 9 K-blocks: split among threads
        raw = _random_blocks(qtype, rows, per_row if block > 1 else 64 * per_row, seed)
        cols = raw.shape[1] // GGML_QUANT_SIZES[qtype][1] * block
        mine = ggml.dequantize(raw, qtype, cols)
        theirs = gguf_dequantize(raw, qtype).astype(np.float32).reshape(rows, cols)
        assert mine.dtype == np.float32 and mine.shape == (rows, cols)
        assert np.array_equal(mine.view(np.uint32), theirs.view(np.uint32)), qtype.name


def test_other_types_fall_back_to_gguf():
    raw = np.random.default_rng(0).integers(0, 256, size=(2, 84), dtype=np.uint8)  # one Q2_K block a row
    out = ggml.dequantize(raw, Q.Q2_K, 256)
    assert out.shape == (2, 256)
    assert np.array_equal(out.view(np.uint32), gguf_dequantize(raw, Q.Q2_K).reshape(2, 256).view(np.uint32))
