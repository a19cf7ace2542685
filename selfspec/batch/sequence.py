"""One request inside the batch engine: what was asked (a Request, request.py; BatchRequest is
its old name), what the caller holds (BatchHandle), and the engine's per-sequence state
(Sequence).

A sequence drafts through its own drafter object, built exactly as `generate` builds it, so
per-sequence state (thresholds, auto's acceptance counts and back-off, prompt lookup) and the
way sampling consumes its RNG are a solo run's. How the engine drives it is its `kind`, its
strategy's registry entry's `batching` (strategies.py):

  plain   autoregressive: no drafts
  free    prompt lookup: drafts cost nothing (a list scan), made per sequence
  depth   early exit / layer skip / quantized copy: the draft forwards of every such sequence
          with the same draft signature run as one batched call per draft step
  solo    anything else (draft model, exit adapter, lookup-first, auto calibrating on its own
          prefill): the sequence's drafter runs its own forward passes, interleaved with the
          batch; exact, not batched
For auto the kind is its base's; auto's gating then comes from the batch planner (greedy) or
from auto itself (sampling: so that a seed reproduces the solo tokens).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable

import torch

from selfspec.drafters import AutoDrafter, Drafter, LookupFirstDrafter
from selfspec.drafters.base import Draft, Step
from selfspec.engine import GenerationResult, GenerationStats, _Output, count, recorded, sample_token
from selfspec.logprobs import TokenLogprob
from selfspec.lookup import until_eos
from selfspec.coupling import noise_key
from selfspec.processors import Processing
from selfspec.request import Request
from selfspec.sampling import make_rng
from selfspec.step import free_draft, step_room

_ids = itertools.count(1)
COPY_PRIOR = (4.0, 1.0)  # a hot copy's tokens: accepted 0.83-0.87 each on the default model (look_up)


BatchRequest = Request  # its name before the library, the CLI and the server shared one request (request.py)


class BatchHandle:
    """What submit() returns: wait() for the result, cancel() to leave the batch (the slot and
    the KV cache are freed at the next step boundary, or at once when the engine is idle)."""

    def __init__(self, request: Request, engine):
        self.id = next(_ids)
        self.request = request
        self._engine = engine
        self._done = threading.Event()
        self.result: GenerationResult | None = None
        self.error: Exception | None = None  # what ended this request alone (Sequence.fail); result's finish is "error"
        self.cancelled = False

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> GenerationResult | None:
        self._done.wait(timeout)
        return self.result

    def cancel(self) -> None:
        self._engine.cancel(self)

    def _finish(self, result: GenerationResult | None) -> None:
        self.result = result
        self._done.set()


def batch_drafter(d: Drafter) -> Drafter:
    """What drafts in a batch: a greedy-only lookup-first (auto over a profile's self-draft)
    drafts with its self-draft alone there, so the batch drafts it in one forward with the
    other sequences; its sampling is the inner drafter's anyway, so a seed still gives the
    solo tokens, and greedy drafts are the planner's in a batch whatever they would be solo."""
    return d.inner if isinstance(d, LookupFirstDrafter) and d.greedy_only else d


def kind_of(d: Drafter) -> str:
    """How the engine drives a drafter (module doc): its strategy's registry entry says
    (Drafter.batching); auto takes its base's, a greedy-only lookup-first its self-draft's."""
    return d.batching


class Sequence:
    """The engine's state for one request: its KV cache (its own static, position-indexed
    cache, sized as a solo run sizes it), context, output and statistics."""

    BASE_BACKOFF, MAX_BACKOFF = 4, 64  # steps at k = 0 before a 1-token probe (doubling)

    def __init__(self, handle: BatchHandle, drafter: Drafter, cache, tokenizer, eos_ids, clock=time.perf_counter,
                 proc: Processing | None = None):
        req = handle.request
        self.handle, self.req, self.drafter, self.cache = handle, req, drafter, cache
        self.proc = proc  # the request's logits processors and logprobs (processors.py), if any
        self.kind = kind_of(drafter)
        self.rng = make_rng(req.sampling.seed, cache.kt.device)
        self.key = noise_key(req.sampling)
        self.out = _Output(tokenizer, req.gen, eos_ids, req.on_event)
        self.stats = GenerationStats(prompt_tokens=len(req.prompt_ids))
        self.tokens: list[int] = list(req.prompt_ids)
        self.prefilled = 0  # prompt positions whose KV is in the cache
        self.admitted_step = 0  # the engine's step count when it joined (prefill order)
        self.clock = clock
        self.t_start = clock()
        self.t_last: float | None = None  # when the last token was delivered
        self.longest_gap = 0.0
        # decayed accepted / rejected counts (the planner's acceptance estimate); auto's prior
        # (from its profile's measured acceptance) where it has one
        self.A, self.R = drafter.prior if isinstance(drafter, AutoDrafter) else (1.0, 1.0)
        self.idle, self.backoff, self.probing = 0, self.BASE_BACKOFF, False  # the planner's probes (probe)
        self.step: Step | None = None
        self.draft: Draft = Draft()
        self.exit_h: list[torch.Tensor] = []  # early exit: exit hidden states of this step's drafted inputs
        self.planned_k = 0
        # Greedy lookup-first (auto over a profile's self-draft): whether this step drafts a hot
        # copy (look_up), and the decayed accepted / rejected counts of the hot copies drafted
        self.copying = False
        self.Ac, self.Rc = COPY_PRIOR

    # ---- a failure of its own ------------------------------------------------------------------

    def fail(self, e: Exception) -> None:
        """End this sequence alone: no more tokens; retired with `e` at the end of the step."""
        if self.handle.error is None:
            self.handle.error = e
        self.out.finish = "error"

    def attempt(self, fn: Callable, *args):
        """fn(*args) on this sequence's behalf; -> its value, or None when it raised (the
        sequence fails alone: the other sequences of the step go on)."""
        try:
            return fn(*args)
        except Exception as e:
            self.fail(e)
            return None

    @property
    def failed(self) -> bool:
        return self.handle.error is not None

    # ---- what drafts -----------------------------------------------------------------------

    @property
    def auto(self) -> AutoDrafter | None:
        return self.drafter if isinstance(self.drafter, AutoDrafter) else None

    @property
    def actor(self) -> Drafter:
        """The drafter that makes the drafts (auto's base, else the drafter itself)."""
        a = self.auto
        return batch_drafter(a.base if a is not None else self.drafter)

    @property
    def max_draft(self) -> int:
        return self.drafter.max_draft

    @property
    def lookup_first(self) -> LookupFirstDrafter | None:
        """The greedy-only lookup-first drafter the batch drafts through its self-draft (batch_drafter)."""
        d = self.auto.base if self.auto is not None else self.drafter
        return d if isinstance(d, LookupFirstDrafter) and d.greedy_only else None

    @property
    def alpha(self) -> float:
        """The planner's per-token acceptance of this step's draft: of hot copies, or of self-drafts."""
        return self.Ac / (self.Ac + self.Rc) if self.copying else self.A / (self.A + self.R)

    def probe(self, k: int, cap: int) -> int:
        """The planner's k for this sequence, with its probes. Acceptance is only learnt by
        drafting: a sequence the planner keeps at k = 0 drafts one token after a back-off that
        doubles while probes keep failing (auto's rule), so a draft that became good is noticed
        and a bad one costs a few 1-token probes. cap = 0 (the caller's word for "a token would
        not pay even if accepted": rows are dear this step) skips the probe: nothing to learn."""
        if k > 0 or cap <= 0:
            if k > 0 and not self.probing:
                self.backoff = self.BASE_BACKOFF
            self.probing = False
            return k
        self.idle += 1
        if self.idle < self.backoff:
            return 0
        self.idle, self.probing = 0, True
        self.backoff = min(2 * self.backoff, self.MAX_BACKOFF)
        return 1

    def look_up(self) -> list[int]:
        """Greedy lookup-first: the context's prompt-lookup copy (up to step_room tokens, none
        past an EOS); -> it when the sequence is hot, for the batch to draft free, else [].

        Why hot only: a hot copy's tokens are accepted 0.83-0.87 each, a cold one's 0.13-0.33
        (lookup.copy_held), while a batched verify row is dear (at 8 sequences a row costs
        about half of what a token is worth); a cold sequence keeps its self-draft. Alone, lookup-first does
        the same (a hot copy is its draft) and checks cold copies against its self-draft."""
        lf = self.lookup_first
        if lf is None or not self.req.sampling.greedy:
            return []
        copy, hot = lf.look_up(self.tokens, len(self.tokens) - 1, step_room(self.req.sampling, self.remaining))
        return until_eos(copy, lf.eos_ids) if hot else []

    @property
    def argmax_only(self) -> bool:
        """Its passes need the argmax tokens only (greedy, nothing processed or recorded)."""
        return self.req.sampling.greedy and self.proc is None

    @property
    def decoding(self) -> bool:
        return self.prefilled >= len(self.req.prompt_ids) and self.out.finish is None

    @property
    def remaining(self) -> int:
        return self.req.gen.max_new_tokens - len(self.out.ids)

    def start_without_prefill(self) -> None:
        """What the drafter's prefill does besides the forward pass (that one the engine runs,
        batched and chunked): reset per-generation state; auto: its cost table and counters."""
        a = self.auto
        if a is not None:
            a.start_without_prefill(self.cache)
        else:
            self.drafter.start(self.cache)

    def new_step(self) -> Step:
        K = self.max_draft
        if not self.stats.per_position_drafted and K:
            self.stats.per_position_drafted, self.stats.per_position_accepted = [0] * K, [0] * K
        self.step = Step(self.tokens, len(self.tokens) - 1, min(K, self.remaining - 1), self.cache, self.req.sampling, self.rng,
                         key=self.key, proc=self.proc)
        self.draft, self.exit_h = Draft(), []
        self.copying = False
        return self.step

    def draft_free(self) -> bool:
        """This step drafts what its grammar forces, for free (step.free_draft); -> whether it does."""
        d = free_draft(self.step, self.max_draft > 0, self.remaining)
        if d is not None:
            self.draft, self.planned_k = d, len(d.tokens)
        return d is not None

    # ---- results -------------------------------------------------------------------------------

    def pick_first(self, logits: torch.Tensor | int) -> None:
        """The first new token from the prompt's last logits [V] (greedy: its argmax token, as
        prefill gives it), as `generate` picks it."""
        first = sample_token(logits, self.req.sampling, self.rng, self.key, len(self.req.prompt_ids), self.proc)
        now = self.clock()
        self.stats.time_prefill_s = self.stats.time_to_first_token_s = now - self.t_start
        self.tokens.append(first)
        self._deliver([first], [False], now, self._logprobs(1))

    def _logprobs(self, n: int) -> list[TokenLogprob] | None:
        """The logprobs of the last n tokens committed (None: not recorded)."""
        return self.proc.logprobs[-n:] if self.proc is not None and self.proc.top is not None else None

    def commit(self, n: int, nxt: int) -> None:
        """The verifier kept n drafts and added nxt (already committed to the processors: their
        logprobs, when recorded, are the last n + 1)."""
        d = self.draft.tokens
        count(self.stats, self.draft, n)
        learn = not self.draft.free  # a grammar's forced tokens: evidence of neither drafts nor copies
        if d and learn and self.copying:
            self.Ac = 0.9 * self.Ac + n
            self.Rc = 0.9 * self.Rc + (n < len(d))
        elif d and learn:
            self.A = 0.9 * self.A + n
            self.R = 0.9 * self.R + (n < len(d))
        new = d[:n] + [nxt]
        self.tokens.extend(new)
        self._deliver(new, [True] * n + [False], self.clock(), self._logprobs(len(new)))

    def _deliver(self, tokens: list[int], drafted: list[bool], now: float, logprobs=None) -> None:
        if self.t_last is not None:
            self.longest_gap = max(self.longest_gap, now - self.t_last)
        self.t_last = now
        self.out.push(tokens, drafted, logprobs)

    def result(self) -> GenerationResult:
        st = self.stats
        st.time_s = self.clock() - self.t_start
        st.new_tokens = len(self.out.ids)
        st.draft = self.drafter.describe()
        st.longest_stall_s = self.longest_gap
        finish = self.out.finish or "cancelled"
        return GenerationResult(self.out.final_text(), self.out.ids, len(self.req.prompt_ids), finish, st, self.out.drafted,
                                recorded(self.proc, self.out.ids))
