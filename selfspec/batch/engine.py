"""Continuous batching: many generations share every forward pass.

    engine = BatchEngine(model, max_batch=8)
    h = engine.submit(Request(ids, gen, sampling, draft))   # any thread (request.py)
    while engine.step(): ...                                  # one driving thread
    h.wait().token_ids                                        # == model.run(the request)'s

A step (sequences join and leave only between steps):
  1. admit queued requests up to max_batch (each gets its own KV cache, sized as solo: a
     freed one when the pool has one) and drop cancelled ones (their cache back to the pool);
  2. plan every decoding sequence's draft length: greedy, the batch planner (planner.py);
     sampling, the sequence's own rule (auto's gating or its fixed K), so its RNG is consumed
     exactly as alone;
  3. draft: prompt lookup per sequence (free), and so the copy of a hot lookup-first sequence
     (Sequence.look_up); self-drafts by depth batched (passes.py);
  4. ONE staged pass verifies every sequence's rows and advances up to `prefill_chunk` prompt
     rows of newcomers (chunked prefill: running streams wait one chunk, not a prompt);
     except that newcomers' whole prompts, up to a chunk of rows, first take a pass of their
     own while streams are running (_first_prompts: time to first token); how many prompts
     share a pass: the fewest summed waits to first token by the measured pass costs
     (planner.prompt_group);
  5. settle each sequence's step as a solo run does (step.settle: accept, the drafter hears, commit), stream,
     and retire finished sequences at once.
Every row is computed as in a solo run (row-invariant kernels), so a request's tokens do not
depend on what else is in the batch or when it joined. A greedy sequence decoding alone (one
client, or the last of a batch) takes generate's own step instead (BatchEngine._alone).
"""

from __future__ import annotations

import itertools
import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import replace

import torch

from selfspec.batch.passes import Part, draft_depth, exit_states, signature, staged_forward, verify_part
from selfspec.batch.planner import BatchCosts, CostScale, kept_costs, plan_with_probes, predicted, prompt_group
from selfspec.batch.sequence import BatchHandle, Sequence
from selfspec.cache import CachePool
from selfspec.config import MAX_SPECULATIONS
from selfspec.drafters.base import Draft
from selfspec.request import Request
from selfspec.step import VerifyOutput, settle, speculative_step

PREFILL_ROWS_PER_CORE = 32  # default prefill chunk per CPU core (see default_prefill_chunk)
PREFILL_PATIENCE = 4  # steps a newcomer may be passed over by shorter prompts before it goes first
IDLE_GROUP_CHUNKS = 2  # while no sequence decodes, whole prompts may share a pass of this many chunks (no stream stalls)
CACHE_POOL_BYTES = 128 << 20  # freed KV caches kept for newcomers (cache.CachePool): 27 of the default model's 256-position ones
_costs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # runtime -> BatchCosts, measured once


def default_prefill_chunk(cpus: int | None = None) -> int:
    """Prompt rows per step when none is given: 32 per CPU core, between 32 and 512. Prefill is
    compute-bound, so a chunk's time is its rows over the cores; 32 rows a core keep a running
    stream's longest wait short on the 2-core reference machine (64 rows) while the pass's
    fixed part (streaming every weight, the head rows) stays a small share (per-row cost at 64
    rows against 0.75 at 128, measured on the default model)."""
    cpus = cpus or os.cpu_count() or 1
    return max(32, min(512, PREFILL_ROWS_PER_CORE * cpus))


def batch_costs(rt) -> BatchCosts:
    """A bare runtime's batched pass costs, measured on first use (a second or two) and kept
    for the process; a model's are kept on disk (planner.kept_costs)."""
    if rt not in _costs:
        _costs[rt] = BatchCosts.measure(rt)
    return _costs[rt]


class BatchEngine:
    """Thread-safe: submit() and cancel() from any thread; step() from one thread at a time
    (a lock serialises it). `costs`: BatchCosts for the planner (measured when first needed);
    plan_drafts=False drafts every greedy sequence its solo K instead."""

    def __init__(self, model, max_batch: int = 16, prefill_chunk: int | None = None, costs: BatchCosts | None = None,
                 plan_drafts: bool = True):
        self.model, self.rt = model, model.runtime
        self.max_batch, self.prefill_chunk = max(1, max_batch), max(1, prefill_chunk or default_prefill_chunk())
        self.plan_drafts = plan_drafts
        self._costs = costs
        self._queue: deque[tuple[BatchHandle, object, float]] = deque()  # (handle, drafter, submitted at)
        self._active: list[Sequence] = []
        self._caches = CachePool(self.rt, CACHE_POOL_BYTES)
        self._lock = threading.Lock()  # the queue and cancellations
        self._step_lock = threading.Lock()  # one step at a time
        self.steps = 0
        self.longest_stall_s = 0.0  # the longest wait of decoding sequences between two of their steps
        self._stall_from: float | None = None  # when the prompt-only passes that decoding sequences wait for began
        self.last_plan: list[int] = []
        self.cost_scale = CostScale()  # measured / predicted draft and verify seconds (planner.CostScale)
        # intake(): called by the engine thread inside a pass, submits requests that arrived meanwhile
        # (the server's worker); set, passes run in stages that such newcomers join (_join)
        self.intake: Callable[[], None] | None = None
        self._joined: list[tuple[Sequence, Part]] = []

    # ---- the interface -----------------------------------------------------------------

    def submit(self, request: Request) -> BatchHandle:
        """Queue a request, as fitted to the model (Request.fitted: a DraftChoice resolved, the
        prompt checked, the budget cut to the context); its drafter is built (and its options
        checked) here."""
        request = request.fitted(self.model)
        handle = BatchHandle(request, self)
        drafter = self.model.drafter(request.draft)
        with self._lock:
            self._queue.append((handle, drafter, time.perf_counter()))
        return handle

    def cancel(self, handle: BatchHandle) -> None:
        """Leave the batch: a queued request never starts; a running one is retired (its slot
        and cache freed) at the next step boundary, at once if no step is running."""
        handle.cancelled = True
        if self._step_lock.acquire(blocking=False):
            try:
                self._retire_cancelled()
            finally:
                self._step_lock.release()

    @property
    def batch_size(self) -> int:
        return len(self._active)

    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    def idle(self) -> bool:
        return not self._active and not self._queue

    def run(self) -> None:
        """Step until every submitted request is done."""
        while self.step():
            pass

    def step(self) -> bool:
        """One batched step; -> whether work remains."""
        with self._step_lock:
            self._retire_cancelled()
            self._admit()
            if not self._active:
                return not self.idle()
            t0 = time.perf_counter()
            decoding_before = any(s.decoding for s in self._active)
            first = self._first_prompts() if decoding_before else []
            if first:  # newcomers' prompts first; decoding sequences wait for this pass too
                self._stall_from = t0
                self._prefill(first)
            else:
                self._step()
                if decoding_before:
                    self.longest_stall_s = max(self.longest_stall_s, time.perf_counter() - (self._stall_from or t0))
                self._stall_from = None  # (also when every sequence that waited has left meanwhile)
            self.steps += 1
            self._retire_finished()
            return not self.idle()

    # ---- admission and retirement --------------------------------------------------------------

    def _admit(self) -> None:
        with self._lock:
            while self._queue and len(self._active) < self.max_batch:
                handle, drafter, t_submit = self._queue.popleft()
                if handle.cancelled:
                    handle._finish(None)
                    continue
                req = handle.request
                cache = self._caches.take(len(req.prompt_ids) + req.gen.max_new_tokens + MAX_SPECULATIONS + 2)
                try:
                    seq = Sequence(handle, drafter, cache, self.model.tokenizer, self.model.eos_token_ids,
                                   proc=self.model.processing(req.sampling, req.gen, req.prompt_ids))
                except Exception as e:  # its processors could not be built: this request alone fails
                    self._caches.give(cache)
                    handle.error = e
                    handle._finish(None)
                    continue
                seq.t_start = t_submit  # time to first token counts the wait in the queue
                seq.admitted_step = self.steps
                self._active.append(seq)
                # a solo drafter prefills on its own (e.g. auto's calibration)
                seq.attempt(self._solo_prefill if seq.kind == "solo" else Sequence.start_without_prefill, seq)
                if seq.failed:
                    self._retire(seq)

    def _solo_prefill(self, seq: Sequence) -> None:
        ids = seq.req.prompt_ids
        with torch.inference_mode():
            logits = seq.drafter.prefill(torch.tensor(ids, device=self.rt.device), seq.cache, argmax_only=seq.argmax_only)
        seq.prefilled = len(ids)
        seq.pick_first(logits)

    def _retire_cancelled(self) -> None:
        with self._lock:
            for h, _, _ in [q for q in self._queue if q[0].cancelled]:
                self._queue.remove(next(q for q in self._queue if q[0] is h))
                h._finish(None)
        for s in [s for s in self._active if s.handle.cancelled]:
            self._retire(s)

    def _retire_finished(self) -> None:
        for s in [s for s in self._active if s.out.finish is not None]:
            self._retire(s)

    def _retire(self, s: Sequence) -> None:
        self._active.remove(s)
        self._caches.give(s.cache)
        s.handle._finish(s.result())

    # ---- one step ------------------------------------------------------------------------------

    def _step(self) -> None:
        clock = time.perf_counter
        decoding = [s for s in self._active if s.decoding]
        # whatever one sequence's drafter, processors or stream raise ends that sequence alone
        # (Sequence.attempt), and the step goes on for the others
        for s in [s for s in decoding if s.kind == "solo"]:
            s.attempt(self._solo_step, s)
        batched = [s for s in decoding if s.kind != "solo"]
        prefill = self._prefill_parts()
        if len(batched) == 1 and not prefill and self._alone(batched[0]):
            batched[0].attempt(self._solo_step, batched[0])
            return
        t0 = clock()
        for s in batched:
            if s.attempt(s.new_step) is not None:
                s.attempt(s.draft_free)
        batched = [s for s in batched if not s.failed]
        free = [s for s in batched if s.draft.free]  # grammar-forced drafts: nothing to plan or draft
        predicted_s = self._plan([s for s in batched if not s.draft.free], prefill)
        if free:
            predicted_s = None
        for s in batched:
            if s.kind == "free" and s.planned_k and not s.draft.tokens and not s.failed:  # greedy: made while planning
                s.draft = s.attempt(s.actor.draft, replace(s.step, k=s.planned_k)) or s.draft
        td = clock()
        draft_depth([s for s in batched if s.kind == "depth" and not s.copying and not s.draft.free and not s.failed])
        t1 = clock()
        if any(s.failed for s in batched):
            batched, predicted_s = [s for s in batched if not s.failed], None
        if batched and self._queue and self._stall_from is None:  # arrived while this step drafted: before its verification
            self._admit()
            if first := self._first_prompts(skip={id(s) for s, _ in prefill}):
                self._prefill(first)
        parts = [verify_part(s) for s in batched] + [p for _, p in prefill]
        tv = clock()
        logits = self._forward(parts)
        if predicted_s is not None and len(logits) == len(parts):  # (newcomers who joined: rows not predicted)
            self.cost_scale.observe(predicted_s, (t1 - td, clock() - tv))
        for s, lg in zip(batched, logits):
            s.attempt(self._accept, s, lg)
        self._prefilled(prefill, logits[len(batched):len(parts)])
        t2 = clock()
        for s in batched:
            s.stats.time_draft_s += t1 - t0
            s.stats.time_verify_s += t2 - tv

    def _prefill(self, prefill: list[tuple[Sequence, Part]]) -> None:
        """A pass over prompt rows alone."""
        self._prefilled(prefill, self._forward([p for _, p in prefill]))

    def _forward(self, parts: list[Part]) -> list:
        """staged_forward over the parts; with an intake, newcomers arriving meanwhile join it
        (their first tokens picked here; their outputs follow the parts')."""
        if self.intake is None:
            return staged_forward(self.rt, parts)
        logits = staged_forward(self.rt, parts, join=self._join)
        joined, self._joined = self._joined, []
        self._prefilled(joined, logits[len(parts):])
        return logits

    def _join(self, layer: int) -> list[Part]:
        """At a stage boundary of a pass (passes.staged_forward): requests that arrived meanwhile
        are admitted, and their whole prompts (at most a chunk together, as many as
        planner.prompt_group picks) join the pass. Cheaper for everyone than their own pass
        after it: the layers before `layer` run once more, over their rows only."""
        self.intake()
        if not self._queue:
            return []
        before = {id(s) for s in self._active}
        self._admit()
        fresh = [s for s in self._waiting() if id(s) not in before and not s.prefilled]
        new = self._whole_prompts(fresh, self.prefill_chunk)
        self._joined += new
        return [p for _, p in new]

    @staticmethod
    def _prefilled(prefill: list[tuple[Sequence, Part]], logits: list) -> None:
        for (s, p), lg in zip(prefill, logits):
            s.prefilled += len(p.ids)
            if lg is not None:
                s.attempt(s.pick_first, lg[-1])

    def _first_prompts(self, skip: set[int] = frozenset()) -> list[tuple[Sequence, Part]]:
        """Newcomers' whole prompts, at most a chunk of rows together (in _prefill_parts' order,
        not those in `skip`, by id; as many as planner.prompt_group picks), for a pass of their
        own while sequences are decoding: at the start of a step, or between its drafts and its
        verification for those that arrived meanwhile; at most one such pass between two
        batched verifications. Why: a newcomer's first token then waits for its own rows only
        (a short prompt's pass) instead of a whole step that also verifies
        every running sequence's drafts (about twice as long at 8); the running ones wait for one such pass
        more, so a stall stays below a chunk's pass plus a step."""
        if self._stall_from is not None:
            return []
        waiting = [s for s in self._waiting() if id(s) not in skip]
        fresh = list(itertools.takewhile(lambda s: not s.prefilled, waiting))
        return self._whole_prompts(fresh, self.prefill_chunk)

    def _prefill_parts(self) -> list[tuple[Sequence, Part]]:
        """This step's prompt rows: the first waiting prompts whole, as many as
        planner.prompt_group picks within the chunk (within IDLE_GROUP_CHUNKS chunks while no
        sequence decodes: no stream stalls then); a first prompt that does not fit whole is cut
        to the chunk. The order: shortest remaining prompt first, so the short prompts of several
        arriving together reach their first token a pass early instead of all waiting for one
        long pass; a newcomer passed over for PREFILL_PATIENCE steps goes first, in arrival
        order, so a long prompt never starves."""
        waiting = self._waiting()
        if not waiting:
            return []
        cap = self.prefill_chunk * (1 if any(s.decoding for s in self._active) else IDLE_GROUP_CHUNKS)
        if parts := self._whole_prompts(waiting, cap):
            return parts
        s = waiting[0]
        ids = s.req.prompt_ids[s.prefilled : s.prefilled + self.prefill_chunk]
        return [(s, Part(s.cache, s.prefilled, ids, "none", argmax_only=s.argmax_only))]

    def _waiting(self) -> list[Sequence]:
        """Sequences with prompt rows left, in the order they are served (_prefill_parts)."""
        waiting = [s for s in self._active if s.prefilled < len(s.req.prompt_ids)]
        overdue = lambda s: self.steps - s.admitted_step >= PREFILL_PATIENCE
        waiting.sort(key=lambda s: (not overdue(s), 0 if overdue(s) else len(s.req.prompt_ids) - s.prefilled))
        return waiting

    def _whole_prompts(self, waiting: list[Sequence], cap: int) -> list[tuple[Sequence, Part]]:
        """The first of `waiting` whole, at most `cap` rows, as many as planner.prompt_group picks."""
        left = [len(s.req.prompt_ids) - s.prefilled for s in waiting]
        fit = len(list(itertools.takewhile(lambda c: c <= cap, itertools.accumulate(left))))
        if fit > 1:
            fit = prompt_group(self.costs, left, cap, self.prefill_chunk)  # later passes: streams decode then
        return [(s, Part(s.cache, s.prefilled, s.req.prompt_ids[s.prefilled:], "last", argmax_only=s.argmax_only))
                for s in waiting[:fit]]

    @property
    def costs(self) -> BatchCosts:
        if self._costs is None:
            res = getattr(self.model, "resources", None)
            self._costs = kept_costs(res) if res is not None else batch_costs(self.rt)
        return self._costs

    def _plan(self, seqs: list[Sequence], prefill) -> tuple[float, float] | None:
        """seq.planned_k for every sequence (module doc, step 2); -> the (draft, verify) seconds
        the cost tables predict for this step when the planner decided all of its rows."""
        greedy = [s for s in seqs if s.attempt(self._own_k, s)]
        caps = [s.attempt(self._cap, s) for s in greedy]
        greedy, caps = [s for s in greedy if not s.failed], [c for s, c in zip(greedy, caps) if not s.failed]
        if not greedy:
            return None
        groups = [signature(s) if s.kind == "depth" and not s.copying else None for s in greedy]
        p_rows, p_logits = sum(len(p.ids) for _, p in prefill), sum(p.logits != "none" for _, p in prefill)
        ks, worth = plan_with_probes(self.costs, greedy, caps, groups, p_rows, p_logits, self.cost_scale.scales)
        self.last_plan = ks
        for i, (s, k, cap, w) in enumerate(zip(greedy, ks, caps, worth)):
            k = ks[i] = s.probe(k, cap if w else 0)
            s.planned_k = k
            if s.kind == "free" or s.copying:
                s.draft.tokens, s.draft.dists = s.draft.tokens[:k], s.draft.dists[:k]
            if s.auto is not None:
                s.auto.decisions.append(k)
        if len(greedy) < len(seqs):  # rows the planner did not decide: not the tables' to predict
            return None
        decode_rows = sum(k + 1 for k in ks)
        return predicted(self.costs, ks, groups, p_rows + decode_rows, p_logits + decode_rows)

    def _own_k(self, s: Sequence) -> bool:
        """s.planned_k where the planner does not decide it (module doc, step 2); -> whether it does."""
        limit = s.step.k
        a = s.auto
        if s.kind == "plain" or limit <= 0:
            s.planned_k = 0
        elif s.req.sampling.greedy and self.plan_drafts:
            return True
        elif a is not None:  # auto's own gating, as alone
            s.planned_k = a.plan(limit)
        else:
            s.planned_k = limit
        if a is not None:
            a.begin_step(s.planned_k)
        return False

    @staticmethod
    def _cap(s: Sequence) -> int:
        """The most tokens the planner may give s: the lookup's candidate bounds a free drafter;
        a hot lookup-first sequence drafts its copy, free."""
        if s.kind == "free":
            s.draft = s.actor.draft(s.step)
            return len(s.draft.tokens)
        if copy := s.look_up():
            s.draft, s.copying = Draft(copy, copied=True), True
            return len(copy)
        return s.step.k

    def _accept(self, s: Sequence, out: VerifyOutput) -> None:
        """Settle s's step from its rows of the batched pass (step.settle). Who hears of the
        drafts: auto where it gates by itself (its bookkeeping and its base's), else the
        self-drafter, of its own drafts only (not of a hot copy the batch drafted for it)."""
        a = s.auto
        if a is not None and not (s.req.sampling.greedy and self.plan_drafts):
            hear = a.accepted
        else:
            hear = None if s.copying else s.actor.accepted
        o = settle(s.step, s.draft, out, hear)
        s.commit(o.accepted, o.next_token)

    @staticmethod
    def _alone(s: Sequence) -> bool:
        """A greedy sequence decoding alone (no other rows this step) takes generate's own step:
        there is nothing to batch its drafts with, and its drafter's own path is the faster one
        (one-call draft passes, prompt-lookup guesses, copied tails; auto's own gating). Greedy
        output is plain decoding's either way; early exit keeps exit states per step the batched
        path holds on the sequence, so it stays there."""
        return s.req.sampling.greedy and s.kind != "plain" and not exit_states(s.actor)

    def _solo_step(self, s: Sequence) -> None:
        """A sequence whose drafter runs its own passes: exactly engine.generate's step (step.py)."""
        o = speculative_step(s.drafter, s.new_step(), s.remaining)
        s.draft = o.draft
        s.stats.time_draft_s += o.draft_s
        s.stats.time_verify_s += o.verify_s
        s.commit(o.accepted, o.next_token)
