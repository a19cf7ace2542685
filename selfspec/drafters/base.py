"""The protocol every draft strategy speaks with the engine (engine.py runs it):

    prefill(ids, cache)   -> logits [V] of the prompt's last position; starts a generation
                             (argmax_only=True, greedy: that row's argmax token instead)
    draft(step)           -> Draft: up to step.k proposed tokens (and, when sampling, the
                             distribution each was drawn from)
    verify(step, draft)   -> target logits [len(draft)+1, V] for the pending token and every
                             drafted token, all from the *full* model (greedy: those rows'
                             argmax tokens, list[int], Runtime.argmax)
    accepted(step, draft, n)  the verifier kept n drafts (adaptation, per-position state)
    verify_foreign(step, draft)   verify drafts another drafter made (prompt lookup's, for
                             lookup-first), keeping this drafter's own per-position state whole
    max_draft             K, the most tokens a step may draft (known after prefill)
    describe()            what it drafted with, for the generation's stats

The engine owns the KV cache and passes it in `step`; drafters write to it at positions
step.pos.. and never undo anything: a rejected position is simply overwritten by a later
step (see cache.py). A drafter holds one generation's state; what it drafts *with* (heads,
quantized weights, adapters, costs) is the model's, shared (resources.py). `Drafter` itself
is the degenerate strategy, autoregressive: it drafts nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from selfspec.cache import KVCache
from selfspec.config import DraftConfig, SamplingConfig
from selfspec.processors import Processing
from selfspec.runtime import Runtime
from selfspec.sampling import Dist
from selfspec.strategies import strategy


@dataclass
class Step:
    """What a drafter may look at for one speculative step."""

    tokens: list[int]  # the whole context so far; tokens[-1] is the pending token
    pos: int  # position of the pending token (its KV is not in the cache yet)
    k: int  # the most tokens to draft this step
    cache: KVCache
    sampling: SamplingConfig
    rng: torch.Generator
    room: int = 0  # greedy: the most tokens a draft may hold when those past k are copies (0: k)
    key: int | None = None  # sampling with Gumbel-max coupling: the noise's key (coupling.noise_key); None: draws from rng
    proc: Processing | None = None  # the generation's logits processors / logprobs (processors.py), if any

    @property
    def argmax_only(self) -> bool:
        """Verification needs the argmax tokens only (greedy, nothing processed or recorded)."""
        return self.sampling.greedy and self.proc is None

    @property
    def picks_only(self) -> bool:
        """Verification needs each row's pick only, not the row: its Gumbel-max token (seeded
        coupling) or, with processors, its argmax (greedy); no logprobs recorded. The rows may then
        come through the screened head (sampled_head.py), processed there (processors.ProcessedRow)."""
        if self.proc is not None and self.proc.top is not None:
            return False
        return self.proc is not None if self.sampling.greedy else self.key is not None

    @property
    def drafts_processed(self) -> bool:
        """Draft logits go through the processors too (they change the logits)."""
        return self.proc is not None and self.proc.alters


@dataclass
class Draft:
    tokens: list[int] = field(default_factory=list)
    dists: list[Dist] = field(default_factory=list)  # the distribution each token was drawn from; sampling only
    copied: bool = False  # copied from the context (prompt lookup): free, and no evidence of how a self-draft agrees
    tail: int = 0  # the last `tail` tokens are such copies, past what the self-draft drafted (greedy)
    free: bool = False  # tokens a grammar forced (engine.free_draft): no drafter made them, none hears of them


class Drafter:
    """Autoregressive decoding as a drafter: no drafts, verification is one full step."""

    name = "autoregressive"

    def __init__(self, runtime: Runtime, cfg: DraftConfig, eos_ids: tuple[int, ...] = ()):
        self.rt = runtime
        self.cfg = cfg
        self.eos_ids = set(eos_ids)

    @property
    def max_draft(self) -> int:
        return self.cfg.num_speculations if self.cfg.speculative else 0

    @property
    def batching(self) -> str:
        """How the batch engine drives this drafter (strategies.BATCHINGS): its strategy's entry's."""
        return strategy(self.cfg.strategy).batching

    def prefill(self, ids: torch.Tensor, cache: KVCache, argmax_only: bool = False) -> torch.Tensor | int:
        self.start(cache)
        return self.rt.forward(ids, 0, cache, last_only=True, argmax_only=argmax_only)[0]

    def start(self, cache: KVCache) -> None:
        """Reset per-generation state (nothing here)."""

    def draft(self, step: Step) -> Draft:
        return Draft()

    def verify(self, step: Step, draft: Draft) -> torch.Tensor:
        ids = torch.tensor([step.tokens[-1], *draft.tokens], device=self.rt.device)
        return self.rt.forward(ids, step.pos, step.cache, argmax_only=step.argmax_only, picks_only=step.picks_only)

    def verify_foreign(self, step: Step, draft: Draft) -> torch.Tensor:
        return Drafter.verify(self, step, draft)

    def accepted(self, step: Step, draft: Draft, n: int) -> None:
        pass

    def describe(self) -> dict:
        return {"draft": self.cfg.to_dict(), "label": self.cfg.label()}
