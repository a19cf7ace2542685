"""The worker: admission, the engine thread that drives one continuous batch, and the warm-up.

The interface the routes use:

    worker.submit(job)    queue a Job; the worker streams its events into job.events
    job.cancel()          the client left: a queued job is dropped, a running one leaves the
                          batch (its slot and KV cache freed) at the next step boundary, at
                          once when no step is running
    worker.waiting        queued jobs whose clients are still there
    worker.running        jobs holding a batch slot
    worker.batch_size     sequences in the engine's batch now
    worker.shutdown()

Events a job receives, in order: ("start",) when it gets a batch slot, ("tok", text, logprob)
per committed token with a text delta or a logprob (streamed requests), then one of ("done", result), ("error", exc),
("cancelled",) or ("skipped",) (cancelled before it started).

One engine thread owns a `selfspec.batch.BatchEngine` (batch.engine documents a step). Jobs
wait here in arrival (FIFO) order and enter the engine when a slot is free (at most
`max_batch` in the batch), so "waiting" means waiting for a slot and the queue timeout (503)
counts from arrival to the slot. Between two steps the thread admits, then runs one step
under the model's own lock (direct `model.generate` calls elsewhere in the process
interleave safely), then hands finished jobs their results. Newcomers' prompts are prefilled
in chunks of `prefill_chunk` rows inside the running sequences' verify pass, so a long prompt
delays running streams by one chunk per step, never a whole prefill (short ones, up to a chunk
together, take a pass of their own first: BatchEngine._first_prompts). A strategy the engine
cannot batch runs its solo steps inside the batch (exact, as alone).

Failures: a request's own failure (building its drafter or processors, its drafter's or
processors' calls inside a step, streaming its tokens) ends that request alone with the error
(BatchEngine: Sequence.attempt); the others finish unchanged. A failure of the batch's shared
passes leaves the batch in an unknown state: every request in it gets the error, and the next
step starts from a fresh engine; waiting requests go on.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections import deque
from dataclasses import replace

from selfspec.batch import BatchEngine, BatchHandle
from selfspec.batch.planner import kept_costs
from selfspec.engine import GenerationResult, GenerationStats
from selfspec.request import Request
from selfspec.server.errors import APIError
from selfspec.server.parsing import Params
from selfspec.server.settings import ServerSettings, default_max_batch

log = logging.getLogger("selfspec.server")


class Job:
    """One request handed to the worker; its events go back to the event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, params: Params, t_arrival: float | None = None):
        self.loop = loop
        self.params = params
        self.stream = params.stream
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancelled = threading.Event()
        self.on_cancel = None  # set by the worker: takes the job out of the batch, wakes the engine thread
        self.handle: BatchHandle | None = None  # once it has a slot
        self.finished = False
        self.failed = False  # its own failure was reported: the engine's result is ignored
        self.t_arrival = time.perf_counter() if t_arrival is None else t_arrival
        self.t_start: float | None = None
        self.t_first: float | None = None
        self.t_last: float | None = None
        self.n_tokens = 0
        self.prompt_logprobs: list | None = None  # echo with logprobs: the prompt's (logprobs.prompt_logprobs)

    def post(self, *item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, item)
        except RuntimeError:  # the loop is closed: the server is shutting down
            self.cancelled.set()

    def cancel(self) -> None:
        self.cancelled.set()
        if self.on_cancel is not None:
            self.on_cancel(self)


class Admission:
    """At most max_concurrency requests between admission and the end of their response;
    the next gets 429 at once, with a Retry-After from the recent time per job."""

    def __init__(self, settings: ServerSettings, metrics):
        self.settings, self.metrics = settings, metrics
        self.admitted = 0  # written on the event loop only
        self.ewma_job_s = 1.0

    def admit(self, waiting: int) -> None:
        if self.admitted >= self.settings.max_concurrency:
            self.metrics.rejected.labels("queue_full").inc()
            slots = self.settings.max_batch or default_max_batch()
            wait = max(1, min(60, math.ceil(self.ewma_job_s * max(waiting, 1) / slots)))
            raise APIError(429, f"The server is at capacity ({self.settings.max_concurrency} requests in progress); retry later.",
                           type="rate_limit_error", code="rate_limit_exceeded", headers={"Retry-After": str(wait)})
        self.admitted += 1

    def release(self) -> None:
        self.admitted -= 1

    def observe(self, seconds: float) -> None:
        self.ewma_job_s = 0.8 * self.ewma_job_s + 0.2 * seconds


class Worker:
    """One continuous batch driven by one engine thread (module doc)."""

    def __init__(self, model, settings: ServerSettings, metrics, admission: Admission):
        self.model, self.settings, self.metrics, self.admission = model, settings, metrics, admission
        self.max_batch = settings.max_batch or default_max_batch()
        self.engine = self._new_engine()
        self._cond = threading.Condition()
        self.queued: deque[Job] = deque()  # waiting for a slot, in arrival order
        self.slots: list[Job] = []  # holding a slot (engine thread only)
        self._stop = False
        self.steps = 0
        metrics.waiting.set_function(lambda: self.waiting)
        metrics.running.set_function(lambda: self.running)
        metrics.batch_size.set_function(lambda: self.batch_size)
        metrics.queue_depth.set_function(lambda: self.waiting)
        metrics.max_batch.set(self.max_batch)
        metrics.longest_stall.set_function(lambda: self.engine.longest_stall_s)
        self.thread = threading.Thread(target=self._loop, name="selfspec-engine", daemon=True)
        self.thread.start()

    def _new_engine(self) -> BatchEngine:
        engine = BatchEngine(self.model, max_batch=self.max_batch, prefill_chunk=self.settings.prefill_chunk)
        engine.intake = self._fill_slots  # requests arriving during a pass join it (BatchEngine._join)
        return engine

    # ---- what the routes and the metrics read --------------------------------------------------

    @property
    def waiting(self) -> int:
        """Queued jobs whose clients are still there."""
        return sum(1 for j in list(self.queued) if not j.cancelled.is_set())

    @property
    def running(self) -> int:
        return len(self.slots)

    @property
    def batch_size(self) -> int:
        return self.engine.batch_size

    def submit(self, job: Job) -> None:
        job.on_cancel = self._cancel
        with self._cond:
            self.queued.append(job)
            self._cond.notify_all()

    def _cancel(self, job: Job) -> None:  # any thread
        with self._cond:
            handle = job.handle
            self._cond.notify_all()
        if handle is not None:  # frees the slot now when no step runs, else at the next step boundary
            handle.cancel()

    def shutdown(self) -> None:
        with self._cond:
            self._stop = True
            jobs = list(self.queued) + list(self.slots)
            self._cond.notify_all()
        for job in jobs:
            job.cancel()

    # ---- the engine thread ---------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._stop and not self.slots and not self.queued:
                    self._cond.wait()
                if self._stop:
                    return
            self._drop_gone()
            self._fill_slots()
            if self.slots:
                self._step()
            self._collect()

    def _drop_gone(self) -> None:
        """Queued jobs whose clients left never start."""
        with self._cond:
            gone = [j for j in self.queued if j.cancelled.is_set()]
            for j in gone:
                self.queued.remove(j)
        for j in gone:
            j.finished = True
            j.post("skipped")

    def _fill_slots(self) -> None:
        while True:
            with self._cond:
                free = self.max_batch - sum(1 for j in self.slots if not j.cancelled.is_set())
                if free <= 0 or not self.queued:
                    return
                job = self.queued.popleft()
            if job.cancelled.is_set():
                job.finished = True
                job.post("skipped")
                continue
            self.start(job)

    def start(self, job: Job) -> None:
        """Give the job a slot: it enters the engine (its first prompt chunk runs in the next step)."""
        job.t_start = time.perf_counter()
        self.metrics.queue_time.observe(job.t_start - job.t_arrival)
        job.post("start")
        p = job.params
        if p.echo and p.logprobs is not None:  # the prompt's own logprobs: one pass over it, here on the engine thread
            try:
                with self.model.computing():
                    job.prompt_logprobs = self.model.prompt_logprobs(p.prompt_ids, p.logprobs)
            except Exception as e:
                job.finished = True
                job.post("error", e)
                return
        if p.max_tokens == 0:  # echo alone: nothing to generate
            job.finished = True
            job.post("done", GenerationResult("", [], len(p.prompt_ids), "length", GenerationStats(prompt_tokens=len(p.prompt_ids)), [], []))
            return
        try:
            handle = self.engine.submit(self.request(job))
        except Exception as e:  # its drafter could not be built: this request alone fails
            job.finished = True
            job.post("error", e)
            return
        with self._cond:
            job.handle = handle
            self.slots.append(job)
        if job.cancelled.is_set():  # left while entering: _cancel did not see the handle
            handle.cancel()

    def request(self, job: Job) -> Request:
        """The job's Request (built by Request.build, as `generate` builds its own: parsing.encode),
        streaming its tokens to the job."""
        return replace(job.params.request, on_event=lambda ev: self._on_event(job, ev))

    def _step(self) -> None:
        try:
            with self.model.computing():  # SelfSpecModel's one-generation-at-a-time lock, per step
                self.engine_step()
            self.steps += 1
        except Exception as e:  # the batch's state is unknown: everyone in it fails, a fresh engine goes on
            log.error("batch step failed: %s: %s", type(e).__name__, e, exc_info=e)
            for job in list(self.slots):
                if not job.failed:
                    job.failed = True
                    job.post("error", e)
            self.engine = self._new_engine()
            with self._cond:
                for job in self.slots:
                    job.finished = True
                    self.admission.observe(time.perf_counter() - job.t_start)
                self.slots.clear()

    def engine_step(self) -> None:
        """One step of the batch (a hook tests wrap)."""
        self.engine.step()

    def _on_event(self, job: Job, ev) -> None:  # the engine thread, once per committed token; never raises
        if job.cancelled.is_set() or job.failed:
            return
        try:
            self.on_token(job, ev)
        except Exception as e:  # this request's own failure: it leaves the batch, the others go on
            job.failed = True
            job.post("error", e)
            job.handle.cancel()

    def on_token(self, job: Job, ev) -> None:
        """A committed token of a job (a hook tests wrap)."""
        now = time.perf_counter()
        if job.t_first is None:
            job.t_first = now
        job.t_last = now
        job.n_tokens += 1
        if job.stream and (ev.text or ev.logprob is not None):
            job.post("tok", ev.text, ev.logprob)

    def _collect(self) -> None:
        """Finished and cancelled jobs leave their slots; their clients get the outcome."""
        for j in [j for j in list(self.slots) if j.cancelled.is_set() or j.failed]:
            j.handle.cancel()  # left during the step: retired now, between steps (no step runs)
        with self._cond:
            done = [j for j in self.slots if j.handle.done]
            for j in done:
                self.slots.remove(j)
        for job in done:
            job.finished = True
            self.admission.observe(time.perf_counter() - job.t_start)
            result = job.handle.result
            if job.failed:
                continue
            if job.handle.error is not None:  # its own failure inside the engine: the batch went on without it
                job.failed = True
                job.post("error", job.handle.error)
            elif result is None or result.finish_reason == "cancelled" or job.cancelled.is_set():
                job.post("cancelled")
            else:
                job.post("done", result)


def warmup(model, draft) -> None:
    """Before traffic: one short generation (builds the drafter, touches every kernel), the
    batched pass costs the batch planner reads, and a two-sequence batch, in which the planner
    times this draft's batched forwards (measured on first use, which the first batched request
    would otherwise wait)."""
    tok = model.tokenizer
    ids = tok("Hello").input_ids if tok is not None else [0]
    ids = [t for t in ids if 0 <= t < model.spec.vocab_size] or [0]
    model.generate(ids, max_new_tokens=2, draft=draft)
    with model.computing():
        kept_costs(model.resources)
    model.generate_batch([ids, ids], max_new_tokens=4, draft=draft, max_batch=2)
