"""Draft strategies. Each one speaks the same two-call protocol with the engine:

    draft(step)           -> Draft: up to step.k proposed tokens (and, when sampling, the
                             distribution each was drawn from)
    verify(step, draft)   -> target logits [len(draft)+1, V] for the pending token and
                             every drafted token, all from the *full* model

The engine owns the KV cache and passes it in `step`; drafters write to it at positions
step.pos.. and never need to undo anything: a rejected position is simply overwritten by
a later step (see cache.py). `autoregressive` is the degenerate case that drafts nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from selfspec.cache import KVCache
from selfspec.config import DraftConfig, SamplingConfig
from selfspec.errors import SelfSpecError
from selfspec.runtime import Runtime
from selfspec.sampling import probs_from_logits, sample


@dataclass
class Step:
    """What a drafter may look at for one speculative step."""

    tokens: list[int]  # the whole context so far; tokens[-1] is the pending token
    pos: int  # position of the pending token (its KV is not in the cache yet)
    k: int  # the most tokens to draft this step
    cache: KVCache
    sampling: SamplingConfig
    rng: torch.Generator


@dataclass
class Draft:
    tokens: list[int] = field(default_factory=list)
    probs: list[torch.Tensor] = field(default_factory=list)  # each [V]; sampling only

    def probs_tensor(self) -> torch.Tensor:
        return torch.stack(self.probs)


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


class Drafter:
    name = "autoregressive"

    def __init__(self, runtime: Runtime, cfg: DraftConfig, eos_ids: tuple[int, ...] = ()):
        self.rt = runtime
        self.cfg = cfg
        self.eos_ids = set(eos_ids)
        self.threshold = AdaptiveThreshold(cfg.draft_threshold) if cfg.draft_threshold is not None else None
        self._vocab: torch.Tensor | None = None  # restricted draft vocabulary (ids), if any
        self._vocab_head: torch.Tensor | None = None  # [H, N] slice of the LM head

    # -- the protocol ---------------------------------------------------------------------

    def prefill(self, ids: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Start a generation (per-generation state is reset here) and run the prompt;
        -> logits [V] for the first new token."""
        if self.cfg.draft_threshold is not None:  # adaptation never leaks across generations
            self.threshold = AdaptiveThreshold(self.cfg.draft_threshold)
        return self.rt.forward(ids, 0, cache, last_only=True)[0]

    def draft(self, step: Step) -> Draft:
        return Draft()

    def verify(self, step: Step, draft: Draft) -> torch.Tensor:
        ids = torch.tensor([step.tokens[-1], *draft.tokens], device=self.rt.device)
        return self.rt.forward(ids, step.pos, step.cache)

    def accepted(self, step: Step, draft: Draft, n: int) -> None:
        if self.threshold is not None and self.cfg.adaptive:
            self.threshold.update(n, len(draft.tokens))

    # -- shared helpers -------------------------------------------------------------------

    def set_draft_vocab(self, vocab: torch.Tensor | None) -> None:
        """Restrict draft logits to `vocab` (ids); verification always uses the full head."""
        self._vocab = vocab
        self._vocab_head = None if vocab is None else self.rt.prepare_weight(self.rt.head_columns(vocab).contiguous())

    def _draft_logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.rt.logits(h, head=self._vocab_head)[0]

    def _choose(self, logits: torch.Tensor, step: Step, draft: Draft) -> bool:
        """Pick the next draft token from draft logits [N]; append it to `draft` unless its
        confidence is below the threshold. -> whether to keep drafting."""
        vocab_size = self.rt.spec.vocab_size
        if step.sampling.greedy:
            idx = int(logits.argmax())
            if self.threshold is not None and float(logits.softmax(-1)[idx]) < self.threshold.gamma:
                return False
            q = None
        else:
            q_sub = probs_from_logits(logits, step.sampling)
            idx = sample(q_sub, step.rng)
            if self.threshold is not None and float(q_sub.max()) < self.threshold.gamma:
                return False
            if self._vocab is None:
                q = q_sub
            else:  # the draft's distribution over the full vocabulary (zero outside the subset)
                q = torch.zeros(vocab_size, dtype=q_sub.dtype, device=q_sub.device)
                q[self._vocab] = q_sub
        token = idx if self._vocab is None else int(self._vocab[idx])
        draft.tokens.append(token)
        if q is not None:
            draft.probs.append(q)
        return token not in self.eos_ids


class EarlyExitDrafter(Drafter):
    """LayerSkip: draft with layers 0..E-1 + the model's own final norm and head. The draft
    writes the KV of layers < E for every drafted input, and keeps the hidden state leaving
    layer E-1 (the exit-query cache); verification then runs only the last draft through
    layers < E and all k+1 positions through layers E..L-1."""

    name = "early-exit"

    def __init__(self, runtime, cfg, eos_ids=()):
        super().__init__(runtime, cfg, eos_ids)
        self.exit = cfg.exit_layer
        self._exit_h: list[torch.Tensor] = []

    def _exit_hidden(self, token: int, pos: int, cache: KVCache) -> torch.Tensor:
        ids = torch.tensor([token], device=self.rt.device)
        return self.rt.run_layers(self.rt.embed(ids), 0, self.exit, pos, cache)

    def draft(self, step: Step) -> Draft:
        d = Draft()
        self._exit_h = []
        token = step.tokens[-1]
        for j in range(step.k):
            h = self._exit_hidden(token, step.pos + j, step.cache)  # [1, H]
            self._exit_h.append(h)
            if not self._choose(self._draft_logits(h), step, d):
                break
            token = d.tokens[-1]
        return d

    def verify(self, step: Step, draft: Draft) -> torch.Tensor:
        inputs = [step.tokens[-1], *draft.tokens]
        while len(self._exit_h) < len(inputs):  # the last draft has not been through layers < E
            j = len(self._exit_h)
            self._exit_h.append(self._exit_hidden(inputs[j], step.pos + j, step.cache))
        h = torch.cat(self._exit_h)  # [k+1, H]
        h = self.rt.run_layers(h, self.exit, self.rt.num_layers, step.pos, step.cache)
        return self.rt.logits(h)


class LayerSkipDrafter(Drafter):
    """Draft & Verify: the full depth with some attention / MLP sub-layers skipped (their
    residual passes through). Skipped layers write no KV, so verification recomputes every
    layer for the pending token and all drafts in one pass."""

    name = "layer-skip"

    def draft(self, step: Step) -> Draft:
        d = Draft()
        token = step.tokens[-1]
        skip_a, skip_m = frozenset(self.cfg.skip_attn), frozenset(self.cfg.skip_mlp)
        for j in range(step.k):
            ids = torch.tensor([token], device=self.rt.device)
            h = self.rt.run_layers(self.rt.embed(ids), 0, self.rt.num_layers, step.pos + j, step.cache, skip_a, skip_m)
            if not self._choose(self._draft_logits(h), step, d):
                break
            token = d.tokens[-1]
        return d


class PromptLookupDrafter(Drafter):
    """Copy the continuation of the longest n-gram (<= max_ngram) that already occurred in
    the context and ends with the current suffix. The draft is deterministic, i.e. a point
    mass q = one-hot, which the speculative sampling rule handles exactly."""

    name = "prompt-lookup"

    def draft(self, step: Step) -> Draft:
        toks = step.tokens
        d = Draft()
        for n in range(min(self.cfg.max_ngram, len(toks) - 1), 0, -1):
            suffix = toks[-n:]
            # most recent earlier occurrence, scanning backwards
            for start in range(len(toks) - n - 1, -1, -1):
                if toks[start : start + n] == suffix:
                    cont = toks[start + n : start + n + step.k]
                    if cont:
                        d.tokens = list(cont)
                        break
            if d.tokens:
                break
        if d.tokens and not step.sampling.greedy:
            vocab = self.rt.spec.vocab_size
            d.probs = [torch.nn.functional.one_hot(torch.tensor(t, device=self.rt.device), vocab).float() for t in d.tokens]
        for i, t in enumerate(d.tokens):  # drafting past an EOS is wasted work
            if t in self.eos_ids:
                d.tokens, d.probs = d.tokens[: i + 1], d.probs[: i + 1]
                break
        return d


class DraftModelDrafter(Drafter):
    """Classic speculative decoding with a separate, smaller model sharing the tokenizer.
    The draft model keeps its own cache; `self.dpos` counts the context tokens whose KV it
    holds, and each draft first feeds it whatever committed tokens it has not seen."""

    name = "draft-model"

    def __init__(self, runtime, cfg, eos_ids=(), draft_runtime: Runtime | None = None):
        super().__init__(runtime, cfg, eos_ids)
        if draft_runtime is None:
            raise SelfSpecError("draft-model strategy needs a loaded draft model")
        self.draft_rt = draft_runtime
        self.dcache: KVCache | None = None
        self.dpos = 0

    def prefill(self, ids, cache):
        self.dcache = self.draft_rt.new_cache(cache.capacity)
        self.dpos = 0
        return super().prefill(ids, cache)

    def draft(self, step: Step) -> Draft:
        d = Draft()
        V = self.rt.spec.vocab_size
        feed = step.tokens[self.dpos :]
        for _ in range(step.k):
            ids = torch.tensor(feed, device=self.draft_rt.device)
            logits = self.draft_rt.forward(ids, self.dpos, self.dcache, last_only=True)[0]
            if logits.shape[0] != V:  # padded vocabularies: compare over the target's ids
                logits = torch.nn.functional.pad(logits[:V], (0, max(0, V - logits.shape[0])), value=float("-inf"))
            if self._vocab is not None:  # the draft model has its own head: restrict its logits
                logits = logits[self._vocab]
            self.dpos += len(feed)
            if not self._choose(logits, step, d):
                break
            feed = [d.tokens[-1]]
        return d

    def set_draft_vocab(self, vocab):
        """The draft model has its own head: restrict its logits (see draft), no target slice."""
        self._vocab = vocab

    def accepted(self, step, draft, n):
        super().accepted(step, draft, n)
        # Valid draft KV: the context up to the pending token plus the n accepted drafts.
        self.dpos = min(self.dpos, step.pos + 1 + n)


def make_drafter(runtime: Runtime, cfg: DraftConfig, eos_ids=(), draft_runtime: Runtime | None = None) -> Drafter:
    cfg.check_model(runtime.num_layers, runtime.spec.vocab_size)
    cls = {
        "autoregressive": Drafter,
        "early-exit": EarlyExitDrafter,
        "layer-skip": LayerSkipDrafter,
        "prompt-lookup": PromptLookupDrafter,
    }.get(cfg.strategy)
    if cfg.strategy == "draft-model":
        return DraftModelDrafter(runtime, cfg, eos_ids, draft_runtime)
    return cls(runtime, cfg, eos_ids)
