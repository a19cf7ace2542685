"""Configuration as self-validating dataclasses: one place for every default.

The CLI maps its flags one-to-one onto these fields (see cli.py); the API accepts the same
names as keyword arguments. Invalid values raise SelfSpecError with a one-line message.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields, replace

from selfspec.coercion import ConfigError, ConfigTypeError, coerce_fields, from_dict
from selfspec.errors import SelfSpecError, unknown_choice
from selfspec.strategies import known, names, strategy as strategy_entry

DRAFT_BITS = (8, 4)  # quantized drafting: int8 per output channel, int4 in groups of 64 rows (quant.INT4_GROUP)
MAX_SPECULATIONS = 16  # verify passes stay within the row counts where the CPU kernels are row-invariant
# How a sampled draft is accepted (SamplingConfig.coupling): "gumbel", Gumbel-max coupling (the
# draft and the target take the argmax of their logits plus one noise keyed by seed, position and
# token; a draft is accepted iff it is the target's: the text is autoregressive sampling's with
# that seed whatever drafts it); "rejection", speculative sampling's accept with min(1, p/q) and
# resample (the same distribution, but the sample depends on the draft).
COUPLINGS = ("gumbel", "rejection")
MAX_LOGPROBS = 20  # the most alternatives per token a generation records (OpenAI's top_logprobs bound)


def _sorted_set(values: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(sorted(set(values)))


@dataclass(frozen=True)
class LogitBias:
    """token id -> a value added to its logit (OpenAI's logit_bias; -100 bans, +100 forces)."""

    items: tuple[tuple[int, float], ...] = ()  # (token, bias), ascending token ids

    @classmethod
    def parse(cls, value, name: str = "logit_bias") -> LogitBias:
        """{token: bias} (JSON keys may be strings), [(token, bias), ...] or "token=bias,...". """
        if isinstance(value, str):
            value = [kv.split("=", 1) if "=" in kv else (kv, None) for kv in value.replace(" ", "").split(",") if kv]
        pairs = value.items() if isinstance(value, dict) else value
        try:
            out = {int(t): float(b) for t, b in pairs}
        except (TypeError, ValueError):
            raise ConfigTypeError(f"{name} must map token ids to numbers (e.g. 50256=-100), got {value!r}", name) from None
        if any(t < 0 for t in out) or not all(-100.0 <= b <= 100.0 for b in out.values()):
            raise ConfigError(f"{name} must map token ids (>= 0) to biases in [-100, 100], got {value!r}", name)
        return cls(tuple(sorted(out.items())))


GRAMMARS = ("json_object", "json_schema", "regex", "lark")


@dataclass(frozen=True)
class Grammar:
    """Structured output: the text must match it (grammar.py). kind: GRAMMARS; source: the JSON
    schema (JSON text), the regular expression or the Lark grammar ("" for json_object)."""

    kind: str
    source: str = ""

    def __post_init__(self):
        if self.kind not in GRAMMARS:
            raise ConfigError(unknown_choice("grammar kind", self.kind, GRAMMARS), "grammar")
        if self.kind != "json_object" and not self.source.strip():
            raise ConfigError(f"the {self.kind} grammar is empty", "grammar")

    @classmethod
    def parse(cls, value, name: str = "grammar") -> Grammar:
        """{"kind": ..., "source": ...}, or (kind, source)."""
        try:
            return cls(**value) if isinstance(value, dict) else cls(*value)
        except TypeError:
            raise ConfigTypeError(f"{name} must be {{'kind': ..., 'source': ...}}, got {value!r}", name) from None


# SamplingConfig's logits processors (processors.py), given by name to generate() and the CLI
PROCESSOR_FIELDS = ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "logit_bias", "grammar")


@dataclass(frozen=True)
class SamplingConfig:
    """temperature 0 means greedy; top_k / top_p apply to both draft and target; coupling: how
    a sampled draft is accepted (COUPLINGS). The logits processors (penalties, bias, min_p,
    grammar: processors.py) apply to the target at every position and to the drafts alike."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    coupling: str = "gumbel"  # a seed is one text, whatever drafts it (COUPLINGS)
    presence_penalty: float = 0.0  # OpenAI's: minus this from the logit of every token generated so far
    frequency_penalty: float = 0.0  # OpenAI's: minus this times how often the token was generated so far
    repetition_penalty: float = 1.0  # transformers': a prompt or generated token's logit / r if > 0, else * r
    min_p: float = 0.0  # keep the tokens with p >= min_p * (the top token's p), after temperature
    logit_bias: LogitBias | None = None  # added to the logits first (OpenAI's logit_bias)
    grammar: Grammar | None = None  # structured output: only tokens the grammar allows

    def __post_init__(self):
        coerce_fields(self)
        if self.coupling not in COUPLINGS:
            raise ConfigError(unknown_choice("coupling", self.coupling, COUPLINGS), "coupling")
        if not (self.temperature >= 0.0) or self.temperature != self.temperature:
            raise ConfigError(f"temperature must be >= 0, got {self.temperature}", "temperature")
        if self.top_k is not None and self.top_k < 1:
            raise ConfigError(f"top_k must be a positive integer, got {self.top_k}", "top_k")
        if self.top_p is not None and not (0.0 < self.top_p <= 1.0):
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ConfigError(f"{name} must be in [-2, 2], got {getattr(self, name)}", name)
        if not 0.0 < self.repetition_penalty <= 10.0:
            raise ConfigError(f"repetition_penalty must be in (0, 10], got {self.repetition_penalty}", "repetition_penalty")
        if not 0.0 <= self.min_p < 1.0:
            raise ConfigError(f"min_p must be in [0, 1), got {self.min_p}", "min_p")
        if self.logit_bias is not None and not self.logit_bias.items:
            object.__setattr__(self, "logit_bias", None)

    @property
    def processed(self) -> bool:
        """Whether any logits processor changes the logits (processors.py)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or (self.min_p and not self.greedy) or self.logit_bias is not None or self.grammar is not None)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def gumbel(self) -> bool:
        """Sampled with Gumbel-max coupling (not greedy, coupling "gumbel")."""
        return not self.greedy and self.coupling == "gumbel"


@dataclass(frozen=True)
class DraftConfig:
    """How to draft. A field the strategy does not use (its registry entry's options:
    strategies.py) must keep its default.

    The field defaults below are the *static* defaults, the last of three sources a strategy
    named without options draws on (SelfSpecModel.draft_config): first the model's profile
    (its best measured options for that strategy: profiles.best_options), then, for a strategy
    that runs bare (quantized, prompt-lookup), a calibrated choice (the predictor ranks the
    options on the model's own continuations of two built-in prompts, with its measured costs:
    predictor/options.py), then these. Options given
    explicitly override only themselves. The static ones: K = 4, the full vocabulary, an int8
    copy with an int8 head, prompt lookup up to 3-grams, no threshold, no lookup first."""

    strategy: str = "auto"  # drafts only while it pays: the model's searched profile, else calibration
    exit_layer: int | None = None  # early-exit: draft with layers 0..exit_layer-1
    num_speculations: int = 4  # K: the most tokens drafted per verify step
    skip_attn: tuple[int, ...] = ()  # layer-skip: attention sub-layers skipped while drafting
    skip_mlp: tuple[int, ...] = ()  # layer-skip: MLP sub-layers skipped while drafting
    draft_threshold: float | None = None  # stop drafting when the draft's top-1 prob falls below
    adaptive: bool = False  # adapt draft_threshold from observed acceptance (Draft & Verify)
    draft_model: str | None = None  # draft-model: path or alias of a smaller model
    draft_vocab: int | None = None  # draft logits over the N most frequent tokens only
    max_ngram: int = 3  # prompt-lookup: longest n-gram to match
    adapter: str | None = None  # exit-adapter: path of the trained adapter (selfspec train --recipe exit-adapter)
    lookup_first: bool = False  # self-drafting strategies: copy a prompt-lookup match when there is one
    draft_bits: int | None = None  # quantized: bits of the draft copy's layers, 8 (the default) or 4
    head_bits: int | None = None  # quantized: bits of the draft head (default: draft_bits)
    base: DraftConfig | None = None  # auto: the draft it gates (None: the model's profile, else calibration)

    def __post_init__(self):
        coerce_fields(self)
        object.__setattr__(self, "skip_attn", _sorted_set(self.skip_attn))
        object.__setattr__(self, "skip_mlp", _sorted_set(self.skip_mlp))
        if not known(self.strategy):
            raise ConfigError(unknown_choice("strategy", self.strategy, names()), "strategy")
        if self.lookup_first and not strategy_entry(self.strategy).self_drafting:
            selfs = ", ".join(n for n in names() if strategy_entry(n).self_drafting)
            raise ConfigError(f"lookup_first combines prompt lookup with {selfs}, not {self.strategy}", "lookup_first")
        used = self.used_fields()
        unused = [f.name for f in fields(self) if f.name != "strategy" and f.name not in used
                  and getattr(self, f.name) != (f.default if f.default is not MISSING else f.default_factory())]
        if unused:
            its = ", ".join(sorted(used)) or "none"
            raise ConfigError(f"{unused[0]} is not used by the {self.strategy} strategy (its options: {its})", unused[0])
        if self.strategy == "quantized":
            object.__setattr__(self, "draft_bits", self.draft_bits or DRAFT_BITS[0])
            object.__setattr__(self, "head_bits", self.head_bits or self.draft_bits)
            for name in ("draft_bits", "head_bits"):
                if getattr(self, name) not in DRAFT_BITS:
                    raise ConfigError(f"{name} must be 8 or 4, got {getattr(self, name)}", name)
        if not 1 <= self.num_speculations <= MAX_SPECULATIONS:
            raise SelfSpecError(f"num_speculations must be in 1..{MAX_SPECULATIONS}, got {self.num_speculations}")
        if self.draft_threshold is not None and not 0.0 <= self.draft_threshold < 1.0:
            raise SelfSpecError(f"draft_threshold must be in [0, 1), got {self.draft_threshold}")
        if self.adaptive and self.draft_threshold is None:
            object.__setattr__(self, "draft_threshold", 0.5)
        if self.draft_vocab is not None and self.draft_vocab < 1:
            raise SelfSpecError(f"draft_vocab must be positive, got {self.draft_vocab}")
        if self.max_ngram < 1:
            raise SelfSpecError(f"max_ngram must be >= 1, got {self.max_ngram}")
        if self.strategy == "early-exit" and self.exit_layer is None:
            raise SelfSpecError("early-exit needs an exit layer (--exit-layer E)")
        if self.strategy == "exit-adapter" and not self.adapter:
            raise SelfSpecError("exit-adapter needs --adapter FILE (train one with: selfspec train --recipe exit-adapter)")
        if self.strategy == "layer-skip" and not (self.skip_attn or self.skip_mlp):
            raise SelfSpecError("layer-skip needs sub-layers to skip (--skip-attn / --skip-mlp or a profile)")
        if self.base is not None:
            if self.base.strategy in ("auto", "autoregressive"):
                raise SelfSpecError(f"auto cannot gate the {self.base.strategy} strategy")
        if self.strategy == "draft-model" and not self.draft_model:
            raise SelfSpecError("draft-model needs --draft-model PATH")

    def used_fields(self) -> frozenset[str]:
        """The fields this configuration's strategy reads (max_ngram: self-drafters with lookup_first)."""
        if self.strategy == "auto" and self.base is not None:
            return frozenset(("base",))  # the base carries every draft option
        entry = strategy_entry(self.strategy)
        extra = {"max_ngram"} if self.lookup_first and entry.self_drafting else set()
        return entry.options | extra

    def check_model(self, num_layers: int, vocab_size: int) -> None:
        """Checks that need the model's shape."""
        if self.exit_layer is not None and not 1 <= self.exit_layer <= num_layers - 1:
            raise SelfSpecError(f"exit layer must be in 1..{num_layers - 1} for this {num_layers}-layer model, got {self.exit_layer}")
        if self.strategy in ("layer-skip", "quantized"):
            bad = [i for i in self.skip_attn + self.skip_mlp if not 0 <= i < num_layers]
            if bad:
                raise SelfSpecError(f"skip sets name layers {bad} that this {num_layers}-layer model does not have")
            if self.strategy == "layer-skip" and len(self.skip_attn) == num_layers and len(self.skip_mlp) == num_layers:
                raise SelfSpecError("the skip sets skip every sub-layer: the draft would be the embedding alone")
        if self.draft_vocab is not None and self.draft_vocab > vocab_size:
            raise SelfSpecError(f"draft_vocab {self.draft_vocab} exceeds the vocabulary size {vocab_size}")
        if self.base is not None:
            self.base.check_model(num_layers, vocab_size)

    @property
    def speculative(self) -> bool:
        return self.strategy != "autoregressive"

    def draft_head(self) -> tuple[int | None, int | None]:
        """(draft vocabulary size or None for all, bits of the head or None for the model's own)."""
        return self.draft_vocab, self.head_bits if self.strategy == "quantized" else None

    def label(self) -> str:
        """A short readable name, e.g. "quantized int8 K=4 vocab=16384 +lookup" (reports, tables)."""
        s = self.strategy
        parts = [s]
        if s == "quantized":
            parts[0] = f"quantized int{self.draft_bits}" + (f"/head int{self.head_bits}" if self.head_bits != self.draft_bits else "")
        if self.exit_layer is not None and s in ("early-exit", "exit-adapter", "quantized"):
            parts.append(f"E={self.exit_layer}")
        if s in ("layer-skip", "quantized") and (self.skip_attn or self.skip_mlp):
            parts.append(f"attn={','.join(map(str, self.skip_attn)) or '-'} mlp={','.join(map(str, self.skip_mlp)) or '-'}")
        if s == "prompt-lookup" or self.lookup_first:
            parts.append(f"n={self.max_ngram}")
        if s == "draft-model":
            parts.append(str(self.draft_model))
        if s == "auto" and self.base is not None:
            parts.append(f"[{self.base.label()}]")
        elif s not in ("autoregressive", "auto"):
            parts.append(f"K={self.num_speculations}")
        if self.draft_threshold is not None:
            parts.append(f"thr={self.draft_threshold}" + ("(adaptive)" if self.adaptive else ""))
        if self.draft_vocab:
            parts.append(f"vocab={self.draft_vocab}")
        if self.lookup_first:
            parts.append("+lookup")
        return " ".join(parts)

    def explicit_options(self) -> dict:
        """The options that differ from the static defaults (strategy excluded), as given: a
        derived value (head_bits equal to draft_bits) is left out, so that a user's own
        draft_bits also sets the head's."""
        d = {}
        for f in fields(self):
            value = getattr(self, f.name)
            default = f.default if f.default is not MISSING else f.default_factory()
            if f.name == "strategy" or value == default:
                continue
            if f.name == "draft_bits" and value == DRAFT_BITS[0] or f.name == "head_bits" and value == self.draft_bits:
                continue
            if f.name == "draft_threshold" and self.adaptive and value == 0.5:
                continue
            d[f.name] = self.to_dict()[f.name]
        return d

    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["skip_attn"], d["skip_mlp"] = list(self.skip_attn), list(self.skip_mlp)
        d["base"] = None if self.base is None else self.base.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "DraftConfig":
        return from_dict(cls, d, "draft option")

    def replace(self, **changes) -> "DraftConfig":
        return replace(self, **changes)


@dataclass(frozen=True)
class GenerationConfig:
    max_new_tokens: int = 128
    stop: tuple[str, ...] = field(default=())
    chat: bool = False
    stop_token_ids: tuple[int, ...] = ()  # end generation like an EOS token: kept in token_ids, not in text
    logprobs: int | None = None  # record each new token's log-probability and this many top alternatives (0..20)

    def __post_init__(self):
        coerce_fields(self)
        object.__setattr__(self, "stop", tuple(s for s in self.stop if s))
        object.__setattr__(self, "stop_token_ids", _sorted_set(self.stop_token_ids))
        if self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be a positive integer, got {self.max_new_tokens}", "max_new_tokens")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ConfigError(f"logprobs must be in 0..{MAX_LOGPROBS}, got {self.logprobs}", "logprobs")
        if any(t < 0 for t in self.stop_token_ids):
            raise ConfigError(f"stop_token_ids must be token ids (>= 0), got {list(self.stop_token_ids)}", "stop_token_ids")
