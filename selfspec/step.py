"""One speculative step, the one both engines take (engine.generate, batch/engine.py):

    draft   = the grammar's forced tokens (free_draft), else drafter.draft(step)
    out     = drafter.verify(step, draft)           # the full model over pending + drafts
    targets = Targets.of(step, draft, out)          # the verifier's word, in one type
    n, nxt  = targets.accept(step, draft)           # greedy prefix / Gumbel-max / rejection
    drafter.accepted(step, draft, n)                # adaptation (not for free drafts)
    targets.commit(step, draft[:n] + [nxt])         # processors' state, logprobs
    -> Outcome(draft, n, nxt, logprobs, times)

speculative_step runs all of it for a drafter that runs its own passes; the batch engine,
which drafts and verifies many sequences in shared passes (batch/passes.py), settles each
sequence's step with `settle` from the verifier's output on.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from selfspec.config import MAX_SPECULATIONS, SamplingConfig
from selfspec.coupling import GumbelPicks
from selfspec.drafters.base import Draft, Drafter, Step
from selfspec.logprobs import TokenLogprob
from selfspec.processors import Argmaxes, ProcessedRows
from selfspec.sampled_head import HeadRows
from selfspec.sampling import PointMass, Rows
from selfspec.verification import coupled_accept, greedy_accept, speculative_accept

# What a verify pass returns for a step's k + 1 positions (Drafter.verify): the rows' argmax
# tokens (greedy, nothing processed or recorded: Runtime.argmax), the screened head's rows
# made on use (picks only, Step.picks_only: sampled_head.HeadRows), or the logits [k + 1, V] fp32.
VerifyOutput = torch.Tensor | list[int] | HeadRows

# Hears how many of a step's drafts the verifier kept: (step, draft, n) -> None (Drafter.accepted).
Hear = Callable[[Step, Draft, int], None]


@dataclass
class Targets:
    """The verifier's word on one step, in the one form acceptance and the processors read.

    rows: the pass's output as it came (VerifyOutput) when the generation has no processors;
    with processors, processors.ProcessedRows over it (row j seen after draft[:j], made on use),
    and `processed` is set. Greedy reads argmax tokens from either, sampling reads rows."""

    rows: VerifyOutput | ProcessedRows
    processed: bool = False

    @classmethod
    def of(cls, step: Step, draft: Draft, out: VerifyOutput) -> Targets:
        """A step's verify output as acceptance reads it: through its processors when it has any."""
        return cls(out) if step.proc is None else cls(step.proc.rows(out, draft.tokens), True)

    def accept(self, step: Step, draft: Draft) -> tuple[int, int]:
        """The verdict on step's draft: the greedy prefix, Gumbel-max coupling (row i's noise at
        position step.pos + 1 + i), or speculative sampling (step.key None). -> (number
        accepted, next token)."""
        rows = self.rows
        if step.sampling.greedy:
            return greedy_accept(draft.tokens, Argmaxes(rows) if self.processed else rows)
        if step.key is not None:  # processed rows keep their distributions when the logprobs read them
            dists = rows.dists(step.sampling) if self.processed and step.proc.top is not None else None
            return coupled_accept(draft.tokens, GumbelPicks(rows, step.sampling, step.key, step.pos + 1, dists))
        dists = rows.dists(step.sampling) if self.processed else Rows(rows, step.sampling)
        return speculative_accept(draft.tokens, draft.dists, dists, step.rng)

    def commit(self, step: Step, tokens: list[int]) -> list[TokenLogprob] | None:
        """The step's accepted drafts and next token join the processors' state; -> their
        logprobs when recorded."""
        if step.proc is None:
            return None
        step.proc.commit(tokens, self.rows)
        return step.proc.logprobs[-len(tokens):] if step.proc.top is not None else None


@dataclass
class Outcome:
    """What one speculative step did: it kept `accepted` drafts of `draft` and added `next_token`
    (a correction, or the bonus when every draft was kept)."""

    draft: Draft
    accepted: int
    next_token: int
    logprobs: list[TokenLogprob] | None = None  # of `tokens`, when the generation records them
    draft_s: float = 0.0  # seconds drafting (speculative_step only)
    verify_s: float = 0.0  # seconds verifying, accepting and committing (speculative_step only)
    tokens: list[int] = field(init=False)  # the step's new tokens: draft.tokens[:accepted] + [next_token]

    def __post_init__(self):
        self.tokens = self.draft.tokens[: self.accepted] + [self.next_token]

    @property
    def drafted(self) -> list[bool]:
        """Per new token: an accepted draft (True) or the verifier's own (False)."""
        return [True] * self.accepted + [False]


def settle(step: Step, draft: Draft, out: VerifyOutput, hear: Hear | None) -> Outcome:
    """A step from its verify output on: accept, let `hear` (the drafter's `accepted`; None:
    nobody) learn how many drafts were kept unless a grammar forced them, commit."""
    targets = Targets.of(step, draft, out)
    n, nxt = targets.accept(step, draft)
    if hear is not None and not draft.free:
        hear(step, draft, n)
    o = Outcome(draft, n, nxt)
    o.logprobs = targets.commit(step, o.tokens)
    return o


def speculative_step(drafter: Drafter, step: Step, remaining: int, clock: Callable[[], float] = time.perf_counter) -> Outcome:
    """One whole step of a drafter that runs its own passes, with `remaining` tokens of budget
    left (step.k already within it); sets step.room (step_room)."""
    step.room = step_room(step.sampling, remaining)
    t0 = clock()
    with torch.inference_mode():
        free = free_draft(step, drafter.max_draft > 0, remaining)
        draft = free or drafter.draft(step)
        t1 = clock()
        out = drafter.verify_foreign(step, draft) if free else drafter.verify(step, draft)
    o = settle(step, draft, out, drafter.accepted)
    o.draft_s, o.verify_s = t1 - t0, clock() - t1
    return o


def free_draft(step: Step, speculative: bool, remaining: int) -> Draft | None:
    """A speculative step's draft when its grammar forces the next tokens (grammar.Matcher.forced):
    those tokens, drafted for free instead of by the drafter, up to MAX_SPECULATIONS; None when it
    forces nothing. Verified like a copy (Drafter.verify_foreign): a token the grammar allows
    alone is accepted whatever the rule, the others as any draft."""
    if not speculative or step.proc is None or step.proc.matcher is None:
        return None
    tokens, _ = step.proc.forced(min(MAX_SPECULATIONS, remaining - 1))
    if not tokens:
        return None
    return Draft(tokens, [PointMass(t) for t in tokens] if not step.sampling.greedy else [], copied=True, free=True)


def step_room(sampling: SamplingConfig, remaining: int) -> int:
    """Step.room of a step that may verify copies past its self-draft (greedy only: a copy is
    accepted with probability p(x) when sampling): MAX_SPECULATIONS drafts, within the budget."""
    return min(MAX_SPECULATIONS, remaining - 1) if sampling.greedy else 0
