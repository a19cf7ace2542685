"""A static, position-indexed KV cache (gpt-fast style).

Every layer owns a preallocated [kv_heads, capacity, head_dim] buffer for keys and values.
Writers put position p at row p; readers attend over the whole buffer with a mask that
hides every row at or beyond the query's position. So the cache needs no notion of "length":
the engine keeps the number of committed tokens, and rolling back a rejected draft is just
not advancing that number; stale rows are overwritten before any query can see them.

Attending over the full capacity (not just the filled prefix) keeps every call's shapes
identical, which is what makes a verify pass over k+1 positions give bit-identical rows to
k+1 single-token decode steps (the losslessness guarantee depends on it).
"""

from __future__ import annotations

import numpy as np
import torch


class KVCache:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, capacity: int, dtype, device):
        self.capacity = capacity
        # Zero-initialised: masked rows multiply finite values by probability 0.
        # Keys are stored transposed, [layers, kv_heads, head_dim, capacity], so q @ kt uses
        # the same (row-count-invariant) BLAS kernel family as the linear layers.
        self.kt = torch.zeros((num_layers, num_kv_heads, head_dim, capacity), dtype=dtype, device=device)
        self.v = torch.zeros((num_layers, num_kv_heads, capacity, head_dim), dtype=dtype, device=device)
        self.positions = torch.arange(capacity, device=device)

    def write(self, layer: int, pos: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [kv_heads, T, head_dim] for positions pos..pos+T-1."""
        t = k.shape[1]
        self.kt[layer, :, :, pos : pos + t] = k.transpose(1, 2)
        self.v[layer, :, pos : pos + t] = v

    def save_rows(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A copy of positions start..end-1 of every layer, for restore_rows."""
        return self.kt[..., start:end].clone(), self.v[:, :, start:end].clone()

    def restore_rows(self, start: int, saved: tuple[torch.Tensor, torch.Tensor]) -> None:
        kt, v = saved
        self.kt[..., start : start + kt.shape[-1]] = kt
        self.v[:, :, start : start + v.shape[2]] = v

    def mask(self, pos: int, t: int, window: int | None) -> torch.Tensor:
        """Boolean [T, capacity]: query at pos+i may see key j iff j <= pos+i and, with a
        sliding window, j > pos+i-window (transformers' convention)."""
        q = self.positions[pos : pos + t, None]
        keys = self.positions[None, :]
        allowed = keys <= q
        if window is not None:
            allowed &= keys > q - window
        return allowed

    @staticmethod
    def capacity_for(total_tokens: int, block: int = 256) -> int:
        """Round up so that runs of different strategies over the same prompt and budget
        share one capacity (and so bit-identical attention shapes)."""
        return ((total_tokens + block - 1) // block) * block


def segment_row(cache: "KVCache", pos: int, rows: int, row0: int = 0) -> tuple[int, ...]:
    """The 8 longs of one segment as csrc/blocks.c reads them (ss_seg): first row, rows, first
    position, capacity, key and value base addresses, their layer strides in bytes."""
    kt, v = cache.kt, cache.v
    return (row0, rows, pos, cache.capacity, kt.data_ptr(), v.data_ptr(),
            kt.stride(0) * kt.element_size(), v.stride(0) * v.element_size())


class SegmentTable:
    """The rows of a batched forward (Runtime.run_layers_batch): consecutive runs of rows, one
    per sequence, each with its own KVCache and first position. `segments` are
    (cache, pos, rows) in row order; the C kernel reads them as 8 longs each (ss_seg in
    csrc/blocks.c: row0, rows, pos, capacity, key and value base addresses, layer strides
    in bytes), built once per forward and shared by every layer."""

    def __init__(self, segments: list[tuple["KVCache", int, int]]):
        self.segments = segments
        self.count = len(segments)
        self.rows = sum(r for _, _, r in segments)
        table, row0 = [], 0
        for cache, pos, rows in segments:
            table.append(segment_row(cache, pos, rows, row0))
            row0 += rows
        self._array = np.array(table, dtype=np.int64).reshape(-1, 8)
        self.ptr = self._array.ctypes.data

    def positions(self) -> list[int]:
        """The position of every row, in row order."""
        return [p + j for _, p, r in self.segments for j in range(r)]


class CachePool:
    """Freed caches kept for the next sequence of the same capacity. A continuous batch gives
    every request its own cache, and a fresh one is a zeroed allocation of every layer's rows
    (megabytes on the default model, with their page faults), paid on the way to each
    newcomer's first token. A reused cache keeps its last sequence's rows, as rollback keeps
    rejected drafts' rows: the fused blocks never read a key past a query's own position, so
    they cannot see them; a runtime without them (torch attends over the whole buffer under a
    mask) gets the cache zeroed, lest a non-finite stale value leak through 0 * v."""

    def __init__(self, runtime, max_bytes: int):
        self.rt, self.max_bytes = runtime, max_bytes
        self._free: list[KVCache] = []  # oldest first
        self.bytes = 0

    def take(self, total_tokens: int) -> KVCache:
        """A cache for total_tokens positions (Runtime.new_cache's capacity): a freed one if any."""
        cap = KVCache.capacity_for(total_tokens)
        for i in range(len(self._free) - 1, -1, -1):
            if self._free[i].capacity == cap:
                cache = self._free.pop(i)
                self.bytes -= _nbytes(cache)
                if self.rt.blocks is None:
                    cache.kt.zero_()
                    cache.v.zero_()
                return cache
        return self.rt.new_cache(total_tokens)

    def give(self, cache: KVCache) -> None:
        """A cache no sequence will use again; the oldest are dropped beyond max_bytes."""
        self._free.append(cache)
        self.bytes += _nbytes(cache)
        while self.bytes > self.max_bytes:
            self.bytes -= _nbytes(self._free.pop(0))


def _nbytes(cache: KVCache) -> int:
    return cache.kt.nbytes + cache.v.nbytes
