"""Drafters that run (part of) a model token by token: the shared machinery of early exit,
layer skip, quantized copies and draft models. A draft token comes from draft logits over the
full vocabulary or a restricted one (FR-Spec: the most frequent tokens only), greedily or by
sampling, and drafting stops early below a confidence threshold (fixed, or Draft & Verify's
adaptive one) or at an end-of-sequence token."""

from __future__ import annotations

import torch

from selfspec.drafters.base import Draft, Drafter, Step
from selfspec.coupling import gumbel_max, gumbel_token
from selfspec.sampling import SubVocab, distribution


class AdaptiveThreshold:
    """Draft & Verify's rule: track acceptance AR <- 0.5 AR + 0.5 (accepted/drafted); move
    the confidence threshold gamma by eps toward more drafting when AR is above the target
    and toward less when below, smoothed with beta."""

    def __init__(self, gamma: float, target: float = 0.9, eps: float = 0.01, beta: float = 0.9):
        self.gamma, self.target, self.eps, self.beta = gamma, target, eps, beta
        self.rate: float | None = None

    def update(self, accepted: int, drafted: int) -> None:
        if drafted == 0:
            return
        r = accepted / drafted
        self.rate = r if self.rate is None else 0.5 * self.rate + 0.5 * r
        proposal = self.gamma + (self.eps if self.rate < self.target else -self.eps)
        self.gamma = min(max(self.beta * self.gamma + (1 - self.beta) * proposal, 0.0), 0.999)


class TokenDrafter(Drafter):
    """Subclasses draft with `_choose(logits, step, draft)` once per token; the draft head is
    `draft_head` (prepared LM-head columns for a restricted vocabulary, else None: the full
    head of the runtime that drafts)."""

    def __init__(self, runtime, cfg, eos_ids=()):
        super().__init__(runtime, cfg, eos_ids)
        self.threshold = self._new_threshold()
        self.vocab: torch.Tensor | None = None  # restricted draft vocabulary (sorted ids), if any
        self.sub: SubVocab | None = None  # the same, for sampling (entry -> token and back)
        self.draft_head = None  # [H, N] prepared LM-head columns for `vocab`

    def set_draft_vocab(self, vocab: torch.Tensor | None, head=None, sub: SubVocab | None = None) -> None:
        """Draft over `vocab` (sorted ids; None: all) with `head`: those LM-head columns as the
        runtime multiplies them (prepared or quantized, shared between drafters; None with a
        vocab: prepared here; None without: the runtime's own head). `sub`: vocab's SubVocab
        when the caller keeps one (DraftResources.sub_vocab), else made here. Verification
        always uses the full head."""
        if vocab is not None and head is None:
            head = self.rt.prepare_weight(self.rt.head_columns(vocab).contiguous())
        self.vocab, self.draft_head = vocab, head
        self.sub = None if vocab is None else sub or SubVocab(vocab, self.rt.spec.vocab_size)

    def _new_threshold(self) -> AdaptiveThreshold | None:
        return AdaptiveThreshold(self.cfg.draft_threshold) if self.cfg.draft_threshold is not None else None

    def start(self, cache):
        self.threshold = self._new_threshold()  # adaptation never leaks across generations

    def accepted(self, step, draft, n):
        if self.threshold is not None and self.cfg.adaptive:
            self.threshold.update(n, len(draft.tokens))

    def _take(self, index: int, draft: Draft) -> bool:
        """Append the greedy draft token at draft-head index `index`. -> whether to keep drafting."""
        token = index if self.sub is None else self.sub.tokens[index]  # a list: no torch op per draft token
        draft.tokens.append(token)
        return token not in self.eos_ids

    def _choose(self, logits: torch.Tensor, step: Step, draft: Draft) -> bool:
        """Pick the next draft token from draft logits [N]; append it to `draft` unless its
        confidence is below the threshold. -> whether to keep drafting."""
        if step.drafts_processed:  # the processors at this draft's position (the drafts before it count)
            logits = step.proc.row(logits, draft.tokens, self.sub)
            if step.proc.matcher is not None and logits.max() == float("-inf"):
                return False  # the grammar allows no token of this draft head (a restricted vocabulary): draft nothing more
        if step.sampling.greedy:
            idx = int(logits.argmax())
            if self.threshold is not None and float(logits.softmax(-1)[idx]) < self.threshold.gamma:
                return False
            token = idx if self.vocab is None else int(self.vocab[idx])
        elif step.key is not None and self.threshold is None:  # Gumbel-max, no confidence to read: no distribution
            token = gumbel_token(logits, step.sampling, step.key, step.pos + 1 + len(draft.tokens), self.sub)
        else:
            q = distribution(logits, step.sampling, self.sub)  # over the full vocabulary's ids
            # the draft token takes position pos + 1 + len(tokens): Gumbel-max with its noise, or a draw
            token = gumbel_max(q, step.key, step.pos + 1 + len(draft.tokens)) if step.key is not None else q.draw(step.rng)
            if self.threshold is not None and q.top_prob() < self.threshold.gamma:
                return False
            draft.dists.append(q)
        draft.tokens.append(token)
        return token not in self.eos_ids
