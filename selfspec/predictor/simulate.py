"""Predicting a draft configuration's speedup from measured costs and measured acceptance.

Leviathan et al.: with acceptance alpha per draft token and k drafts per verify step,

    E[N] = (1 - alpha^(k+1)) / (1 - alpha)          tokens per verify step
    S    = E[N] * t_ar / (k * t_draft + t_verify)   speedup over autoregressive

Here both sides come from measurement on the model at hand, not from the formula's
i.i.d. assumption: the costs from predictor.costs.CostModel, and acceptance from `simulate`,
which replays greedy speculative decoding over a *teacher-forced* sequence: for greedy
decoding of a sequence the target itself produced, draft j of a step sees exactly the tokens
the real run would (accepted drafts equal the target's tokens), so walking the sequence with
the per-position agreement array reproduces the real run's accepted lengths step by step.
Only the costs are modelled.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from selfspec.config import DraftConfig
from selfspec.lookup import lookup_continuation
from selfspec.predictor.costs import CostModel
from selfspec.strategies import strategy


def expected_tokens(alpha: float, k: int) -> float:
    """E[N] for i.i.d. acceptance alpha and k drafts (the verifier's token included)."""
    if alpha >= 1.0:
        return k + 1.0
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


@dataclass
class Agreement:
    """A draft's teacher-forced agreement with the target over one token sequence.

    match[t]: the draft made from position t's hidden state equals the target's greedy token
    at t; conf[t]: the draft's top-1 probability there (for threshold drafting)."""

    match: np.ndarray  # bool [T]
    conf: np.ndarray  # float [T]


@dataclass
class Prediction:
    tokens: int = 0
    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    time_s: float = 0.0  # modelled seconds for the walk
    ar_time_s: float = 0.0  # modelled seconds for the same tokens autoregressively

    @property
    def speedup(self) -> float:
        return self.ar_time_s / self.time_s if self.time_s > 0 else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        return self.tokens / self.steps if self.steps else 0.0

    def step(self, drafted: int, accepted: int, seconds: float) -> int:
        """Record one verify step; -> tokens it commits (accepted drafts + the verifier's)."""
        self.time_s += seconds
        self.steps += 1
        self.drafted += drafted
        self.accepted += accepted
        self.tokens += accepted + 1
        return accepted + 1

    def add(self, other: "Prediction") -> "Prediction":
        return Prediction(*(getattr(self, f) + getattr(other, f) for f in ("tokens", "steps", "drafted", "accepted", "time_s", "ar_time_s")))

    def to_dict(self) -> dict:
        return {
            "predicted_speedup": self.speedup,
            "acceptance_rate": self.acceptance_rate,
            "mean_accepted_length": self.mean_accepted_length,
            "tokens": self.tokens,
            "verify_steps": self.steps,
        }


def simulate(cfg: DraftConfig, cal: Agreement, costs: CostModel, adapter_cost: float = 0.0,
             tokens: list[int] | None = None, start: int = 0) -> Prediction:
    """Walk greedy speculative decoding over a teacher-forced sequence (see module doc).

    Position t of `cal` is a pending token whose successor is the target's token t+1; a
    step at pending position p drafts from p, p+1, ... (draft j is right iff match[p+j])
    while j < k and, with a threshold, the draft's confidence is high enough; it accepts
    the leading matches and commits accepted + 1 tokens, like the engine (k is capped so
    a step never commits past the end). With cfg.lookup_first, `tokens` is the whole
    sequence and position t of `cal` is tokens[start + t]: a prompt-lookup match, when there
    is one, is drafted instead and verified by a full pass (a strategy that checks guesses drafts
    its own tokens with the match as a guess: the same drafts, fewer passes)."""
    T, K = len(cal.match), cfg.num_speculations
    gamma = cfg.draft_threshold
    t_draft = costs.draft_token(cfg, adapter_cost)
    out = Prediction()
    p = 0
    while p < T:
        k = min(K, T - p - 1)
        guessed = False
        if cfg.lookup_first and k > 0:
            q = start + p  # absolute index of the pending token
            draft = lookup_continuation(tokens[: q + 1], cfg.max_ngram, k)
            guessed = bool(draft) and strategy(cfg.strategy).checks_guesses
            if draft and not guessed:
                p += out.step(len(draft), _matching_prefix(draft, tokens, q + 1), costs.verify(len(draft) + 1))
                continue
        drafted, stopped = 0, False
        while drafted < k:
            if gamma is not None and cal.conf[p + drafted] < gamma:
                stopped = True  # this position still ran through the draft: its confidence was read
                break
            drafted += 1
        n = 0
        while n < drafted and cal.match[p + n]:
            n += 1
        passes = _guessed_passes(cal, tokens, start + p, p, drafted + stopped, cfg.max_ngram, k) if guessed else drafted + stopped
        p += out.step(drafted, n, passes * t_draft + costs.verify_step(cfg, drafted, exit_cached=stopped))
    out.ar_time_s = out.tokens * costs.ar_step
    return out


def _guessed_passes(cal, tokens: list[int], q: int, p: int, rows: int, max_ngram: int, k: int) -> int:
    """Draft passes of a lookup-first draft that checks guesses (LayerSkipDrafter.
    draft_guessed) producing `rows` draft rows at pending position p (absolute index q).
    While the draft agrees with the target (cal.match) its tokens are the target's, so a copy
    foretells them exactly where it equals the target; past the draft's first disagreement
    its tokens are unknown, and its guesses are taken to fail (one row a pass)."""
    passes, j = 0, 0
    while j < rows:
        passes += 1
        guess = lookup_continuation(tokens[: q + 1 + j], max_ngram, k)[: max(k - j - 1, 0)] if all(cal.match[p : p + j]) else []
        i = 0  # the pass's row i gives draft token j; the next row is usable if guess[i] is that token
        while True:
            j += 1
            if j >= rows or i >= len(guess) or not (cal.match[p + j - 1] and guess[i] == tokens[q + j]):
                break
            i += 1
    return passes


def _matching_prefix(draft: list[int], tokens: list[int], at: int) -> int:
    """How many leading draft tokens equal tokens[at:] (greedy acceptance)."""
    n = 0
    while n < len(draft) and draft[n] == tokens[at + n]:
        n += 1
    return n


def simulate_lookup(cfg: DraftConfig, tokens: list[int], start: int, costs: CostModel) -> Prediction:
    """Prompt lookup over a greedy sequence: tokens[:start] is the prompt and tokens[start:]
    the target's own continuation (tokens[start] came from the prefill). Drafts come from
    the context exactly as at run time, so the walk is the real run's."""

    out = Prediction()
    p, end = start, len(tokens) - 1  # p: index of the pending token
    while p < end:
        k = min(cfg.num_speculations, end - p - 1)
        draft = lookup_continuation(tokens[: p + 1], cfg.max_ngram, k) if k > 0 else []
        p += out.step(len(draft), _matching_prefix(draft, tokens, p + 1), costs.verify(len(draft) + 1))
    out.ar_time_s = out.tokens * costs.ar_step
    return out
