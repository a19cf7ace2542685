"""The batched forward passes of one engine step.

draft_depth: self-drafts by depth (early exit, layer skip, quantized copy). Draft step j of
every sequence with the same draft signature (draft runtime, exit layer, draft head, skip
sets) is ONE call: their pending/last tokens as rows of one run_layers_batch and one head
call; each sequence then picks its token with its own drafter's rule (_choose: greedy or
its own RNG, its threshold, its draft vocabulary), exactly as its solo draft would.

staged_forward: verification of every decoding sequence and the prefill chunks of newcomers
in one pass. Early exit's verification enters the full model at layer E with the exit hidden
states its drafts already computed (LayerSkip's exit-query cache); the other rows enter at 0.
The pass runs layers in stages between the distinct entry layers, each stage one batched call
over every row present, so each weight still streams once per stage; rows are computed as in
the solo pass (row invariance), hence bit-identical logits. Newcomers' prompts may join a
running pass at a stage boundary the same way, their rows having run the layers before it in
a call of their own (staged_forward's `join`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from selfspec.cache import SegmentTable
from selfspec.strategies import strategy

JOIN_STAGES = 4  # a pass that newcomers may join runs in this many stages (staged_forward)


def signature(seq) -> tuple:
    """What a depth drafter drafts with: sequences with equal signatures share draft forwards.
    (runtime, exit layer, draft head, skipped attention, skipped MLP): its depth_signature()."""
    return seq.actor.depth_signature()


def exit_states(d) -> bool:
    """Whether d's verification enters at its exit layer with its drafts' exit hidden states
    (its strategy's registry entry: early exit)."""
    return strategy(d.cfg.strategy).exit_states


def draft_depth(seqs: list) -> None:
    """Draft up to seq.planned_k tokens for every sequence in seqs (depth kind), batched per
    signature and draft step; fills seq.draft (and seq.exit_h for early exit)."""
    groups: dict[tuple, list] = {}
    for s in seqs:
        if s.planned_k > 0:
            groups.setdefault(signature(s), []).append(s)
    for (rt, exit_layer, head, skip_attn, skip_mlp), active in groups.items():
        j = 0
        with torch.inference_mode():
            while active:
                toks = [s.draft.tokens[-1] if j else s.tokens[-1] for s in active]
                table = SegmentTable([(s.cache, s.step.pos + j, 1) for s in active])
                h = rt.run_layers_batch(rt.embed(torch.tensor(toks, device=rt.device)), 0, exit_layer, table, skip_attn, skip_mlp)
                logits = rt.logits(h, head=head)  # [rows, V or N]
                going = []
                for r, s in enumerate(active):
                    if exit_states(s.actor):
                        s.exit_h.append(h[r : r + 1])
                    # (a sequence whose drafter raises here fails alone: Sequence.attempt)
                    if s.attempt(s.actor._choose, logits[r], s.step, s.draft) and len(s.draft.tokens) < s.planned_k:
                        going.append(s)
                active, j = going, j + 1


@dataclass
class Part:
    """Rows of one sequence in a staged pass: `cached` hidden states entering at layer `entry`
    (positions pos..), then `ids` (fresh tokens, from layer 0, positions pos+len(cached)..).
    logits: "all" rows, "last" row, or "none"; argmax_only: greedy rows (their argmax tokens: Runtime.argmax)."""

    cache: object
    pos: int
    ids: list[int]
    logits: str = "all"
    cached: torch.Tensor | None = None
    entry: int = 0
    argmax_only: bool = False

    @property
    def n_cached(self) -> int:
        return 0 if self.cached is None else self.cached.shape[0]


def verify_part(seq) -> Part:
    """The verification rows of a decoding sequence: its pending token and its drafts."""
    ids = [seq.step.tokens[-1], *seq.draft.tokens]
    greedy = seq.step.argmax_only
    if seq.exit_h and exit_states(seq.actor):
        j = len(seq.exit_h)
        return Part(seq.cache, seq.step.pos, ids[j:], "all", torch.cat(seq.exit_h), seq.actor.exit, greedy)
    return Part(seq.cache, seq.step.pos, ids, argmax_only=greedy)


def staged_forward(rt, parts: list[Part], join: Callable[[int], list[Part]] | None = None) -> list[torch.Tensor | list[int] | None]:
    """One batched pass over every part; -> per part its logits rows (fp32 [n, V]; argmax_only:
    their argmax tokens) or None.

    join(layer), when given, is asked at JOIN_STAGES - 1 layer boundaries for fresh prompt parts
    (positions from 0 of their own caches) that join the pass there: their rows first run
    layers [0, layer) in a call of their own (the exit-query cache's way in, from layer 0), then
    go on with everyone; their outputs follow the parts' in the result, in the order joined. A
    request arriving while a pass runs so gets its first token from that pass instead of waiting
    for the pass and then a pass of its own."""
    L = rt.num_layers
    bounds = {0, L} | {p.entry for p in parts if p.cached is not None}
    if join is not None:
        stage = math.ceil(L / JOIN_STAGES)
        bounds |= set(range(stage, L, stage))
    bounds = sorted(bounds)
    dev = rt.device
    parts = list(parts)
    cur = [rt.embed(torch.tensor(p.ids, device=dev)) if p.ids else None for p in parts]
    merged = [p.cached is None for p in parts]
    with torch.inference_mode():
        for a, b in zip(bounds, bounds[1:]):
            if join is not None and a > 0 and (new := join(a)):
                h = rt.embed(torch.tensor([t for p in new for t in p.ids], device=dev))
                h = rt.run_layers_batch(h, 0, a, SegmentTable([(p.cache, p.pos, len(p.ids)) for p in new]))
                parts += new
                cur += h.split([len(p.ids) for p in new])
                merged += [True] * len(new)
            for i, p in enumerate(parts):
                if not merged[i] and p.entry == a:  # the exit-query cache joins the stage at layer E
                    cur[i] = p.cached if cur[i] is None else torch.cat([p.cached, cur[i]])
                    merged[i] = True
            live = [i for i in range(len(parts)) if cur[i] is not None and cur[i].shape[0]]
            if not live:
                continue
            segs = [(parts[i].cache, parts[i].pos + (0 if merged[i] else parts[i].n_cached), cur[i].shape[0]) for i in live]
            h = rt.run_layers_batch(torch.cat([cur[i] for i in live]), a, b, SegmentTable(segs))
            r = 0
            for i in live:
                n = cur[i].shape[0]
                cur[i], r = h[r : r + n], r + n
        want = [(i, cur[i] if parts[i].logits == "all" else cur[i][-1:]) for i in range(len(parts))
                if parts[i].logits != "none" and cur[i] is not None]
        out: list[torch.Tensor | None] = [None] * len(parts)
        for greedy in (False, True):  # one head call per kind: rows are computed on their own
            rows = [(i, h) for i, h in want if parts[i].argmax_only == greedy]
            if not rows:
                continue
            x = torch.cat([h for _, h in rows])
            logits = rt.argmax(x) if greedy else rt.logits(x)
            r = 0
            for i, h in rows:
                out[i], r = logits[r : r + h.shape[0]], r + h.shape[0]
    return out
