"""Classic speculative decoding with a separate, smaller model sharing the tokenizer."""

from __future__ import annotations

import torch

from selfspec.cache import KVCache
from selfspec.drafters.base import Draft, Step
from selfspec.drafters.tokenwise import TokenDrafter
from selfspec.runtime import Runtime


class DraftModelDrafter(TokenDrafter):
    """The draft model keeps its own cache; `self.dpos` counts the context tokens whose KV it
    holds, and each draft first feeds it whatever committed tokens it has not seen. A
    restricted draft vocabulary restricts its own head's logits (no slice of the target's)."""

    name = "draft-model"

    def __init__(self, runtime, cfg, eos_ids=(), draft_runtime: Runtime | None = None):
        super().__init__(runtime, cfg, eos_ids)
        self.draft_rt = draft_runtime
        self.dcache: KVCache | None = None
        self.dpos = 0

    def start(self, cache):
        super().start(cache)
        self.dcache = self.draft_rt.new_cache(cache.capacity)
        self.dpos = 0

    def draft(self, step: Step) -> Draft:
        d = Draft()
        V = self.rt.spec.vocab_size
        feed = step.tokens[self.dpos :]
        for _ in range(step.k):
            ids = torch.tensor(feed, device=self.draft_rt.device)
            logits = self.draft_rt.forward(ids, self.dpos, self.dcache, last_only=True)[0]
            if logits.shape[0] != V:  # padded vocabularies: compare over the target's ids
                logits = torch.nn.functional.pad(logits[:V], (0, max(0, V - logits.shape[0])), value=float("-inf"))
            if self.vocab is not None:
                logits = logits[self.vocab]
            self.dpos += len(feed)
            if not self._choose(logits, step, d):
                break
            feed = [d.tokens[-1]]
        return d

    def accepted(self, step, draft, n):
        super().accepted(step, draft, n)
        # Valid draft KV: the context up to the pending token plus the n accepted drafts.
        self.dpos = min(self.dpos, step.pos + 1 + n)
