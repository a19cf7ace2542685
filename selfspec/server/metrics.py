"""Prometheus metrics and the one outcome each request ends with.

Every request is recorded exactly once, by `Metrics.record(endpoint, outcome, ...)`; the
same status goes to /metrics (selfspec_requests{status}), the access log line (the status
and `outcome=`) and /health (`outcomes`). A client that leaves before its response is
complete is status 499, outcome client-gone, whether or not its stream had started.
"""

from __future__ import annotations

import threading
import time
from collections import Counter as Tally

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

CLIENT_GONE = 499  # nginx's "client closed request": the status of every request whose client left


class Metrics:
    def __init__(self, model_name: str, fingerprint: str, strategy: str):
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("selfspec_requests", "HTTP requests answered, by endpoint and status", ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("selfspec_prompt_tokens", "Prompt tokens processed", registry=r)
        self.generation_tokens = Counter("selfspec_generation_tokens", "Tokens generated", registry=r)
        self.drafted = Counter("selfspec_draft_tokens", "Draft tokens proposed", registry=r)
        self.accepted = Counter("selfspec_accepted_draft_tokens", "Draft tokens accepted by the verifier", registry=r)
        self.verify_steps = Counter("selfspec_verify_steps", "Verify (full model) steps", registry=r)
        self.cancelled = Counter("selfspec_cancelled_generations", "Requests whose client left before the response was complete",
                                 registry=r)
        self.rejected = Counter("selfspec_rejected_requests", "Requests refused for overload", ["reason"], registry=r)
        self._totals = {"drafted": 0, "accepted": 0, "steps": 0}
        self._lock = threading.Lock()
        self.outcomes: Tally = Tally()  # status -> requests (what /health shows)
        g = Gauge("selfspec_acceptance_rate", "Accepted / drafted tokens since start", registry=r)
        g.set_function(lambda: self._totals["accepted"] / max(self._totals["drafted"], 1))
        g = Gauge("selfspec_mean_accepted_length", "Tokens committed per verify step since start (the verifier's own included)", registry=r)
        g.set_function(lambda: (self._totals["accepted"] + self._totals["steps"]) / self._totals["steps"] if self._totals["steps"] else 0.0)
        self.waiting = Gauge("selfspec_requests_waiting", "Requests admitted and waiting for the engine (clients still there)", registry=r)
        self.running = Gauge("selfspec_requests_running", "Requests holding a batch slot (prefilling or decoding)", registry=r)
        self.batch_size = Gauge("selfspec_batch_size", "Sequences in the engine's continuous batch now", registry=r)
        self.queue_depth = Gauge("selfspec_queue_depth", "Requests waiting for a batch slot (clients still there)", registry=r)
        self.max_batch = Gauge("selfspec_max_batch", "The most sequences one batch step runs (--max-batch)", registry=r)
        self.longest_stall = Gauge("selfspec_longest_stall_seconds",
                                   "The longest batch step while a sequence was decoding (since start)", registry=r)
        self.ttft = Histogram("selfspec_time_to_first_token_seconds", "Request arrival to first generated token",
                              buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60), registry=r)
        self.tpot = Histogram("selfspec_time_per_output_token_seconds", "Mean time per generated token after the first, per request",
                              buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1), registry=r)
        self.latency = Histogram("selfspec_request_latency_seconds", "Request arrival to last token",
                                 buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120), registry=r)
        self.queue_time = Histogram("selfspec_queue_time_seconds", "Time waiting for the engine",
                                    buckets=(0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30), registry=r)
        info = Gauge("selfspec_model_info", "The served model", ["model", "fingerprint", "strategy"], registry=r)
        info.labels(model_name, fingerprint, strategy).set(1)

    def _add_generation(self, stats) -> None:
        self.drafted.inc(stats.drafted)
        self.accepted.inc(stats.accepted)
        self.verify_steps.inc(stats.verify_steps)
        with self._lock:
            self._totals["drafted"] += stats.drafted
            self._totals["accepted"] += stats.accepted
            self._totals["steps"] += stats.verify_steps

    def record(self, endpoint: str, status: int, job=None, results=None, info: dict | None = None) -> None:
        """The request's one outcome: counted here, and written into `info` (the ASGI scope's
        state, which the access log reads) so the log line says the same. job: the request's
        Choices (server.choices); results: its choices' GenerationResults."""
        self.requests.labels(endpoint, str(status)).inc()
        with self._lock:
            self.outcomes[status] += 1
        if status == CLIENT_GONE:
            self.cancelled.inc()
        if results:
            self.prompt_tokens.inc(job.prompt_tokens)
            for j, result in job.run_results():  # greedy choices of a prompt: one run
                self.generation_tokens.inc(len(result.token_ids))
                self._add_generation(result.stats)
                end = j.t_last or time.perf_counter()
                if j.t_first is not None:
                    self.ttft.observe(j.t_first - j.t_arrival)
                    if j.n_tokens > 1:
                        self.tpot.observe((end - j.t_first) / (j.n_tokens - 1))
                self.latency.observe(end - j.t_arrival)
        if info is not None:
            _describe(info, status, job, results)

    def outcome_counts(self) -> dict[str, int]:
        with self._lock:
            return {str(k): v for k, v in sorted(self.outcomes.items())}


def _describe(info: dict, status: int, job, results) -> None:
    info["selfspec_status"] = status
    if status == CLIENT_GONE:
        info["selfspec_outcome"] = "client-gone"
    if job is not None:
        info["selfspec_prompt_tokens"] = job.prompt_tokens
        info["selfspec_strategy"] = job.params.draft.strategy
        if job.t_start is not None:
            info["selfspec_queue_s"] = job.t_start - job.t_arrival
        if job.t_first is not None:
            info["selfspec_ttft_s"] = job.t_first - job.t_arrival
    if results:
        drafted = sum(r.stats.drafted for r in results)
        info["selfspec_completion_tokens"] = sum(len(r.token_ids) for r in results)
        info["selfspec_finish"] = ",".join(r.finish_reason for r in results)
        info["selfspec_acceptance"] = sum(r.stats.accepted for r in results) / drafted if drafted else 0.0
