"""One request: a prompt's token ids and how to continue it (GenerationConfig, SamplingConfig,
the draft), built and validated in one place for the library, the CLI and the server.

    req = Request.build(model, "def f(x):", max_new_tokens=64, temperature=0.8, seed=1)
    model.run(req)                                     # what model.generate("def f(x):", ...) runs
    model.run_batch(Request.batch(model, prompts, seed=[1, 2, 3]))
    engine.submit(req)                                 # selfspec.batch.BatchEngine

`configs` is the one place keyword options become configs (generate's keywords, the CLI's
flags one-to-one, the server's fields once parsed); `Request.build` adds the prompt, encoded
by the model. A request's draft is a DraftConfig, or a DraftChoice: a strategy, a profile and
options not yet resolved, which the model that runs the request resolves against itself
(SelfSpecModel.draft_config: a named strategy starts from that model's best measured options).
`fitted(model)` is the request as a model runs it; every runner (SelfSpecModel.run, the batch
engine's submit) takes it so.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any

from selfspec import strategies
from selfspec.config import PROCESSOR_FIELDS, DraftConfig, GenerationConfig, Grammar, SamplingConfig
from selfspec.engine import StreamEvent
from selfspec.errors import SelfSpecError, unknown_choice
from selfspec.profiles import Profile

if TYPE_CHECKING:
    from selfspec.model import SelfSpecModel

DRAFT_FIELDS = frozenset(f.name for f in fields(DraftConfig))


def check_draft_options(strategy: str | None, options: dict) -> None:
    """What can be checked of a draft choice without the model: its option names and strategy."""
    unknown = set(options) - DRAFT_FIELDS
    if unknown:
        raise SelfSpecError(f"unknown option(s): {', '.join(sorted(unknown))}")
    if strategy is not None and not strategies.known(strategy):
        raise SelfSpecError(unknown_choice("strategy", strategy, strategies.names()))


def _frozen(value):
    return tuple(value) if isinstance(value, list) else value


@dataclass(frozen=True)
class DraftChoice:
    """A draft named but not yet resolved: generate's strategy=, profile= and draft options,
    resolved by the model that runs it (`resolve`: SelfSpecModel.draft_config). Nothing named:
    the model's default (auto). Options given as None count as not given."""

    strategy: str | None = None
    profile: str | Profile | None = None
    options: tuple[tuple[str, Any], ...] = ()  # (name, value), sorted by name; given as a dict or pairs

    def __post_init__(self):
        opts = dict(self.options)
        check_draft_options(self.strategy, opts)
        object.__setattr__(self, "options", tuple(sorted((k, _frozen(v)) for k, v in opts.items() if v is not None)))

    def resolve(self, model: SelfSpecModel) -> DraftConfig:
        return model.draft_config(self.strategy, self.profile, **dict(self.options))


def _items(value):
    """stop / stop_token_ids as given: None -> (), a string left for the field's coercion ("106,1"), else a tuple."""
    if value is None:
        return ()
    return value if isinstance(value, str) else tuple(value)


def configs(
    model: SelfSpecModel | None = None,
    *,
    max_new_tokens: int = GenerationConfig.max_new_tokens,
    temperature: float = SamplingConfig.temperature,
    top_k: int | None = SamplingConfig.top_k,
    top_p: float | None = SamplingConfig.top_p,
    seed: int | None = SamplingConfig.seed,
    coupling: str = SamplingConfig.coupling,
    stop: Sequence[str] | str | None = GenerationConfig.stop,
    stop_token_ids: Sequence[int] | None = GenerationConfig.stop_token_ids,
    logprobs: int | None = GenerationConfig.logprobs,
    chat: bool = GenerationConfig.chat,
    strategy: str | None = None,
    profile: str | Profile | None = None,
    draft: DraftConfig | DraftChoice | None = None,
    **options,
) -> tuple[GenerationConfig, SamplingConfig, DraftConfig | DraftChoice]:
    """Keyword options as (GenerationConfig, SamplingConfig, draft): every request's options
    become configs here, each default being its dataclass's. options: the logits processors
    (SamplingConfig's presence_penalty, frequency_penalty, repetition_penalty, min_p,
    logit_bias, grammar; json_schema=dict|str for a JSON-schema grammar) and the draft options
    (DraftConfig's fields). The draft: draft=, or what strategy/profile/draft options name
    (a DraftChoice, resolved against `model` when one is given; checked as far as it can be
    without it otherwise). logprobs=N records every new token's log-probability and its N most
    likely alternatives (result.logprobs)."""
    gen = GenerationConfig(max_new_tokens=max_new_tokens, stop=_items(stop), chat=chat, stop_token_ids=_items(stop_token_ids),
                           logprobs=logprobs)
    processors = {k: options.pop(k) for k in list(options) if k in PROCESSOR_FIELDS}
    if "json_schema" in options:
        schema = options.pop("json_schema")
        if processors.get("grammar") is not None:
            raise SelfSpecError("pass either grammar= or json_schema=, not both")
        processors["grammar"] = Grammar("json_schema", schema if isinstance(schema, str) else json.dumps(schema))
    if draft is not None and (strategy is not None or profile is not None or options):
        raise SelfSpecError("pass either draft=DraftConfig(...) or strategy/profile/draft options, not both")
    if draft is None:
        draft = DraftChoice(strategy, profile, options)
    if model is not None and isinstance(draft, DraftChoice):
        draft = draft.resolve(model)
    sampling = SamplingConfig(temperature=float(temperature), top_k=top_k, top_p=top_p, seed=seed, coupling=coupling,
                              **processors)
    return gen, sampling, draft


@dataclass(frozen=True)
class Request:
    """A prompt's token ids and how to continue them. Build one with `Request.build` (text,
    messages or ids, and configs' keyword options) or directly from configs; a model runs it
    as `fitted` makes it."""

    prompt_ids: tuple[int, ...]  # given as any sequence of ints
    gen: GenerationConfig = field(default_factory=GenerationConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    draft: DraftConfig | DraftChoice = field(default_factory=DraftChoice)  # default: the model's own (auto)
    on_event: Callable[[StreamEvent], None] | None = None  # each committed token, from the thread that runs it

    def __post_init__(self):
        if isinstance(self.prompt_ids, (str, bytes)):
            raise SelfSpecError("a Request's prompt_ids are token ids (Request.build encodes text)")
        try:
            ids = tuple(int(t) for t in self.prompt_ids)
        except (TypeError, ValueError):
            raise SelfSpecError(f"a Request's prompt_ids must be token ids, got {self.prompt_ids!r}") from None
        if not ids:
            raise SelfSpecError("the prompt is empty")
        object.__setattr__(self, "prompt_ids", ids)
        for name, kind in (("gen", GenerationConfig), ("sampling", SamplingConfig), ("draft", (DraftConfig, DraftChoice))):
            if not isinstance(getattr(self, name), kind):
                want = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
                raise SelfSpecError(f"a Request's {name} must be a {want}, got {type(getattr(self, name)).__name__}")
        if self.on_event is not None and not callable(self.on_event):
            raise SelfSpecError("a Request's on_event must be callable")

    @classmethod
    def build(cls, model: SelfSpecModel, prompt, *, on_event: Callable[[StreamEvent], None] | None = None,
              **options) -> Request:
        """The request for `prompt` (text, token ids, or with chat=True one user turn or a list
        of messages under the chat template) with configs' keyword options (max_new_tokens,
        temperature, top_k, top_p, seed, coupling, stop, stop_token_ids, logprobs, chat,
        strategy, profile, draft, the processors, json_schema, the draft options), fitted to
        `model`: the draft resolved, the budget cut to the context left after the prompt."""
        gen, sampling, draft = configs(model, **options)
        return cls(model.encode(prompt, gen.chat), gen, sampling, draft, on_event).fitted(model)

    @classmethod
    def batch(cls, model: SelfSpecModel, prompts: Sequence, *, seed: int | Sequence[int | None] | None = None,
              on_event: Callable[[int, StreamEvent], None] | None = None, **options) -> list[Request]:
        """Request.build for each prompt with the same options, the draft resolved once for all;
        `seed` may be a list, one per prompt; on_event(index, event)."""
        per_prompt = isinstance(seed, (list, tuple))
        gen, sampling, draft = configs(model, seed=None if per_prompt else seed, **options)
        seeds = list(seed) if per_prompt else [seed] * len(prompts)
        if len(seeds) != len(prompts):
            raise SelfSpecError(f"{len(seeds)} seeds for {len(prompts)} prompts")
        out = []
        for i, (prompt, s) in enumerate(zip(prompts, seeds)):
            cb = None if on_event is None else (lambda e, i=i: on_event(i, e))
            out.append(cls(model.encode(prompt, gen.chat), gen, replace(sampling, seed=s) if per_prompt else sampling, draft,
                           cb).fitted(model))
        return out

    def fitted(self, model: SelfSpecModel) -> Request:
        """This request as `model` runs it: a DraftChoice resolved (SelfSpecModel.draft_config),
        the prompt checked against the vocabulary and the context, and the budget cut to what
        the context leaves after the prompt. Itself when nothing changes."""
        draft = self.draft.resolve(model) if isinstance(self.draft, DraftChoice) else self.draft
        model.check_prompt(self.prompt_ids)
        budget = min(self.gen.max_new_tokens, model.context_length - len(self.prompt_ids))
        gen = self.gen if budget == self.gen.max_new_tokens else replace(self.gen, max_new_tokens=budget)
        return self if draft is self.draft and gen is self.gen else replace(self, gen=gen, draft=draft)
