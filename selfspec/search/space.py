"""The search space: what a trial may choose (SearchConfig bounds it), sampled define-by-run so
each strategy draws only its own parameters (see the package doc)."""

from __future__ import annotations

from dataclasses import dataclass

from selfspec.config import DRAFT_BITS, DraftConfig
from selfspec.errors import SelfSpecError
from selfspec.tools.datasets import load_dataset

STRATEGIES = ("early-exit", "layer-skip", "prompt-lookup", "exit-adapter", "quantized")
OBJECTIVES = ("predicted", "measured")
DRAFT_VOCABS = (8192, 16384, 32768)
MAX_K = 8


@dataclass(frozen=True)
class SearchConfig:
    strategies: tuple[str, ...] = ("early-exit", "layer-skip", "prompt-lookup", "quantized")
    n_trials: int = 60  # total trials in the study (all workers together, earlier runs included)
    objective: str = "predicted"
    dataset: str = "code,text"  # comma-separated prompt sets (see selfspec.tools.datasets)
    num_samples: int = 4  # prompts per set
    max_new_tokens: int = 64  # greedy continuation scored per prompt
    draft_vocabs: tuple[int, ...] = DRAFT_VOCABS  # besides the full vocabulary
    thresholds: bool = True  # also search confidence-threshold drafting
    adapter: str | None = None  # an exit adapter to include (strategy exit-adapter)
    storage: str | None = None  # Optuna storage URL; default: sqlite in the output directory
    study_name: str | None = None  # default: selfspec-<model fingerprint>
    workers: int = 1
    seed: int = 0
    confirm: bool = True  # measure the winner against plain decoding

    def __post_init__(self):
        if isinstance(self.strategies, str):
            object.__setattr__(self, "strategies", tuple(s.strip() for s in self.strategies.split(",") if s.strip()))
        if isinstance(self.draft_vocabs, str):
            try:
                vs = tuple(int(v) for v in self.draft_vocabs.split(",") if v.strip() and v.strip() != "full")
            except ValueError as e:
                raise SelfSpecError(f"--draft-vocabs must be a comma-separated list of sizes, got {self.draft_vocabs!r}") from e
            object.__setattr__(self, "draft_vocabs", vs)
        bad = [s for s in self.strategies if s not in STRATEGIES]
        if bad or not self.strategies:
            raise SelfSpecError(f"search strategies must be among {', '.join(STRATEGIES)}, got {', '.join(bad) or 'none'}")
        if "exit-adapter" in self.strategies and not self.adapter:
            raise SelfSpecError("searching exit-adapter needs --adapter FILE")
        if not isinstance(self.n_trials, int) or self.n_trials < 1:
            raise SelfSpecError(f"the search budget must be at least 1 trial, got {self.n_trials}")
        if self.objective not in OBJECTIVES:
            raise SelfSpecError(f"objective must be one of {', '.join(OBJECTIVES)}, got {self.objective!r}")
        if self.num_samples < 1 or self.max_new_tokens < 2:
            raise SelfSpecError("the calibration set needs at least 1 prompt and 2 new tokens per prompt")
        if self.workers < 1:
            raise SelfSpecError(f"--workers must be >= 1, got {self.workers}")
        if any(v < 1 for v in self.draft_vocabs):
            raise SelfSpecError("draft vocabulary sizes must be positive")


def suggest(trial, cfg: SearchConfig, num_layers: int, vocab_size: int, adapter_exit: int | None) -> DraftConfig:
    """The trial's draft configuration (see the module doc for the space)."""
    strategy = trial.suggest_categorical("strategy", list(cfg.strategies))
    if strategy == "prompt-lookup":
        return DraftConfig("prompt-lookup", num_speculations=trial.suggest_int("lookup_k", 1, MAX_K),
                           max_ngram=trial.suggest_int("max_ngram", 1, 4))
    vocabs = ["full"] + [str(v) for v in cfg.draft_vocabs if v < vocab_size]
    vocab = trial.suggest_categorical("draft_vocab", vocabs)
    draft_vocab = None if vocab == "full" else int(vocab)
    threshold = None
    if cfg.thresholds and trial.suggest_categorical("draft_length", ["fixed", "threshold"]) == "threshold":
        K, threshold = MAX_K, trial.suggest_float("draft_threshold", 0.05, 0.95)
    else:
        K = trial.suggest_int("num_speculations", 1, MAX_K)
    lookup_first = trial.suggest_categorical("lookup_first", [False, True])
    common = dict(num_speculations=K, draft_threshold=threshold, draft_vocab=draft_vocab, lookup_first=lookup_first)
    if strategy == "early-exit":
        return DraftConfig("early-exit", exit_layer=trial.suggest_int("exit_layer", 1, num_layers - 1), **common)
    if strategy == "exit-adapter":
        return DraftConfig("exit-adapter", exit_layer=adapter_exit, adapter=cfg.adapter, **common)
    if strategy == "quantized":
        return _quantized(trial, num_layers, common)
    # How many sub-layers to skip, then which: the n with the highest per-layer priority. Independent
    # yes/no per sub-layer would draw half of them skipped, where drafts are useless.
    attn = _top_n(trial, "attn", num_layers, trial.suggest_int("skip_attn_n", 0, num_layers // 2))
    mlp = _top_n(trial, "mlp", num_layers, trial.suggest_int("skip_mlp_n", 0, num_layers // 2))
    if not attn and not mlp:
        return DraftConfig("autoregressive")  # skipping nothing: the draft is the model itself (scored as plain decoding)
    if len(attn) == num_layers and len(mlp) == num_layers:
        raise ValueError("skips everything")
    return DraftConfig("layer-skip", skip_attn=attn, skip_mlp=mlp, **common)


def _quantized(trial, num_layers: int, common: dict) -> DraftConfig:
    """Bits of the copy's layers and of its head, its depth (all layers, or the first E) and a
    few skipped sub-layers: a low-bit copy agrees almost always at full depth, so the space
    trades a little agreement for cheaper drafts, not the other way round."""
    bits = trial.suggest_categorical("draft_bits", list(DRAFT_BITS))
    head_bits = trial.suggest_categorical("head_bits", list(DRAFT_BITS))
    depth = num_layers
    if trial.suggest_categorical("quant_shape", ["full", "cut"]) == "cut":  # the full copy: half the draws
        depth = trial.suggest_int("quant_depth", max(1, num_layers // 2), num_layers - 1)
        attn = _top_n(trial, "quant_attn", depth, trial.suggest_int("quant_skip_attn_n", 0, depth // 4))
        mlp = _top_n(trial, "quant_mlp", depth, trial.suggest_int("quant_skip_mlp_n", 0, depth // 4))
    else:
        attn = mlp = ()
    return DraftConfig("quantized", draft_bits=bits, head_bits=head_bits, exit_layer=None if depth == num_layers else depth,
                       skip_attn=attn, skip_mlp=mlp, **common)


def seed_trials(cfg: SearchConfig, vocab_size: int) -> list[dict]:
    """Parameters of the trials a new study starts with, one sensible draft per strategy, so
    TPE does not have to find a family's obvious setting by chance (a quantized copy at full
    depth over a restricted head; prompt lookup at K=3)."""
    vocab = next((str(v) for v in sorted(cfg.draft_vocabs) if v >= 16384 and v < vocab_size), "full")
    common = {"draft_vocab": vocab, "num_speculations": 5, "lookup_first": False}
    if cfg.thresholds:
        common["draft_length"] = "fixed"
    seeds = {
        "quantized": {**common, "draft_bits": 8, "head_bits": 8, "quant_shape": "full"},
        "prompt-lookup": {"lookup_k": 3, "max_ngram": 3},
    }
    return [{"strategy": s, **seeds[s]} for s in cfg.strategies if s in seeds]


def _top_n(trial, kind: str, num_layers: int, n: int) -> tuple[int, ...]:
    w = [trial.suggest_float(f"{kind}_priority_{i}", 0.0, 1.0) for i in range(num_layers)]
    return tuple(sorted(sorted(range(num_layers), key=lambda i: -w[i])[:n]))


def cost_parts(cfg: SearchConfig, vocab_size: int) -> tuple[tuple, tuple[int, ...]]:
    """(draft heads (n, bits), quantized copies' bits) whose costs the space needs measured."""
    vocabs = [v for v in cfg.draft_vocabs if v < vocab_size]
    heads = [(v, None) for v in vocabs]
    if "quantized" not in cfg.strategies:
        return tuple(heads), ()
    heads += [(v, b) for v in [*vocabs, None] for b in DRAFT_BITS]
    return tuple(heads), DRAFT_BITS


def calibration_prompts(cfg: SearchConfig) -> list[str]:
    prompts: list[str] = []
    for name in [n.strip() for n in cfg.dataset.split(",") if n.strip()]:
        prompts += [s.prompt for s in load_dataset(name, cfg.num_samples, cfg.seed).samples]
    if not prompts:
        raise SelfSpecError(f"the calibration set {cfg.dataset!r} has no prompts")
    return prompts
