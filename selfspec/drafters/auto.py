"""auto, the default strategy: draft only while it pays (see AutoDrafter)."""

from __future__ import annotations

import time
from dataclasses import replace

from selfspec.config import MAX_SPECULATIONS
from selfspec.drafters.base import Drafter
from selfspec.predictor.calibrate import prefill_capturing
from selfspec.predictor.simulate import expected_tokens

NEAR_TIE = 0.03


class AutoDrafter(Drafter):
    """Draft only while it pays. Wraps a base drafter (from the model's profile, or chosen
    by calibration) and before each step predicts, for every k <= K,

        S(k) = E[N](alpha, k) * t_ar / (k * t_draft * rho + t_verify(k))

    from a measured CostModel (predictor.costs), a correction rho learnt online (drafting's
    observed/modelled time over verification's, both timed within each step, so the machine's
    drift, which slows both, cancels), and an online acceptance estimate alpha = A / (A + R): decayed
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
    TAIL_PRIOR = (3.0, 1.0)  # a copy that foretold a whole self-draft: its next tokens start at 0.75

    def __init__(self, runtime, cfg, eos_ids=(), base: Drafter | None = None, costs=None,
                 choose_base=None, capture_exits: tuple[int, ...] = (), prior: tuple[float, float] | None = None,
                 timing: bool = True, source: str = "given", clock=time.perf_counter):
        super().__init__(runtime, cfg, eos_ids)
        self.base, self.costs, self._costs_any = base, costs, costs
        self._greedy_costs = False  # self.costs is _costs_any.greedy() (greedy steps: the argmax-only head)
        self.source = source if choose_base is None else "calibrated"  # where the base came from: given | profile | calibrated
        self.choose_base = choose_base  # (ids, captured hidden states, cache) -> (Drafter, alpha), without a base
        self.capture_exits = capture_exits
        self.prior = prior or self.PRIOR
        self._clock = clock
        self.timing = timing  # learn rho from observed step times (greedy only)
        self.decisions: list[int] = []  # k chosen per step (0 = plain decoding), for stats/tests

    @property
    def batching(self) -> str:
        """Its base's way (auto's gating comes from the batch planner, or from auto itself);
        calibrating on its own prefill, or with no base yet: its own passes."""
        return "solo" if self.choose_base is not None or self.base is None else self.base.batching

    @property
    def max_draft(self) -> int:
        return self.base.cfg.num_speculations if self.base is not None else self.cfg.num_speculations

    def prefill(self, ids, cache, argmax_only=False):
        self._reset()
        if self.choose_base is None:
            self._model_costs()
            return self.base.prefill(ids, cache, argmax_only)
        # No profile: the prefill itself keeps the hidden states calibration scores, so
        # choosing a draft costs only a few head evaluations, not a second pass.
        logits, captured = prefill_capturing(self.rt, ids, cache, self.capture_exits, argmax_only)
        self.base, alpha = self.choose_base(ids.tolist(), captured, cache)
        if alpha is not None:  # calibration measured acceptance: start from it, worth PRIOR_WEIGHT steps
            self.A, self.R = self.PRIOR_WEIGHT * alpha, self.PRIOR_WEIGHT * (1 - alpha)
        self.base.start(cache)
        self._model_costs()
        return logits

    def describe(self) -> dict:
        """The draft auto gated this generation (its profile's, the given one, or calibration's
        choice for this prompt), and how many of its steps drafted nothing."""
        if self.base is None:
            return {"draft": None, "label": "auto (no draft chosen yet)", "source": self.source}
        return {"draft": self.base.cfg.to_dict(), "label": f"auto: {self.base.cfg.label()} ({self.source})",
                "source": self.source, "plain_steps": self.decisions.count(0), "steps": len(self.decisions)}

    def _model_costs(self) -> None:
        """Modelled seconds of one draft token and of verifying k drafts, k = 0..K, for this
        generation's base: fixed per generation, so the per-step decision is arithmetic only."""
        c, cfg = self.costs, self.base.cfg
        self._draft_s = c.draft_token(cfg)
        self._verify_s = [c.verify_step(cfg, k, exit_cached=False) for k in range(MAX_SPECULATIONS + 1)]

    def _reset(self) -> None:
        self.A, self.R = self.prior
        self.At, self.Rt = self.TAIL_PRIOR  # decayed counts of copied-tail tokens accepted / tails cut short
        self.wait, self.backoff = 0, self.BASE_BACKOFF
        self.rho = 1.0  # (observed / modelled draft time) / (observed / modelled verify time)
        self.decisions = []

    def predicted(self, k: int) -> float:
        """Predicted speedup of drafting k tokens this step."""
        alpha = self.A / (self.A + self.R)
        return expected_tokens(alpha, k) * self.costs.ar_step / (k * self._draft_s * self.rho + self._verify_s[k])

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
        if step.sampling.greedy != self._greedy_costs and self._costs_any is not None:
            self._greedy_costs = step.sampling.greedy
            self.costs = self._costs_any.greedy() if self._greedy_costs else self._costs_any
            self._model_costs()
        k = self.plan(step.k)
        self.begin_step(k)
        room = k + self.tail_room(k, step.room - k) if k else 0
        return self.base.draft(replace(step, k=k, room=room))  # k = 0 still resets the base's per-step state

    def tail_room(self, k: int, most: int) -> int:
        """How many copied tokens past a k-token self-draft this step may verify (Draft.tail;
        lookup_first makes them where a copy foretold the whole draft): the t <= most that
        maximises the step's predicted rate

            (E[N](alpha, k) + alpha^k sum_{j<=t} beta^j) / (k t_draft rho + t_verify(k + t))

        alpha^k: the chance the tail is reached at all; beta = At / (At + Rt), the learnt
        acceptance of a tail's tokens. Verifying a row more costs little while decoding is
        bandwidth-bound and more once the rows make it compute-bound: the cost tables say where."""
        if most <= 0:
            return 0
        alpha, beta = self.A / (self.A + self.R), self.At / (self.At + self.Rt)
        base, reach, draft_s = expected_tokens(alpha, k), alpha**k, k * self._draft_s * self.rho
        best, best_rate, gain = 0, base / (draft_s + self._verify_s[k]), 0.0
        for t in range(1, min(most, len(self._verify_s) - 1 - k) + 1):
            gain += beta**t
            rate = (base + reach * gain) / (draft_s + self._verify_s[k + t])
            if rate > best_rate:
                best, best_rate = t, rate
        return best

    # -- for engines that run the forward passes themselves (selfspec.batch) --------------

    def start_without_prefill(self, cache) -> None:
        """What prefill does besides the forward pass (the caller runs that one): a base is
        needed already (given or from a profile)."""
        self._reset()
        self._model_costs()
        self.base.start(cache)

    def plan(self, limit: int) -> int:
        """How many tokens to draft this step (0: a plain decoding step), at most `limit`."""
        return self._plan(limit)

    def begin_step(self, k: int) -> None:
        """A step drafting k tokens starts now (accepted() times it)."""
        self._k, self._t0, self._t_verify = k, self._clock(), None

    def verify(self, step, draft):
        self._t_verify = self._clock()  # drafting ends here (accepted() times both parts)
        return self.base.verify(step, draft)

    def _learn_rho(self, drafted: int, verified: int, draft_s: float, verify_s: float) -> None:
        """One step's observation of rho. Its two parts ran milliseconds apart, so a machine
        that slows down or speeds up (shared CPUs drift a lot) moves both alike, where whole
        steps compared with a plain step timed earlier would read drift as draft cost and stop
        drafting for nothing. A part preempted by another process is noise, not cost: one
        observation moves rho by at most a factor 3 ** 0.2."""
        model_draft, model_verify = drafted * self._draft_s, self._verify_s[verified]
        if model_draft <= 0 or model_verify <= 0 or draft_s <= 0 or verify_s <= 0:
            return
        observed = draft_s * model_verify / (model_draft * verify_s)
        step = min(max(observed / self.rho, 1 / 3), 3.0)
        self.rho *= step ** 0.2  # decay 0.8, in log space

    def accepted(self, step, draft, n):
        self.base.accepted(step, draft, n)
        d = len(draft.tokens) - draft.tail  # a copied tail says nothing of the self-draft either
        if draft.tail and n >= d:  # the tail was reached: what its tokens are worth
            self.At = self.DECAY * self.At + (n - d)
            self.Rt = self.DECAY * self.Rt + (n < len(draft.tokens))
        n = min(n, d)
        self.decisions.append(self._k)
        if draft.copied or self._k == 0 or d == 0:  # a lookup copy (free; says nothing of the self-draft), a plain step
            return
        # Greedy only: when sampling, the choice of k decides how the RNG is consumed, and a seed
        # must reproduce the output, so decisions there depend on acceptance and the costs alone.
        # (With Gumbel-max coupling a choice of k cannot change the text, so learning from step
        # times would be allowed there too: not done, unmeasured.)
        # (An engine that runs the passes itself never calls verify(): no split, nothing learnt.)
        if self.timing and step.sampling.greedy and self._t_verify is not None:
            self._learn_rho(d, len(draft.tokens), self._t_verify - self._t0, self._clock() - self._t_verify)
        self.A = self.DECAY * self.A + n
        self.R = self.DECAY * self.R + (n < d)
        if self._best_k(self.max_draft)[1] >= 1.0:
            self.backoff = self.BASE_BACKOFF
        else:  # this step (a probe, or drafting that stopped paying): back off
            self.wait = self.backoff
            self.backoff = min(2 * self.backoff, self.MAX_BACKOFF)
