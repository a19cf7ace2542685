"""The batched layer loop (Runtime.run_layers_batch, csrc/blocks.c selfspec_attn_block_batch):
every row of a batched forward is bit-identical to the same row computed for its sequence
alone, whatever the other segments, their order, sizes and positions."""

from __future__ import annotations

import pytest
import torch

from selfspec.cache import SegmentTable
from helpers import prompts

ARCHS = ("llama3", "mistral", "qwen3", "gemma3")


def _solo_logits(rt, ids: list[int], chunks: list[int]) -> list[torch.Tensor]:
    """Logits of every position of ids, forwarded alone in the given chunk sizes."""
    cache = rt.new_cache(len(ids) + 8)
    out, pos = [], 0
    for n in chunks:
        out.append(rt.forward(torch.tensor(ids[pos : pos + n]), pos, cache))
        pos += n
    return list(torch.cat(out))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ARCHS)
def test_batched_rows_equal_solo_rows(zoo, arch, dtype):
    _, m = zoo.get(arch, dtype=dtype)
    rt = m.runtime
    seqs = prompts(n=4, seed=3, lengths=(13, 5, 21, 9))
    ref = [_solo_logits(rt, s, [len(s)]) for s in seqs]
    caches = [rt.new_cache(len(s) + 40) for s in seqs]  # other capacities than solo's: the kernels never read past a row's keys
    done = [0] * len(seqs)
    # rounds of mixed segment sizes: prefill chunks next to single rows next to verify-like runs
    plans = [[4, 1, 7, 2], [1, 3, 0, 5], [8, 1, 14, 2], [0, 0, 0, 0]]
    with torch.inference_mode():
        for plan in plans + [[len(s) for s in seqs]]:
            segs, ids = [], []
            for i, n in enumerate(plan):
                n = min(n, len(seqs[i]) - done[i])
                if n > 0:
                    segs.append((caches[i], done[i], n))
                    ids += seqs[i][done[i] : done[i] + n]
            if not segs:
                continue
            order = list(range(len(segs)))[::-1]  # reversed segment order: order must not matter
            segs = [segs[j] for j in order]
            table = SegmentTable(segs)
            flat = [t for c, p, n in segs for t in seqs[caches.index(c)][p : p + n]]
            h = rt.run_layers_batch(rt.embed(torch.tensor(flat)), 0, rt.num_layers, table)
            logits = rt.logits(h)
            r = 0
            for c, p, n in segs:
                i = caches.index(c)
                for j in range(n):
                    assert torch.equal(logits[r], ref[i][p + j]), (arch, dtype, i, p + j)
                    r += 1
                done[i] = max(done[i], p + n)
    assert done == [len(s) for s in seqs]


def test_batched_skips_and_layer_ranges(zoo):
    """Sub-ranges of layers with skipped sub-layers, as drafting uses them."""
    _, m = zoo.get("qwen3", dtype="bfloat16")
    rt = m.runtime
    seqs = prompts(n=3, seed=5, lengths=(6, 9, 4))
    skips = dict(skip_attn=frozenset({1}), skip_mlp=frozenset({2}))
    with torch.inference_mode():
        solo = []
        for s in seqs:
            c = rt.new_cache(32)
            solo.append(rt.run_layers(rt.embed(torch.tensor(s)), 0, 3, 0, c, **skips))
        caches = [rt.new_cache(64) for _ in seqs]
        table = SegmentTable([(c, 0, len(s)) for c, s in zip(caches, seqs)])
        h = rt.run_layers_batch(rt.embed(torch.tensor([t for s in seqs for t in s])), 0, 3, table, **skips)
    assert torch.equal(h, torch.cat(solo))
