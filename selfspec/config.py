"""Configuration as self-validating dataclasses: one place for every default.

The CLI maps its flags one-to-one onto these fields (see cli.py); the API accepts the same
names as keyword arguments. Invalid values raise SelfSpecError with a one-line message.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

from selfspec.errors import SelfSpecError

STRATEGIES = ("autoregressive", "early-exit", "layer-skip", "exit-adapter", "draft-model", "prompt-lookup", "auto")
SELF_DRAFTING = ("early-exit", "layer-skip", "exit-adapter")
MAX_SPECULATIONS = 16  # verify passes stay within the row counts where the CPU kernels are row-invariant


def _parse_int_set(value) -> tuple[int, ...]:
    if value is None or value == "":
        return ()
    if isinstance(value, str):
        try:
            return tuple(sorted({int(v) for v in value.replace(" ", "").split(",") if v}))
        except ValueError as e:
            raise SelfSpecError(f"expected a comma-separated list of layer indices, got {value!r}") from e
    return tuple(sorted({int(v) for v in value}))


@dataclass(frozen=True)
class SamplingConfig:
    """temperature 0 means greedy; top_k / top_p apply to both draft and target."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None

    def __post_init__(self):
        if not (self.temperature >= 0.0) or self.temperature != self.temperature:
            raise SelfSpecError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k is not None and (not isinstance(self.top_k, int) or self.top_k < 1):
            raise SelfSpecError(f"top_k must be a positive integer, got {self.top_k}")
        if self.top_p is not None and not (0.0 < self.top_p <= 1.0):
            raise SelfSpecError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class DraftConfig:
    """How to draft. Fields that a strategy does not use are ignored by it."""

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
    base: DraftConfig | None = None  # auto: the draft it gates (None: the model's profile, else calibration)

    def __post_init__(self):
        object.__setattr__(self, "skip_attn", _parse_int_set(self.skip_attn))
        object.__setattr__(self, "skip_mlp", _parse_int_set(self.skip_mlp))
        if self.strategy not in STRATEGIES:
            raise SelfSpecError(f"unknown strategy {self.strategy!r}; choose from {', '.join(STRATEGIES)}")
        if not isinstance(self.num_speculations, int) or not 1 <= self.num_speculations <= MAX_SPECULATIONS:
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
        if self.lookup_first and self.strategy not in SELF_DRAFTING:
            raise SelfSpecError(f"lookup_first combines prompt lookup with {', '.join(SELF_DRAFTING)}, not {self.strategy}")
        if self.base is not None:
            if isinstance(self.base, dict):
                object.__setattr__(self, "base", DraftConfig.from_dict(self.base))
            if self.strategy != "auto":
                raise SelfSpecError("only the auto strategy takes a base draft configuration")
            if self.base.strategy in ("auto", "autoregressive"):
                raise SelfSpecError(f"auto cannot gate the {self.base.strategy} strategy")
        if self.strategy == "draft-model" and not self.draft_model:
            raise SelfSpecError("draft-model needs --draft-model PATH")

    def check_model(self, num_layers: int, vocab_size: int) -> None:
        """Checks that need the model's shape."""
        if self.strategy in ("early-exit", "exit-adapter") and self.exit_layer is not None and not 1 <= self.exit_layer <= num_layers - 1:
            raise SelfSpecError(f"exit layer must be in 1..{num_layers - 1} for this {num_layers}-layer model, got {self.exit_layer}")
        if self.strategy == "layer-skip":
            bad = [i for i in self.skip_attn + self.skip_mlp if not 0 <= i < num_layers]
            if bad:
                raise SelfSpecError(f"skip sets name layers {bad} that this {num_layers}-layer model does not have")
            if len(self.skip_attn) == num_layers and len(self.skip_mlp) == num_layers:
                raise SelfSpecError("the skip sets skip every sub-layer: the draft would be the embedding alone")
        if self.draft_vocab is not None and self.draft_vocab > vocab_size:
            raise SelfSpecError(f"draft_vocab {self.draft_vocab} exceeds the vocabulary size {vocab_size}")
        if self.base is not None:
            self.base.check_model(num_layers, vocab_size)

    @property
    def speculative(self) -> bool:
        return self.strategy != "autoregressive"

    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["skip_attn"], d["skip_mlp"] = list(self.skip_attn), list(self.skip_mlp)
        d["base"] = None if self.base is None else self.base.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "DraftConfig":
        names = {f.name for f in fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise SelfSpecError(f"unknown draft option(s): {', '.join(sorted(unknown))}")
        return cls(**d)

    def replace(self, **changes) -> "DraftConfig":
        return replace(self, **changes)


@dataclass(frozen=True)
class GenerationConfig:
    max_new_tokens: int = 128
    stop: tuple[str, ...] = field(default=())
    chat: bool = False

    def __post_init__(self):
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(s for s in (self.stop or ()) if s))
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise SelfSpecError(f"max_new_tokens must be a positive integer, got {self.max_new_tokens}")
