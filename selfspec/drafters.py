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

import time
from dataclasses import dataclass, field, replace

import torch

from selfspec import kernels
from selfspec.adapter import AdapterCache, AdapterWeights
from selfspec.cache import KVCache
from selfspec.config import DraftConfig, SamplingConfig
from selfspec.errors import SelfSpecError
from selfspec.runtime import Runtime
from selfspec.sampling import Dist, PointMass, SubVocab, distribution
from selfspec.lookup import lookup_continuation
from selfspec.predictor.calibrate import prefill_capturing
from selfspec.predictor.simulate import expected_tokens


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
    dists: list[Dist] = field(default_factory=list)  # the distribution each token was drawn from; sampling only


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
        self._sub: SubVocab | None = None  # the same, for sampling (entry -> token and back)
        self._vocab_head: torch.Tensor | None = None  # [H, N] slice of the LM head

    @property
    def max_draft(self) -> int:
        """K: the most tokens one step may draft (known after prefill)."""
        return self.cfg.num_speculations if self.cfg.speculative else 0

    # -- the protocol ---------------------------------------------------------------------

    def prefill(self, ids: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Start a generation and run the prompt; -> logits [V] for the first new token."""
        self.start(cache)
        return self.rt.forward(ids, 0, cache, last_only=True)[0]

    def start(self, cache: KVCache) -> None:
        """Reset per-generation state (adaptation never leaks across generations)."""
        if self.cfg.draft_threshold is not None:
            self.threshold = AdaptiveThreshold(self.cfg.draft_threshold)

    def draft(self, step: Step) -> Draft:
        return Draft()

    def verify(self, step: Step, draft: Draft) -> torch.Tensor:
        ids = torch.tensor([step.tokens[-1], *draft.tokens], device=self.rt.device)
        return self.rt.forward(ids, step.pos, step.cache)

    def verify_foreign(self, step: Step, draft: Draft) -> torch.Tensor:
        """Verify drafts this drafter did not make (prompt lookup's): a full forward pass."""
        return Drafter.verify(self, step, draft)

    def accepted(self, step: Step, draft: Draft, n: int) -> None:
        if self.threshold is not None and self.cfg.adaptive:
            self.threshold.update(n, len(draft.tokens))

    # -- shared helpers -------------------------------------------------------------------

    def set_draft_vocab(self, vocab: torch.Tensor | None, head=None) -> None:
        """Restrict draft logits to `vocab` (ids); verification always uses the full head.
        `head`: those columns of the LM head, prepared (shared between drafters; made here if None)."""
        self._set_vocab(vocab)
        if vocab is not None and head is None:
            head = self.rt.prepare_weight(self.rt.head_columns(vocab).contiguous())
        self._vocab_head = None if vocab is None else head

    def _set_vocab(self, vocab: torch.Tensor | None) -> None:
        self._vocab = vocab
        self._sub = None if vocab is None else SubVocab(vocab, self.rt.spec.vocab_size)

    def _draft_logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.rt.logits(h, head=self._vocab_head)[0]

    def _choose(self, logits: torch.Tensor, step: Step, draft: Draft) -> bool:
        """Pick the next draft token from draft logits [N]; append it to `draft` unless its
        confidence is below the threshold. -> whether to keep drafting."""
        if step.sampling.greedy:
            idx = int(logits.argmax())
            if self.threshold is not None and float(logits.softmax(-1)[idx]) < self.threshold.gamma:
                return False
            token = idx if self._vocab is None else int(self._vocab[idx])
        else:
            q = distribution(logits, step.sampling, self._sub)  # over the full vocabulary's ids
            token = q.draw(step.rng)
            if self.threshold is not None and q.top_prob() < self.threshold.gamma:
                return False
            draft.dists.append(q)
        draft.tokens.append(token)
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

    def _exit_hidden(self, tokens, pos: int, cache: KVCache) -> torch.Tensor:
        """Layers 0..E-1 over tokens (ids) at positions pos.. (their KV written): -> [T, H]."""
        ids = torch.as_tensor(tokens, device=self.rt.device)
        return self.rt.run_layers(self.rt.embed(ids), 0, self.exit, pos, cache)

    def draft(self, step: Step) -> Draft:
        d = Draft()
        self._exit_h = []
        token = step.tokens[-1]
        for j in range(step.k):
            h = self._exit_hidden([token], step.pos + j, step.cache)  # [1, H]
            self._exit_h.append(h)
            if not self._choose(self._draft_logits(self._head_input(h, step.pos + j)), step, d):
                break
            token = d.tokens[-1]
        return d

    def _head_input(self, h: torch.Tensor, pos: int) -> torch.Tensor:
        """What the head drafts from, for exit hidden states h [T, H] at positions pos.."""
        return h

    def verify(self, step: Step, draft: Draft) -> torch.Tensor:
        inputs = [step.tokens[-1], *draft.tokens]
        j = len(self._exit_h)
        if j < len(inputs):  # inputs not yet through layers < E: the last draft, or drafts from elsewhere
            self._exit_h.append(self._exit_hidden(inputs[j:], step.pos + j, step.cache))
            self._exits_written(self._exit_h[-1], step.pos + j)
        h = torch.cat(self._exit_h)  # [k+1, H]
        h = self.rt.run_layers(h, self.exit, self.rt.num_layers, step.pos, step.cache)
        return self.rt.logits(h)

    def _exits_written(self, h: torch.Tensor, pos: int) -> None:
        """Hook: exit hidden states h [T, H] at positions pos.. were computed outside drafting."""

    def verify_foreign(self, step: Step, draft: Draft) -> torch.Tensor:
        """The same pass as verify, through the exit, so this drafter's per-position state
        stays complete."""
        self._exit_h = []
        return self.verify(step, draft)


class ExitAdapterDrafter(EarlyExitDrafter):
    """Kangaroo-style: early exit with a small trained block between layer E-1 and the head
    (selfspec/adapter.py). Everything else, the shared KV and the exit-query cache included,
    is early exit's; the exit-query cache keeps the *un*adapted hidden states, which are what
    layer E of the full model consumes. An adapter with attention also keeps its own keys
    and values per position (AdapterCache), written wherever exit hidden states are made:
    the prompt, every draft input, the inputs verification runs through layers < E."""

    name = "exit-adapter"

    def __init__(self, runtime, cfg, eos_ids=(), adapter=None):
        if adapter is None:
            raise SelfSpecError("exit-adapter strategy needs a loaded adapter")
        super().__init__(runtime, cfg, eos_ids)
        self.adapter = adapter
        self._kv: AdapterCache | None = None
        self._kv_len = 0  # positions 0.._kv_len-1 have adapter keys/values
        # bf16 CPU runtime: the block's matmuls through the kernel with bf16 (packed) copies
        # of its matrices (~0.1 ms per draft token instead of ~4 ms of fp32 torch ops). Only
        # the drafts change, never the verified output.
        w = adapter.weights()
        if runtime.uses_kernels:
            w = AdapterWeights(**{name: None if t is None else runtime.prepare_weight(t.detach().to(runtime.dtype).contiguous())
                                  for name, t in vars(w).items()})
            self._matmul = kernels.matmul
        else:
            self._matmul = torch.matmul
        self._weights = w

    @property
    def attends(self) -> bool:
        return self.adapter.meta.heads > 0

    def start(self, cache):
        super().start(cache)
        if self.attends:
            self._kv = AdapterCache(self.adapter.meta, cache.capacity, self.rt.device)
            self._kv_len = 0

    def prefill(self, ids, cache):
        if not self.attends:
            return super().prefill(ids, cache)
        self.start(cache)
        h = self._exit_hidden(ids, 0, cache)  # [P, H]
        self._exits_written(h, 0)
        h = self.rt.run_layers(h, self.exit, self.rt.num_layers, 0, cache)
        return self.rt.logits(h[-1:])[0]

    def _catch_up(self, step: Step) -> None:
        """Context this drafter has not seen (a prefill it did not run, e.g. auto's
        calibration pass): its exit hidden states again, for the adapter's keys/values.
        Layers < E rewrite identical KV: every row is computed on its own."""
        if self.attends and self._kv_len < step.pos:
            self._exits_written(self._exit_hidden(step.tokens[self._kv_len : step.pos], self._kv_len, step.cache), self._kv_len)

    def draft(self, step):
        self._catch_up(step)
        return super().draft(step)

    def verify_foreign(self, step, draft):
        self._catch_up(step)
        return super().verify_foreign(step, draft)

    def _exits_written(self, h, pos):
        if self.attends:
            self._head_input(h, pos)

    def _head_input(self, h, pos):
        out = self.adapter.block(h, self._weights, self._matmul, pos, self._kv)
        if self.attends and pos <= self._kv_len:  # the cache stays gap-free from position 0
            self._kv_len = max(self._kv_len, pos + h.shape[0])
        return out


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
        d = Draft(lookup_continuation(step.tokens, self.cfg.max_ngram, step.k))
        for i, t in enumerate(d.tokens):  # drafting past an EOS is wasted work
            if t in self.eos_ids:
                d.tokens = d.tokens[: i + 1]
                break
        if not step.sampling.greedy:
            d.dists = [PointMass(t) for t in d.tokens]
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
            if self._vocab is not None:  # the draft model has its own head: restrict its logits
                logits = logits[self._vocab]
            self.dpos += len(feed)
            if not self._choose(logits, step, d):
                break
            feed = [d.tokens[-1]]
        return d

    def set_draft_vocab(self, vocab, head=None):
        """The draft model has its own head: restrict its logits (see draft), no target slice."""
        self._set_vocab(vocab)

    def accepted(self, step, draft, n):
        super().accepted(step, draft, n)
        # Valid draft KV: the context up to the pending token plus the n accepted drafts.
        self.dpos = min(self.dpos, step.pos + 1 + n)


NEAR_TIE = 0.03


class AutoDrafter(Drafter):
    """Draft only while it pays. Wraps a base drafter (from the model's profile, or chosen
    by calibration) and before each step predicts, for every k <= K,

        S(k) = E[N](alpha, k) * t_ar / (k * t_draft + t_verify(k))

    from a measured CostModel (predictor.costs) corrected online by the ratio of observed to
    modelled step times, and an online acceptance estimate alpha = A / (A + R): decayed
    counts of accepted drafts and of rejections (greedy acceptance stops at the first
    rejection, so each step is A += n, R += [n < drafted]). It drafts with the best k, or
    not at all when no k beats plain decoding; then it re-probes with k = 1 after a
    back-off that doubles (up to MAX_BACKOFF steps) while probes keep failing. A bad draft
    thus costs a few k = 1 probes, and output never changes: every step is verified."""

    name = "auto"
    DECAY = 0.9  # per drafting step, on A and R: recent acceptance matters most
    BASE_BACKOFF, MAX_BACKOFF = 8, 128
    PRIOR = (1.0, 1.0)  # without calibration, alpha starts at 0.5, worth two observations
    PRIOR_WEIGHT = 4.0

    def __init__(self, runtime, cfg, eos_ids=(), base: Drafter | None = None, costs=None,
                 choose_base=None, capture_exits: tuple[int, ...] = (), prior: tuple[float, float] | None = None,
                 timing: bool = True):
        super().__init__(runtime, cfg, eos_ids)
        self.base, self.costs = base, costs
        self.choose_base = choose_base  # (ids, captured hidden states) -> Drafter, without a base
        self.capture_exits = capture_exits
        self.prior = prior or self.PRIOR
        self.timing = timing  # correct the cost model by observed step times (greedy only)
        self.decisions: list[int] = []  # k chosen per step (0 = plain decoding), for stats/tests

    @property
    def max_draft(self) -> int:
        return self.base.cfg.num_speculations if self.base is not None else self.cfg.num_speculations

    def prefill(self, ids, cache):
        self._reset()
        if self.choose_base is None:
            self._model_costs()
            return self.base.prefill(ids, cache)
        # No profile: the prefill itself keeps the hidden states calibration scores, so
        # choosing a draft costs only a few head evaluations, not a second pass.
        logits, captured = prefill_capturing(self.rt, ids, cache, self.capture_exits)
        self.base, alpha = self.choose_base(ids.tolist(), captured)
        if alpha is not None:  # calibration measured acceptance: start from it, worth PRIOR_WEIGHT steps
            self.A, self.R = self.PRIOR_WEIGHT * alpha, self.PRIOR_WEIGHT * (1 - alpha)
        self.base.start(cache)
        self._model_costs()
        return logits

    def _model_costs(self) -> None:
        """Modelled seconds of a step drafting k tokens, k = 0..K, for this generation's base:
        fixed per generation, so the per-step decision is arithmetic only."""
        c, cfg = self.costs, self.base.cfg
        self._spec_s = [k * c.draft_token(cfg) + c.verify_step(cfg, k, exit_cached=False) for k in range(self.max_draft + 1)]

    def _reset(self) -> None:
        self.A, self.R = self.prior
        self.wait, self.backoff = 0, self.BASE_BACKOFF
        self.scale_ar = self.scale_spec = 1.0  # observed / modelled step time
        self.decisions = []
        self._clock = time.perf_counter

    def predicted(self, k: int) -> float:
        """Predicted speedup of drafting k tokens this step."""
        alpha = self.A / (self.A + self.R)
        return expected_tokens(alpha, k) * self.costs.ar_step * self.scale_ar / (self._spec_s[k] * self.scale_spec)

    def _best_k(self, kmax: int) -> tuple[int, float]:
        """The longest k within NEAR_TIE of the best prediction (fixed per-step costs the
        model leaves out, the engine's bookkeeping, favour fewer, longer steps), and its
        predicted speedup."""
        preds = [self.predicted(k) for k in range(1, kmax + 1)]
        top = max(preds)
        k = max(k for k, p in enumerate(preds, 1) if p >= top * (1 - NEAR_TIE))
        return k, preds[k - 1]

    def _plan(self, limit: int) -> int:
        if limit <= 0:
            return 0
        best, speedup = self._best_k(min(self.max_draft, limit))
        if speedup >= 1.0:
            return best
        if self.wait > 0:
            self.wait -= 1
            return 0
        return 1  # probe

    def draft(self, step):
        k = self._plan(step.k)
        self._k, self._t0 = k, self._clock()
        return self.base.draft(replace(step, k=k))  # k = 0 still resets the base's per-step state

    def verify(self, step, draft):
        return self.base.verify(step, draft)

    def accepted(self, step, draft, n):
        self.base.accepted(step, draft, n)
        d = len(draft.tokens)
        elapsed = self._clock() - self._t0
        self.decisions.append(self._k)
        # Observed/modelled time corrects the cost model online. Greedy only: when sampling,
        # the choice of k decides how the RNG is consumed, and a seed must reproduce the
        # output, so decisions there depend on acceptance and the (per-model) costs alone.
        timing = self.timing and step.sampling.greedy
        if self._k == 0 or d == 0:  # a plain decoding step (or a draft that came back empty)
            if timing:
                self.scale_ar = 0.8 * self.scale_ar + 0.2 * elapsed / self.costs.ar_step
            return
        if timing:
            self.scale_spec = 0.8 * self.scale_spec + 0.2 * elapsed / self._spec_s[d]
        self.A = self.DECAY * self.A + n
        self.R = self.DECAY * self.R + (n < d)
        if self._best_k(self.max_draft)[1] >= 1.0:
            self.backoff = self.BASE_BACKOFF
        else:  # this step (a probe, or drafting that stopped paying): back off
            self.wait = self.backoff
            self.backoff = min(2 * self.backoff, self.MAX_BACKOFF)


class LookupFirstDrafter(Drafter):
    """Prompt lookup when the context has a match (free drafts), else the wrapped
    self-drafter. The wrapped drafter verifies lookup drafts too (verify_foreign: a full
    forward pass, or early exit's split one), so any per-position state it keeps stays whole."""

    def __init__(self, inner: Drafter, cfg: DraftConfig):
        super().__init__(inner.rt, cfg, tuple(inner.eos_ids))
        self.inner = inner
        lookup = DraftConfig("prompt-lookup", num_speculations=cfg.num_speculations, max_ngram=cfg.max_ngram)
        self.lookup = PromptLookupDrafter(inner.rt, lookup, tuple(inner.eos_ids))
        self.name = f"{inner.name}+lookup"
        self._from_lookup = False

    def prefill(self, ids, cache):
        return self.inner.prefill(ids, cache)

    def start(self, cache):
        self.inner.start(cache)

    def set_draft_vocab(self, vocab, head=None):
        self.inner.set_draft_vocab(vocab, head)

    def draft(self, step):
        d = self.lookup.draft(step) if step.k > 0 else Draft()
        self._from_lookup = bool(d.tokens)
        return d if d.tokens else self.inner.draft(step)

    def verify(self, step, draft):
        return self.inner.verify_foreign(step, draft) if self._from_lookup else self.inner.verify(step, draft)

    def accepted(self, step, draft, n):
        if not self._from_lookup:  # the adaptive threshold follows the self-drafter's own drafts
            self.inner.accepted(step, draft, n)


def make_drafter(runtime: Runtime, cfg: DraftConfig, eos_ids=(), draft_runtime: Runtime | None = None,
                 adapter=None) -> Drafter:
    """The drafter for cfg (auto is built by SelfSpecModel, which owns profiles and costs)."""
    cfg.check_model(runtime.num_layers, runtime.spec.vocab_size)
    if cfg.strategy == "auto":
        raise SelfSpecError("the auto strategy is built by SelfSpecModel.drafter (it needs the model's profile and costs)")
    if cfg.lookup_first:  # the inner self-drafter's own configuration has no lookup part
        inner = make_drafter(runtime, cfg.replace(lookup_first=False, max_ngram=DraftConfig.max_ngram), eos_ids, draft_runtime, adapter)
        return LookupFirstDrafter(inner, cfg)
    if cfg.strategy == "exit-adapter":
        return ExitAdapterDrafter(runtime, cfg, eos_ids, adapter)
    cls = {
        "autoregressive": Drafter,
        "early-exit": EarlyExitDrafter,
        "layer-skip": LayerSkipDrafter,
        "prompt-lookup": PromptLookupDrafter,
    }.get(cfg.strategy)
    if cfg.strategy == "draft-model":
        return DraftModelDrafter(runtime, cfg, eos_ids, draft_runtime)
    return cls(runtime, cfg, eos_ids)
