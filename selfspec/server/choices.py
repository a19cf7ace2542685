"""The n choices of one request (`n` in the body): one worker Job per choice, each a sequence
of the continuous batch, their events merged into one queue on the event loop.

Events of a Choices object, in order: ("start",) when its first choice gets a batch slot,
("tok", i, text, logprob) per committed token of choice i (streamed requests; the text delta
may be empty, logprob None without logprobs), then one of
("done", results) once every choice has finished (results[i]: choice i's GenerationResult),
or the first ("error", exc) / ("cancelled",) / ("skipped",) of any choice (the others are
cancelled then). It quacks like a Job where the routes, the streams and the metrics read one.

Seeds: choice i samples with the request's seed + i (mod 2^64), so choice i of a request is
reproduced alone by the same request with n = 1 and seed + i. Greedy choices are one text:
one sequence computes it and stands for all n.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

from selfspec.server.parsing import Params
from selfspec.server.worker import Job


def choice_seed(seed: int | None, i: int) -> int | None:
    """The seed choice i samples with (module doc)."""
    if seed is None:
        return None
    s = seed + i
    return s - (1 << 64) if s >= 1 << 64 else s


class _Sink:
    """What a choice's Job posts into (Job.post calls put_nowait on the event loop)."""

    def __init__(self, choices: Choices, i: int):
        self.choices, self.i = choices, i

    def put_nowait(self, item) -> None:
        self.choices._on(self.i, item)


class Choices:
    def __init__(self, loop: asyncio.AbstractEventLoop, params: Params, t_arrival: float | None = None):
        self.params, self.n = params, params.n
        self.events: asyncio.Queue = asyncio.Queue()
        runs = 1 if params.sampling.greedy else params.n
        self.jobs = [Job(loop, self._params_of(i), t_arrival) for i in range(runs)]
        for i, job in enumerate(self.jobs):
            job.events = _Sink(self, i)
        self.t_arrival = self.jobs[0].t_arrival
        self._results: list = [None] * runs
        self._started = self._ended = False

    def _params_of(self, i: int) -> Params:
        if i == 0:
            return self.params
        # the echo (and its prompt logprobs) is choice 0's, the same for every choice
        return replace(self.params, sampling=replace(self.params.sampling, seed=choice_seed(self.params.sampling.seed, i)), echo=False)

    def _on(self, i: int, item) -> None:  # the event loop
        if self._ended:
            return
        kind = item[0]
        if kind == "start":
            if not self._started:
                self._started = True
                self.events.put_nowait(item)
        elif kind == "tok":  # ("tok", text, logprob)
            for idx in (range(self.n) if len(self.jobs) == 1 else (i,)):
                self.events.put_nowait(("tok", idx, *item[1:]))
        elif kind == "done":
            self._results[i] = item[1]
            if all(r is not None for r in self._results):
                self._ended = True
                self.events.put_nowait(("done", self.results))
        else:  # error, cancelled, skipped: the request ends with its first
            self._ended = True
            self.events.put_nowait(item)
            for job in self.jobs:
                if job is not self.jobs[i]:
                    job.cancel()

    @property
    def results(self) -> list:
        """Every choice's result, in order (greedy: the one run's, n times)."""
        return self._results * self.n if len(self.jobs) == 1 else list(self._results)

    def cancel(self) -> None:
        for job in self.jobs:
            job.cancel()

    # what the metrics and the statistics read of a Job
    @property
    def t_start(self) -> float | None:
        starts = [j.t_start for j in self.jobs if j.t_start is not None]
        return min(starts) if starts else None

    @property
    def prompt_logprobs(self) -> list | None:
        return self.jobs[0].prompt_logprobs

    @property
    def t_first(self) -> float | None:
        firsts = [j.t_first for j in self.jobs if j.t_first is not None]
        return min(firsts) if firsts else None
