"""Lookup-first: prompt lookup when the context has a match (free drafts, or guesses of the
wrapped self-drafter's own), else the wrapped self-drafter."""

from __future__ import annotations

from selfspec.config import DraftConfig
from selfspec.drafters.base import Draft, Drafter
from selfspec.drafters.lookup import PromptLookupDrafter
from selfspec.lookup import copy_held, lookup_continuation, until_eos
from selfspec.strategies import strategy


class LookupFirstDrafter(Drafter):
    """The copy is the draft, and the wrapped drafter verifies it too (verify_foreign: a full
    forward pass, or early exit's split one), so any per-position state it keeps stays whole;
    its adaptation follows its own drafts only. Except where the wrapped drafter checks
    guesses (its registry entry's checks_guesses: the quantized copy, which agrees with the model far more often
    than a copy is accepted): there the copies are guesses of its own tokens
    (LayerSkipDrafter.draft_guessed: the same draft, the same random numbers, one pass for
    as long as a copy foretells it; after a disagreement, a new lookup of the context with
    what was drafted).

    greedy_only: copies are drafts in greedy decoding only (a copied token is accepted with
    probability p(x) when sampling, so there the self-draft alone does better: default model,
    quantized int8 K=5, greedy faster with copies as drafts, sampling slower; benchmarks/RESULTS.md);
    as guesses they serve sampling too (the same draws: a seed reproduces its output; int8
    K=5 at temperature 0.8, 8-15% less drafting time). auto uses it for a profile's
    self-draft. In greedy decoding a copy that foretold the whole self-draft also lends its
    next tokens to verification (_with_tail; auto sizes that tail from its cost tables), and
    after a copy that held for every token a step committed (lookup.copy_held: the text is
    following its context) the next copy is the draft itself, up to Step.room, with no
    self-draft pass (faster on the default model, auto, code + text; docs/strategies.md)."""

    def __init__(self, inner: Drafter, cfg: DraftConfig, greedy_only: bool = False):
        super().__init__(inner.rt, cfg, tuple(inner.eos_ids))
        self.inner, self.greedy_only = inner, greedy_only
        lookup = DraftConfig("prompt-lookup", num_speculations=cfg.num_speculations, max_ngram=cfg.max_ngram)
        self.lookup = PromptLookupDrafter(inner.rt, lookup, tuple(inner.eos_ids))
        self.name = f"{inner.name}+lookup" + (" (greedy)" if greedy_only else "")
        self._last: tuple[int, list[int]] | None = None  # (pending position, the copy looked up there)

    @property
    def batching(self) -> str:
        """Greedy-only lookup-first drafts with its self-draft alone in a batch (batch/sequence.
        batch_drafter); with copies of its own, it runs its own passes."""
        return self.inner.batching if self.greedy_only else "solo"

    def prefill(self, ids, cache, argmax_only=False):
        self._last = None
        return self.inner.prefill(ids, cache, argmax_only)

    def start(self, cache):
        self.inner.start(cache)
        self._last = None

    def look_up(self, tokens: list[int], pos: int, most: int) -> tuple[list[int], bool]:
        """(copy, hot): up to `most` tokens prompt lookup copies after tokens (pending token at
        pos), and whether the copy looked up at the previous call held for every token committed
        since (lookup.copy_held). The one record of it, for this drafter's steps and for the
        batch engine's, which drafts the copy itself (batch.sequence.Sequence.look_up)."""
        copy = lookup_continuation(tokens, self.lookup.cfg.max_ngram, most)
        hot = self._last is not None and copy_held(self._last[1], tokens[self._last[0] + 1 :])
        self._last = (pos, copy)
        return copy, hot

    def draft(self, step):
        guesses = strategy(self.inner.cfg.strategy).checks_guesses  # a copy then changes only what a draft costs
        if step.k <= 0 or not (step.sampling.greedy or guesses or not self.greedy_only):
            return self.inner.draft(step)
        if guesses:  # the inner draft itself, sped up by copies
            n, k = self.lookup.cfg.max_ngram, step.k
            copy, hot = self.look_up(step.tokens, step.pos, max(k, step.room))  # one scan: the guess and a tail
            if not copy:
                return self.inner.draft(step)
            if hot and step.sampling.greedy and step.room:  # the text follows its context: the copy is the draft
                return Draft(until_eos(copy[: step.room], self.eos_ids), copied=True)
            own = self.inner.draft_guessed(step, lambda drafted: copy[:k] if not drafted else
                                           lookup_continuation(step.tokens + drafted, n, k))
            return self._with_tail(step, own, copy)
        d = self.lookup.draft(step)
        return d if d.tokens else self.inner.draft(step)

    def _with_tail(self, step, own: Draft, copy: list[int]) -> Draft:
        """Greedy: when the copy foretold the whole self-draft, the copy's next tokens go to
        verification too, up to step.room in all (Draft.tail). Where the model repeats its
        context (greedy continuations of small models loop), a copy that held for k tokens
        tends to hold for many more, and verifying a few more rows costs far less than the
        steps they save; each tail token is checked by the full model like any draft."""
        k = len(own.tokens)
        if not step.sampling.greedy or k < step.k or own.tokens[-1] in self.eos_ids or copy[:k] != own.tokens:
            return own
        tail = until_eos(copy[k : step.room], self.eos_ids)
        if not tail:
            return own
        return Draft(own.tokens + tail, own.dists, tail=len(tail))

    def verify(self, step, draft):
        return self.inner.verify_foreign(step, draft) if draft.copied else self.inner.verify(step, draft)

    def verify_foreign(self, step, draft):
        return self.inner.verify_foreign(step, draft)

    def accepted(self, step, draft, n):
        if draft.tail:  # the inner drafter hears of its own tokens only
            own = len(draft.tokens) - draft.tail
            draft, n = Draft(draft.tokens[:own], draft.dists), min(n, own)
        if not draft.copied:
            self.inner.accepted(step, draft, n)
