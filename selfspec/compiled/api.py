"""The compiled backend as a model: CompiledModel(model).generate / generate_batch, or load(...):
what it runs (a Plan from a DraftConfig, greedy or Gumbel-max sampling) and what it refuses,
each with a one-line reason."""

from __future__ import annotations

import weakref

from selfspec.compiled.engine import CompiledEngine
from selfspec.compiled.step import Plan
from selfspec.config import MAX_SPECULATIONS, DraftConfig, GenerationConfig, SamplingConfig
from selfspec.coupling import noise_key
from selfspec.engine import GenerationResult
from selfspec.errors import SelfSpecError
from selfspec.model import load as load_model
from selfspec.request import Request

_REFUSED = {
    "auto": "auto switches drafting on and off from host measurements; name a strategy (autoregressive, early-exit, layer-skip)",
    "quantized": "quantized drafting is not on the compiled backend yet (int8 drafting via torch._int_mm is unbuilt); use the runtime backend",
    "draft-model": "a second model's step is not compiled; use the runtime backend",
    "prompt-lookup": "prompt lookup searches the context on the host every step; use the runtime backend",
    "exit-adapter": "exit adapters are not compiled; use the runtime backend",
}
_engines: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def plan_of(cfg: DraftConfig) -> Plan:
    """The compiled step's plan for a draft configuration, or a one-line refusal."""
    if cfg.strategy in _REFUSED:
        raise SelfSpecError(f"backend compiled: {cfg.strategy}: {_REFUSED[cfg.strategy]}")
    host = [name for name, on in (("draft_threshold", cfg.draft_threshold is not None), ("adaptive", cfg.adaptive),
                                  ("draft_vocab", cfg.draft_vocab is not None), ("lookup_first", cfg.lookup_first)) if on]
    if host:
        raise SelfSpecError(f"backend compiled: {host[0]} is not supported (a step drafts a fixed K over the full head)")
    if cfg.strategy == "autoregressive" or not cfg.speculative:
        return Plan("autoregressive")
    k = cfg.num_speculations
    if k + 1 > MAX_SPECULATIONS:  # K + 1 verify rows must fit the largest bucket
        raise SelfSpecError(f"backend compiled: num_speculations must be at most {MAX_SPECULATIONS - 1}, got {k}")
    if cfg.strategy == "early-exit":
        return Plan("early-exit", k=k, exit_layer=cfg.exit_layer)
    return Plan("layer-skip", k=k, skip_attn=frozenset(cfg.skip_attn), skip_mlp=frozenset(cfg.skip_mlp))


def check_sampling(sampling: SamplingConfig, gen: GenerationConfig) -> None:
    """One-line refusals of what the compiled step does not compute."""
    if sampling.greedy:
        bad = None
    elif not sampling.gumbel:
        bad = "coupling 'rejection' (the step accepts by Gumbel-max coupling only)"
    elif sampling.top_k is not None or sampling.top_p is not None:
        bad = "top_k / top_p (the step samples the full temperature-scaled distribution)"
    else:
        bad = None
    if bad is None and (sampling.processed or sampling.grammar is not None):
        bad = "logits processors and grammars"
    if bad is None and gen.logprobs is not None:
        bad = "logprobs"
    if bad is not None:
        raise SelfSpecError(f"backend compiled: {bad} not supported; use the runtime backend")


def engine_of(model) -> CompiledEngine:
    """The model's compiled engine (made once per model: its compiled steps are kept)."""
    eng = _engines.get(model)
    if eng is None:
        eng = _engines[model] = CompiledEngine(model.runtime)
    return eng


def generate(model, prompts: list[list[int]], gens: list[GenerationConfig], samplings: list[SamplingConfig],
             cfg: DraftConfig) -> list[GenerationResult]:
    """The generations of already-encoded prompts on the compiled backend, in one batch."""
    plan = plan_of(cfg)
    for s, g in zip(samplings, gens):
        check_sampling(s, g)
    if len({s.temperature for s in samplings}) > 1:
        raise SelfSpecError("backend compiled: one temperature for the whole batch")
    keys = None if samplings[0].greedy else [noise_key(s) for s in samplings]
    return engine_of(model).generate(prompts, gens, plan, keys, samplings[0].temperature, model.tokenizer, model.eos_token_ids)


class CompiledModel:
    """A loaded SelfSpecModel whose generate / generate_batch run on the compiled backend (every
    other attribute is the model's own). `selfspec.compiled.load(...)` or CompiledModel(model)."""

    def __init__(self, model):
        self.model = model

    def __getattr__(self, name):
        return getattr(self.model, name)

    def generate(self, prompt, **options) -> GenerationResult:
        return self.generate_batch([prompt], **options)[0]

    def generate_batch(self, prompts: list, **options) -> list[GenerationResult]:
        """SelfSpecModel.generate_batch's options that the compiled step computes (api's refusals
        say which it does not); result[i] has the tokens generate(prompts[i], ...) gives here."""
        return self.run_batch(Request.batch(self.model, prompts, **options))

    def run(self, request: Request) -> GenerationResult:
        return self.run_batch([request])[0]

    def run_batch(self, requests: list[Request]) -> list[GenerationResult]:
        """Requests (request.py) in one batch on the compiled backend: one draft configuration for all."""
        m = self.model
        rs = [r.fitted(m) for r in requests]
        if not rs:
            return []
        if any(r.on_event is not None for r in rs):
            raise SelfSpecError("backend compiled: on_event (streaming) is not supported; use the runtime backend")
        if len({r.draft for r in rs}) > 1:
            raise SelfSpecError("backend compiled: one draft configuration for the whole batch")
        with m.computing():
            return generate(m, [list(r.prompt_ids) for r in rs], [r.gen for r in rs], [r.sampling for r in rs], rs[0].draft)


def load(source="gemma-3-270m", **kw) -> CompiledModel:
    """selfspec.load(source, **kw) with the compiled backend (CompiledModel)."""
    return CompiledModel(load_model(source, **kw))
