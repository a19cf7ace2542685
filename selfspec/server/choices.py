"""The choices of one request: `n` per prompt (a completions request may send a list of
prompts), one worker Job per sequence of the continuous batch, their events merged into one
queue on the event loop.

Choice i belongs to prompt i // n and is its choice i % n (OpenAI's order: index = prompt * n
+ j). Events of a Choices object, in order: ("start",) when its first sequence gets a batch
slot, ("tok", i, text, logprob) per committed token of choice i (streamed requests; the text
delta may be empty, logprob None without logprobs), then one of ("done", results) once every
sequence has finished (results[i]: choice i's GenerationResult), or the first ("error", exc) /
("cancelled",) / ("skipped",) of any sequence (the others are cancelled then). It quacks like
a Job where the routes, the streams and the metrics read one.

Seeds: choice j of each prompt samples with the request's seed + j (mod 2^64), so choice j is
reproduced alone by the same request with that prompt, n = 1 and seed + j, and a list of
prompts gives what the prompts sent one by one give. Greedy choices of a prompt are one text:
one sequence computes it and stands for all n.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

from selfspec.server.parsing import Params
from selfspec.server.worker import Job


def choice_seed(seed: int | None, i: int) -> int | None:
    """The seed choice i of a prompt samples with (module doc)."""
    if seed is None:
        return None
    s = seed + i
    return s - (1 << 64) if s >= 1 << 64 else s


class _Sink:
    """What a sequence's Job posts into (Job.post calls put_nowait on the event loop)."""

    def __init__(self, choices: Choices, k: int):
        self.choices, self.k = choices, k

    def put_nowait(self, item) -> None:
        self.choices._on(self.k, item)


class Choices:
    def __init__(self, loop: asyncio.AbstractEventLoop, prompts: list[Params] | Params, t_arrival: float | None = None):
        self.prompts = prompts if isinstance(prompts, list) else [prompts]
        self.params = self.prompts[0]  # the request's options: every prompt's but for the prompt itself
        self.n = self.params.n
        self.size = len(self.prompts) * self.n  # choices
        self.runs = 1 if self.params.sampling.greedy else self.n  # sequences per prompt
        self.jobs: list[Job] = []
        self._choices_of: list[range] = []  # per job: the choice indices it computes
        for pi, p in enumerate(self.prompts):
            for r in range(self.runs):
                self.jobs.append(Job(loop, self._params_of(p, r), t_arrival))
                first = pi * self.n + r
                self._choices_of.append(range(first, first + self.n) if self.runs == 1 else range(first, first + 1))
        self.events: asyncio.Queue = asyncio.Queue()
        for k, job in enumerate(self.jobs):
            job.events = _Sink(self, k)
        self.t_arrival = self.jobs[0].t_arrival
        self._results: list = [None] * len(self.jobs)
        self._started = self._ended = False

    @staticmethod
    def _params_of(p: Params, r: int) -> Params:
        if r == 0:
            return p
        # the echo (and its prompt logprobs) is run 0's, the same for every choice of the prompt
        request = replace(p.request, sampling=replace(p.sampling, seed=choice_seed(p.sampling.seed, r)))
        return replace(p, request=request, echo=False)

    def _on(self, k: int, item) -> None:  # the event loop
        if self._ended:
            return
        kind = item[0]
        if kind == "start":
            if not self._started:
                self._started = True
                self.events.put_nowait(item)
        elif kind == "tok":  # ("tok", text, logprob)
            for i in self._choices_of[k]:
                self.events.put_nowait(("tok", i, *item[1:]))
        elif kind == "done":
            self._results[k] = item[1]
            if all(r is not None for r in self._results):
                self._ended = True
                self.events.put_nowait(("done", self.results))
        else:  # error, cancelled, skipped: the request ends with its first
            self._ended = True
            self.events.put_nowait(item)
            for job in self.jobs:
                if job is not self.jobs[k]:
                    job.cancel()

    @property
    def results(self) -> list:
        """Every choice's result, in order (greedy: a prompt's one run's, n times)."""
        out: list = [None] * self.size
        for k, r in enumerate(self._results):
            for i in self._choices_of[k]:
                out[i] = r
        return out

    def run_results(self) -> list[tuple[Job, object]]:
        """(job, its result) per sequence computed (greedy: one per prompt)."""
        return list(zip(self.jobs, self._results))

    def prompt_of(self, i: int) -> Params:
        """The Params of choice i's prompt (its ids and echo)."""
        return self.prompts[i // self.n]

    def prompt_logprobs_of(self, i: int) -> list | None:
        """Choice i's prompt's own logprobs (echo with logprobs)."""
        return self.jobs[(i // self.n) * self.runs].prompt_logprobs

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p.prompt_ids) for p in self.prompts)

    def cancel(self) -> None:
        for job in self.jobs:
            job.cancel()

    # what the metrics and the statistics read of a Job
    @property
    def t_start(self) -> float | None:
        starts = [j.t_start for j in self.jobs if j.t_start is not None]
        return min(starts) if starts else None

    @property
    def t_first(self) -> float | None:
        firsts = [j.t_first for j in self.jobs if j.t_first is not None]
        return min(firsts) if firsts else None
