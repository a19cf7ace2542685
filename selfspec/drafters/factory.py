"""Building a generation's drafter from a DraftConfig and the model's shared resources (each
strategy's registry entry builds its own: strategies.py, drafters/strategies.py)."""

from __future__ import annotations

import logging

from selfspec.config import DraftConfig
from selfspec.errors import SelfSpecError
from selfspec.drafters.auto import AutoDrafter
from selfspec.drafters.base import Drafter
from selfspec.drafters.lookup_first import LookupFirstDrafter
from selfspec.predictor.calibrate import AUTO_DRAFT_BITS, AUTO_DRAFT_VOCAB, calibrate, calibration_exits
from selfspec.profiles import installed_profile
from selfspec.resources import DraftResources
from selfspec.strategies import strategy

_log = logging.getLogger("selfspec")
_noted_unrunnable: set[str] = set()


def runs_here(cfg: DraftConfig, rt) -> bool:
    """Whether cfg can draft on this runtime: a strategy that needs the CPU kernels (the
    quantized copy), itself or as auto's base, needs them here, and over a GGUF run natively
    fewer bits than its blocks (ggml_weights.GGMLRuntime.draft_bits)."""
    for c in (cfg, cfg.base):
        if c is not None and strategy(c.strategy).needs_kernels:
            if not rt.uses_kernels or c.draft_bits not in getattr(rt, "draft_bits", (c.draft_bits,)):
                return False
    return True


def build(cfg: DraftConfig, res: DraftResources, eos_ids: tuple[int, ...] = (), vocab: bool = True) -> Drafter:
    """A new drafter for one generation of cfg (its state is its own; the weights it drafts
    with are `res`'s, made on first use): its strategy's registry entry builds it
    (strategies.py). vocab=False: leave cfg.draft_vocab to the caller (set_draft_vocab), e.g.
    without token frequencies."""
    rt = res.runtime
    cfg.check_model(rt.num_layers, rt.spec.vocab_size)
    if cfg.lookup_first:  # the inner self-drafter's own configuration has no lookup part
        inner = build(cfg.replace(lookup_first=False, max_ngram=DraftConfig.max_ngram), res, eos_ids, vocab)
        return LookupFirstDrafter(inner, cfg)
    return strategy(cfg.strategy).build(cfg, res, eos_ids, vocab)


def draft_over(d, res: DraftResources, n: int | None, bits: int | None = None, always: bool = False) -> None:
    """d drafts over the n most frequent tokens (None: all) with res's head for them (its
    weights in `bits`, None: the model's own); nothing to do for n None unless `always`."""
    if n is None and not always:
        return
    vocab, head = res.draft_head(n, bits)
    d.set_draft_vocab(vocab, head, None if vocab is None else res.sub_vocab(vocab))


def make_drafter(runtime, cfg: DraftConfig, eos_ids: tuple[int, ...] = (), draft_runtime=None, adapter=None) -> Drafter:
    """A drafter of cfg on a runtime alone, with no model around (tests, experiments): the draft
    model's runtime and the adapter are given, and a restricted vocabulary is set by the caller
    (set_draft_vocab). auto needs a model's profile and costs: SelfSpecModel.drafter."""
    if cfg.strategy == "auto":
        raise SelfSpecError("the auto strategy is built by SelfSpecModel.drafter (it needs the model's profile and costs)")
    res = DraftResources(runtime, fingerprint="")
    if draft_runtime is not None:
        res.provide_draft_model(cfg.draft_model, draft_runtime)
    if adapter is not None:
        res.provide_adapter(cfg.adapter, adapter)
    return build(cfg, res, eos_ids, vocab=False)


def costs_for(cfg: DraftConfig, res: DraftResources):
    """The measured costs a drafter of cfg is modelled with (its draft head and quantized copy)."""
    return res.cost_model(heads=(cfg.draft_head(),), bits=(cfg.draft_bits,) if cfg.strategy == "quantized" else ())


def profile_prior(prof) -> tuple[float, float] | None:
    """auto's starting acceptance counts (A, R) from the acceptance its profile measured,
    worth AutoDrafter.PRIOR_WEIGHT steps: without it every generation starts at alpha = 0.5
    and spends its first ~25 steps drafting short (default model: a quarter of the steps at k < 5,
    auto slower than the same draft at a fixed K)."""
    m = prof.metrics or {}
    alpha = m.get("measured_acceptance_rate", m.get("acceptance_rate"))
    if not isinstance(alpha, (int, float)) or not 0.0 < alpha < 1.0:
        return None
    w = AutoDrafter.PRIOR_WEIGHT
    return w * float(alpha), w * (1.0 - float(alpha))


def build_auto(cfg: DraftConfig, res: DraftResources, eos_ids: tuple[int, ...] = ()) -> AutoDrafter:
    """auto gates cfg.base, else the model's installed profile, else a draft chosen per prompt
    by calibration (predictor/calibrate.py)."""
    rt = res.runtime
    base_cfg, source, prior = cfg.base, "given", None
    if base_cfg is None:
        prof = installed_profile(res.fingerprint, shared=True, repo_id=res.repo_id)
        if prof is not None and not runs_here(prof.draft, rt):
            if res.fingerprint not in _noted_unrunnable:  # once per model and process
                _noted_unrunnable.add(res.fingerprint)
                _log.warning("selfspec: note: this model's profile drafts with a quantized copy, which cannot run here "
                             "(%s); auto chooses a draft per prompt instead", "the GGUF runs on its own blocks: int4 copies only"
                             if rt.uses_kernels else f"it needs selfspec's CPU kernels, unavailable here: {rt.kernels_missing()}")
            prof = None
        if prof is not None:
            base_cfg, source = (prof.draft.base if prof.draft.strategy == "auto" else prof.draft), "profile"
            prior = profile_prior(prof)
    if base_cfg is not None:
        base = build(base_cfg, res, eos_ids)
        if source == "profile" and strategy(base_cfg.strategy).self_drafting and not base_cfg.lookup_first:
            # greedy decoding takes a prompt-lookup match first (free drafts, which auto's
            # acceptance estimate leaves out: Draft.copied), or, over a quantized copy, as a
            # guess of that draft's own tokens (greedy and sampling: LookupFirstDrafter)
            base = LookupFirstDrafter(base, base_cfg, greedy_only=True)  # reported as the profile's draft
        return AutoDrafter(rt, cfg, eos_ids, base=base, costs=costs_for(base_cfg, res), source=source, prior=prior)
    n = cfg.draft_vocab
    if n is None and rt.spec.vocab_size > 2 * AUTO_DRAFT_VOCAB and res.has_token_order():
        n = AUTO_DRAFT_VOCAB  # FR-Spec: on a big vocabulary the full draft head would dominate
    # The quantized copy needs the kernels; it is made at the first calibration and
    # kept by the resources, as is its int8 head.
    bits = AUTO_DRAFT_BITS if rt.uses_kernels and AUTO_DRAFT_BITS in getattr(rt, "draft_bits", (AUTO_DRAFT_BITS,)) else None
    costs = res.cost_model(heads=((n, None),) * bool(n) + ((n, bits),) * bool(bits), bits=(bits,) * bool(bits))
    vocab, head = res.draft_head(n) if n else (None, None)

    def choose_base(ids: list[int], captured: dict, cache) -> tuple[Drafter, float | None]:
        quantized = (bits, res.quantized(bits), res.draft_head(n, bits)[::-1], cache) if bits else None
        chosen, pred = calibrate(rt, ids, costs, cfg, captured, head, vocab, n, quantized)
        alpha = None if pred is None or not pred.drafted else pred.acceptance_rate
        return build(chosen, res, eos_ids), alpha

    return AutoDrafter(rt, cfg, eos_ids, costs=costs, choose_base=choose_base, capture_exits=calibration_exits(rt.num_layers))
