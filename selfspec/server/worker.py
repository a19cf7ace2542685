"""The worker: admission, the engine threads, and the warm-up.

The interface the routes use (and a continuous-batching worker can implement the same way):

    worker.submit(job)    queue a Job; the worker streams its events into job.events
    job.cancel()          the client left: the worker drops the job (queued) or stops it at the
                          next token or prefill chunk (running)
    worker.waiting        queued jobs whose clients are still there
    worker.running        jobs the engine is working on
    worker.shutdown()

Events a job receives, in order: ("start",) when the engine takes it up, ("tok", text) per
committed text delta (streamed requests), then one of ("done", result), ("error", exc),
("cancelled",) or ("skipped",) (cancelled before it started).

This worker decodes one request at a time, in arrival (FIFO) order. Two engine threads share
the model through a fair turn (`Turns`): the one decoding, and the next request, which
meanwhile prefills its prompt in chunks of `prefill_chunk` tokens, one chunk per turn. The
decoding request hands the turn over after every token, so a long prompt never stalls a
running stream for more than one chunk, and its own first token is ready when its turn to
decode comes. Only the holder of the turn runs model code (it also holds the model's own
lock, so direct `model.generate` calls elsewhere in the process interleave safely).
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor

import torch

from selfspec import engine
from selfspec.config import GenerationConfig
from selfspec.server.errors import APIError, Cancelled
from selfspec.server.parsing import Params
from selfspec.server.settings import ServerSettings

_current = threading.local()  # .job, .turns, .chunk: what this engine thread runs (for the prefill chunks)


class Job:
    """One request handed to the worker; its events go back to the event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, params: Params, t_arrival: float | None = None):
        self.loop = loop
        self.params = params
        self.stream = params.stream
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancelled = threading.Event()
        self.on_cancel = None  # set by the worker: wakes its threads
        self.finished = False
        self.t_arrival = time.perf_counter() if t_arrival is None else t_arrival
        self.t_start: float | None = None
        self.t_first: float | None = None
        self.t_last: float | None = None
        self.n_tokens = 0

    def post(self, *item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, item)
        except RuntimeError:  # the loop is closed: the server is shutting down
            self.cancelled.set()

    def cancel(self) -> None:
        self.cancelled.set()
        if self.on_cancel is not None:
            self.on_cancel()


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
            wait = max(1, min(60, math.ceil(self.ewma_job_s * max(waiting, 1))))
            raise APIError(429, f"The server is at capacity ({self.settings.max_concurrency} requests in progress); retry later.",
                           type="rate_limit_error", code="rate_limit_exceeded", headers={"Retry-After": str(wait)})
        self.admitted += 1

    def release(self) -> None:
        self.admitted -= 1

    def observe(self, seconds: float) -> None:
        self.ewma_job_s = 0.8 * self.ewma_job_s + 0.2 * seconds


class Turns:
    """Who may run model code now (fair, FIFO among those asking), and who may decode now
    (one job at a time, in submission order)."""

    def __init__(self, model_lock):
        self.cond = threading.Condition()
        self.model_lock = model_lock  # the model's own lock: held with the turn
        self.holder = None
        self.asking: deque = deque()
        self.order: deque = deque()  # jobs submitted and not yet done decoding, in arrival order

    def _wait(self, job, ready) -> None:
        while True:
            if job.cancelled.is_set():  # first: a cancelled job never takes the turn
                raise Cancelled()
            if ready():
                return
            self.cond.wait()

    def take(self, job) -> None:
        with self.cond:
            self.asking.append(job)
            try:
                self._wait(job, lambda: self.holder is None and self.asking[0] is job)
            finally:
                self.asking.remove(job)
            self.holder = job
        self.model_lock.acquire()

    def give(self, job) -> None:
        if self.holder is not job:
            return
        self.model_lock.release()
        with self.cond:
            self.holder = None
            self.cond.notify_all()

    def pause(self, job) -> None:
        """Let whoever is asking run one piece (a token, a prefill chunk), then continue."""
        with self.cond:
            if not self.asking:
                return
        self.give(job)
        self.take(job)

    def decode(self, job) -> None:
        """Wait (without the turn) until every job that arrived earlier has finished decoding."""
        with self.cond:
            if self.order and self.order[0] is job:
                return
        self.give(job)
        with self.cond:
            self._wait(job, lambda: self.order[0] is job)
        self.take(job)

    def done(self, job) -> None:
        with self.cond:
            if job in self.order:
                self.order.remove(job)
            self.cond.notify_all()

    def wake(self) -> None:
        with self.cond:
            self.cond.notify_all()


class Worker:
    """One request decoding at a time, FIFO; the next one prefills meanwhile (module doc)."""

    def __init__(self, model, settings: ServerSettings, metrics, admission: Admission):
        self.model, self.settings, self.metrics, self.admission = model, settings, metrics, admission
        self.turns = Turns(model._lock)  # SelfSpecModel's one-generation-at-a-time lock
        self.pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="selfspec-engine")
        self.queued: set[Job] = set()  # submitted, not yet taken up by the engine
        self.live: set[Job] = set()  # submitted, not yet finished
        self.started = 0  # jobs taken up and not finished
        self._count = threading.Lock()  # for `started`, written by both engine threads
        chunked_prefill(model.runtime)
        metrics.waiting.set_function(lambda: self.waiting)
        metrics.running.set_function(lambda: self.started)

    @property
    def waiting(self) -> int:
        """Queued jobs whose clients are still there."""
        return sum(1 for j in list(self.queued) if not j.cancelled.is_set())

    @property
    def running(self) -> int:
        return self.started

    def submit(self, job: Job) -> None:
        job.on_cancel = self.turns.wake
        self.queued.add(job)
        self.live.add(job)
        with self.turns.cond:
            self.turns.order.append(job)
        self.pool.submit(self._run, job)

    def generate(self, params: Params, on_event):
        """One generation, as SelfSpecModel.generate runs it (the same budget, drafter and
        engine loop), without its lock: the turn stands for it (Turns)."""
        m = self.model
        ids = params.prompt_ids
        gen = GenerationConfig(max_new_tokens=min(params.max_tokens, m.context_length - len(ids)), stop=params.stop)
        drafter = m.drafter(params.draft)
        return engine.generate(m.runtime, drafter, ids, gen, params.sampling, m.tokenizer, m.eos_token_ids, on_event)

    def _run(self, job: Job) -> None:  # an engine thread
        try:
            self.turns.take(job)
        except Cancelled:
            self.queued.discard(job)
            self.live.discard(job)
            self.turns.done(job)
            job.post("skipped")
            return
        self.queued.discard(job)
        with self._count:
            self.started += 1
        job.t_start = time.perf_counter()
        job.post("start")
        self.metrics.queue_time.observe(job.t_start - job.t_arrival)
        _current.job, _current.turns, _current.chunk = job, self.turns, self.settings.prefill_chunk
        try:
            result = self.generate(job.params, lambda ev: self._on_event(job, ev))
        except Cancelled:
            job.post("cancelled")
        except BaseException as e:  # reported to this request only; the server goes on
            job.post("error", e)
            if not isinstance(e, Exception):
                raise
        else:
            job.post("done", result)
        finally:
            _current.job = None
            job.finished = True
            with self._count:
                self.started -= 1
            self.live.discard(job)
            self.turns.give(job)
            self.turns.done(job)
            self.admission.observe(time.perf_counter() - job.t_start)

    def _on_event(self, job: Job, ev) -> None:  # the engine thread, once per committed token
        if job.cancelled.is_set():
            raise Cancelled()
        if job.t_first is None:
            self.turns.decode(job)  # the prompt is in; decoding waits for the requests ahead
        now = time.perf_counter()
        if job.t_first is None:
            job.t_first = now
        job.t_last = now
        job.n_tokens += 1
        if job.stream and ev.text:
            job.post("tok", ev.text)
        self.turns.pause(job)  # a waiting request may prefill one chunk

    def shutdown(self) -> None:
        for job in list(self.live):
            job.cancel()
        self.pool.shutdown(wait=False, cancel_futures=True)


def chunked_prefill(runtime) -> None:
    """Make `runtime.run_layers` (the one layer loop every prefill goes through) process more
    than `prefill_chunk` rows as consecutive chunks when called from a worker's engine thread
    (what it runs, its turns and chunk size are that thread's: `_current`), handing the turn
    over between chunks. Causal attention makes chunk-major order equal to one pass
    (each chunk's keys/values are in the cache before the next chunk attends to them), and
    the kernels compute every row on its own, so the cache, the captures and the logits are
    the same. Installed once per runtime; calls from other threads are untouched."""
    if getattr(runtime, "_selfspec_chunked", False):
        return
    layers = runtime.run_layers  # the bound method

    def run_layers(h, start, end, pos, cache, skip_attn=frozenset(), skip_mlp=frozenset(), capture=None):
        job = getattr(_current, "job", None)
        step = getattr(_current, "chunk", 0)
        if job is None or h.shape[0] <= step:
            return layers(h, start, end, pos, cache, skip_attn, skip_mlp, capture)
        outs, parts = [], {i: [] for i in capture or ()}
        for s in range(0, h.shape[0], step):  # h [T, H] -> chunks [<=step, H] at positions pos+s..
            if s:
                _current.turns.pause(job)
                if job.cancelled.is_set():
                    raise Cancelled()
            piece = None if capture is None else dict.fromkeys(capture)
            outs.append(layers(h[s : s + step], start, end, pos + s, cache, skip_attn, skip_mlp, piece))
            for i in parts:
                parts[i].append(piece[i])
        for i, p in parts.items():
            capture[i] = torch.cat(p)
        return torch.cat(outs)

    runtime.run_layers = run_layers  # instance attribute: shadows the method for this runtime only
    runtime._selfspec_chunked = True


def warmup(model, draft) -> None:
    """One short generation: builds the drafter and touches every kernel before traffic."""
    tok = model.tokenizer
    ids = tok("Hello").input_ids if tok is not None else [0]
    ids = [t for t in ids if 0 <= t < model.spec.vocab_size] or [0]
    model.generate(ids, max_new_tokens=2, draft=draft)
