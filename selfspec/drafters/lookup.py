"""Prompt lookup: copy the continuation of the longest n-gram (<= max_ngram) that already
occurred in the context and ends with the current suffix (selfspec/lookup.py). The draft is
deterministic, a point mass q = one-hot, which the speculative sampling rule handles exactly."""

from __future__ import annotations

from selfspec.drafters.base import Draft, Drafter, Step
from selfspec.lookup import lookup_continuation
from selfspec.sampling import PointMass


class PromptLookupDrafter(Drafter):
    name = "prompt-lookup"

    def draft(self, step: Step) -> Draft:
        d = Draft(lookup_continuation(step.tokens, self.cfg.max_ngram, step.k), copied=True)
        for i, t in enumerate(d.tokens):  # drafting past an EOS is wasted work
            if t in self.eos_ids:
                d.tokens = d.tokens[: i + 1]
                break
        if not step.sampling.greedy:
            d.dists = [PointMass(t) for t in d.tokens]
        return d
