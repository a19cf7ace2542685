"""Training configuration: self-validating dataclasses, one field per `selfspec train` flag.

    TrainConfig(recipe, out, resume,
                data=DataConfig(...), model=ModelConfig(...), layerskip=LayerSkipConfig(...),
                adapter=AdapterConfig(...), loop=LoopConfig(...))

Every field's flag is its name with dashes (`seq_len` -> `--seq-len`); the help text and
choices live in the field's metadata so the CLI is generated from this file (cli.py).
Fields whose default depends on the recipe or on whether the model is trained from scratch
default to None and are resolved by `TrainConfig.resolved()`; everything that can be checked
without the model or the data is checked in `__post_init__` and raises SelfSpecError with a
one-line message.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields, replace

from selfspec.errors import SelfSpecError

RECIPES = ("layerskip", "lm", "exit-adapter")
DROPOUT_SCHEDULES = ("exp", "linear", "uniform")  # D(l): how p grows with depth
DROPOUT_CURRICULA = ("auto", "none", "exp")  # S(t): auto = exp from scratch, none when continuing
EXIT_SCALES = ("uniform", "linear", "sum", "sqrt", "inverse")
EXIT_CURRICULA = ("none", "rotational", "gradual")


def _f(default, help: str, choices: tuple | None = None, **kw):
    return field(default=default, metadata={"help": help, "choices": choices, **kw})


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise SelfSpecError(msg)


def _positive_int(v, name: str, allow_none: bool = False) -> None:
    if v is None and allow_none:
        return
    _check(isinstance(v, int) and not isinstance(v, bool) and v >= 1, f"--{name} must be a positive integer, got {v}")


@dataclass(frozen=True)
class DataConfig:
    data: tuple[str, ...] = _f(
        ("stdlib",),
        "training text: files, directories (*.py *.txt *.md *.rst, recursive), .jsonl (text, or prompt+response: "
        "loss on the response only), hf:NAME[:config]:split, or stdlib (the Python standard library + local docs)",
        nargs="+",
    )
    seq_len: int = _f(256, "tokens per packed training sequence")
    eval_fraction: float = _f(0.02, "share of documents held out for evaluation (deterministic, by document name)")
    eval_sequences: int = _f(32, "held-out sequences used by each evaluation")
    max_tokens: int | None = _f(None, "stop reading training text after this many tokens (default: all of it)")
    text_field: str = _f("text", "jsonl / hf: the field holding plain text")
    prompt_field: str = _f("prompt", "jsonl / hf: the prompt field of prompt/response pairs")
    response_field: str = _f("response", "jsonl / hf: the response field of prompt/response pairs")
    exclude_containing: tuple[str, ...] = _f(
        (), "drop every document that contains this string (repeatable; e.g. benchmark prompts)", action="append"
    )

    def __post_init__(self):
        object.__setattr__(self, "data", tuple(self.data) if not isinstance(self.data, str) else (self.data,))
        object.__setattr__(self, "exclude_containing", tuple(s for s in self.exclude_containing if s))
        _check(len(self.data) > 0, "--data needs at least one source")
        _check(isinstance(self.seq_len, int) and self.seq_len >= 2, f"--seq-len must be an integer >= 2, got {self.seq_len}")
        _check(0.0 <= self.eval_fraction < 0.5, f"--eval-fraction must be in [0, 0.5), got {self.eval_fraction}")
        _positive_int(self.eval_sequences, "eval-sequences")
        _positive_int(self.max_tokens, "max-tokens", allow_none=True)


@dataclass(frozen=True)
class ModelConfig:
    model: str | None = _f(None, "continue training this model: a HF directory or a built-in alias (exit-adapter default: gemma-3-270m)")
    preset: str | None = _f(None, "train from scratch: a built-in Llama shape (training/models.py: llama-tiny, llama-12l, llama-16l)")
    config: str | None = _f(None, "train from scratch: a transformers config.json")
    tokenizer: str | None = _f(None, "from scratch: a directory holding a transformers tokenizer to use")
    train_tokenizer: int | None = _f(None, "from scratch: train a byte-level BPE tokenizer of this vocabulary size on the data (default 8192 when no --tokenizer)")

    def __post_init__(self):
        chosen = [n for n in ("model", "preset", "config") if getattr(self, n)]
        _check(len(chosen) <= 1, f"choose one of --model, --preset, --config (got {', '.join('--' + c for c in chosen)})")
        if self.model and (self.tokenizer or self.train_tokenizer):
            raise SelfSpecError("--tokenizer / --train-tokenizer are for models trained from scratch; --model brings its own")
        _check(not (self.tokenizer and self.train_tokenizer), "choose --tokenizer or --train-tokenizer, not both")
        if self.train_tokenizer is not None:
            _check(isinstance(self.train_tokenizer, int) and 256 + 2 <= self.train_tokenizer <= 1_000_000,
                   f"--train-tokenizer must be a vocabulary size in 258..1000000, got {self.train_tokenizer}")

    @property
    def from_scratch(self) -> bool:
        return self.model is None


@dataclass(frozen=True)
class LayerSkipConfig:
    layer_dropout_max: float = _f(0.2, "p_max: layer dropout rate of the last layer (0 disables layer dropout)")
    layer_dropout_schedule: str = _f("exp", "D(l), how the dropout rate grows with depth", DROPOUT_SCHEDULES)
    layer_dropout_curriculum: str = _f("auto", "S(t), the time curriculum: exp ramps from 0 to 1 over training; auto = exp from scratch, none when continuing", DROPOUT_CURRICULA)
    early_exit_scale: float = _f(1.0, "e_scale: weight of the non-final exits' losses before normalisation (0 = final loss only)")
    early_exit_scale_type: str = _f("sum", "per-layer exit loss weights (torchtune's uniform, linear_l, sum_l, sqrt_l, inv_l)", EXIT_SCALES)
    early_exit_curriculum: str = _f("gradual", "which exits are trained at a step", EXIT_CURRICULA)
    early_exit_rotation: int = _f(4, "rotational curriculum: every R-th layer's exit is active, shifting by one each step")
    early_exit_gradual_fraction: float = _f(0.5, "gradual curriculum: share of training after which every exit is active")
    exit_loss_vocab: int | None = _f(None, "compute the non-final exits' losses over the N most frequent target tokens only (cheaper)")

    def __post_init__(self):
        _check(0.0 <= self.layer_dropout_max < 1.0, f"--layer-dropout-max must be in [0, 1), got {self.layer_dropout_max}")
        _check(self.layer_dropout_schedule in DROPOUT_SCHEDULES, f"--layer-dropout-schedule must be one of {', '.join(DROPOUT_SCHEDULES)}")
        _check(self.layer_dropout_curriculum in DROPOUT_CURRICULA, f"--layer-dropout-curriculum must be one of {', '.join(DROPOUT_CURRICULA)}")
        _check(self.early_exit_scale >= 0.0 and math.isfinite(self.early_exit_scale), f"--early-exit-scale must be >= 0, got {self.early_exit_scale}")
        _check(self.early_exit_scale_type in EXIT_SCALES, f"--early-exit-scale-type must be one of {', '.join(EXIT_SCALES)}")
        _check(self.early_exit_curriculum in EXIT_CURRICULA, f"--early-exit-curriculum must be one of {', '.join(EXIT_CURRICULA)}")
        _positive_int(self.early_exit_rotation, "early-exit-rotation")
        _check(0.0 < self.early_exit_gradual_fraction <= 1.0, f"--early-exit-gradual-fraction must be in (0, 1], got {self.early_exit_gradual_fraction}")
        _positive_int(self.exit_loss_vocab, "exit-loss-vocab", allow_none=True)


@dataclass(frozen=True)
class AdapterConfig:
    exit_layer: int | None = _f(None, "exit-adapter: the adapter reads the hidden state entering layer E (drafts run layers 0..E-1)")
    adapter_size: int = _f(1024, "exit-adapter: inner size I of the adapter MLP (H -> I -> H)")
    adapter_heads: int = _f(0, "exit-adapter: attention heads in the adapter, before its MLP (0 = the MLP alone: the cheapest draft)")
    adapter_head_dim: int = _f(64, "exit-adapter: size of each adapter attention head")
    draft_vocab: int | None = _f(16384, "exit-adapter: draft over the N most frequent tokens (0 = the full vocabulary)")
    num_speculations: int = _f(6, "exit-adapter: K written to the draft profile (with a threshold: the most drafts per step)")
    draft_threshold: float | None = _f(0.3, "exit-adapter: confidence threshold written to the draft profile: drafting stops below it (0 = always draft K)")
    distill_temperature: float = _f(1.0, "exit-adapter: softmax temperature of teacher and draft in the distillation loss")
    teacher_top_k: int = _f(64, "exit-adapter: teacher probabilities kept per position (the soft targets; the rest of the mass is dropped)")
    teacher_tokens: int = _f(200_000, "exit-adapter: training tokens the frozen model is run over once (then cached and revisited for more epochs)")

    def __post_init__(self):
        if self.exit_layer is not None:
            _check(isinstance(self.exit_layer, int) and self.exit_layer >= 1, f"--exit-layer must be a positive integer, got {self.exit_layer}")
        _positive_int(self.adapter_size, "adapter-size")
        _check(isinstance(self.adapter_heads, int) and self.adapter_heads >= 0, f"--adapter-heads must be >= 0, got {self.adapter_heads}")
        _positive_int(self.adapter_head_dim, "adapter-head-dim")
        _check(self.adapter_head_dim % 2 == 0, f"--adapter-head-dim must be even (rotary pairs), got {self.adapter_head_dim}")
        if self.draft_vocab == 0:
            object.__setattr__(self, "draft_vocab", None)
        if self.draft_threshold is not None:
            _check(0.0 <= self.draft_threshold < 1.0, f"--draft-threshold must be in [0, 1), got {self.draft_threshold}")
            if self.draft_threshold == 0:
                object.__setattr__(self, "draft_threshold", None)
        _positive_int(self.draft_vocab, "draft-vocab", allow_none=True)
        _check(isinstance(self.num_speculations, int) and 1 <= self.num_speculations <= 16, f"--num-speculations must be in 1..16, got {self.num_speculations}")
        _check(self.distill_temperature > 0 and math.isfinite(self.distill_temperature), f"--distill-temperature must be > 0, got {self.distill_temperature}")
        _positive_int(self.teacher_top_k, "teacher-top-k")
        _positive_int(self.teacher_tokens, "teacher-tokens")


@dataclass(frozen=True)
class LoopConfig:
    max_steps: int = _f(1000, "optimizer steps; also the horizon of the learning-rate and curriculum schedules")
    max_minutes: float | None = _f(None, "stop (with a checkpoint and a final model) after this many minutes of the training loop, its evaluations included (not the data preparation)")
    batch_size: int = _f(8, "sequences per micro-batch, over all processes (split across DDP ranks)")
    grad_accum: int = _f(1, "micro-batches per optimizer step")
    lr: float | None = _f(None, "peak learning rate (default: 1e-3 from scratch, 2e-5 continuing, 3e-3 for exit adapters)")
    min_lr_ratio: float = _f(0.1, "the cosine decays to lr * this")
    warmup_steps: int | None = _f(None, "linear warm-up steps (default: 5%% of --max-steps, at most 200)")
    weight_decay: float = _f(0.1, "AdamW weight decay (not applied to norms and biases)")
    adam_beta2: float = _f(0.95, "AdamW beta2 (beta1 is 0.9)")
    grad_clip: float = _f(1.0, "clip the global gradient norm to this (0 = off)")
    bf16: bool = _f(False, "bfloat16 autocast (for CUDA; on the project's CPU it made llama-12l slower than float32: measure first)")
    seed: int = _f(0, "seed of initialisation, data order and layer dropout")
    eval_every: int = _f(100, "evaluate on held-out text every N steps (and at the end)")
    checkpoint_every: int = _f(100, "write a resumable checkpoint every N steps (and at the end)")
    keep_checkpoints: int = _f(2, "resumable checkpoints kept in OUT/checkpoints")
    threads: int | None = _f(None, "torch CPU threads per process (default: torch's choice)")
    device: str | None = _f(None, "cpu or cuda (default: cuda when available; under torchrun, cuda:LOCAL_RANK)")
    no_progress: bool = _f(False, "no progress bar (one log line per evaluation instead)")

    def __post_init__(self):
        _positive_int(self.max_steps, "max-steps")
        if self.max_minutes is not None:
            _check(self.max_minutes > 0, f"--max-minutes must be positive, got {self.max_minutes}")
        _positive_int(self.batch_size, "batch-size")
        _positive_int(self.grad_accum, "grad-accum")
        if self.lr is not None:
            _check(0 < self.lr < 1, f"--lr must be in (0, 1), got {self.lr}")
        _check(0.0 <= self.min_lr_ratio <= 1.0, f"--min-lr-ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.warmup_steps is not None:
            _check(isinstance(self.warmup_steps, int) and self.warmup_steps >= 0, f"--warmup-steps must be >= 0, got {self.warmup_steps}")
        _check(self.weight_decay >= 0, f"--weight-decay must be >= 0, got {self.weight_decay}")
        _check(0.0 < self.adam_beta2 < 1.0, f"--adam-beta2 must be in (0, 1), got {self.adam_beta2}")
        _check(self.grad_clip >= 0, f"--grad-clip must be >= 0, got {self.grad_clip}")
        _positive_int(self.eval_every, "eval-every")
        _positive_int(self.checkpoint_every, "checkpoint-every")
        _positive_int(self.keep_checkpoints, "keep-checkpoints")
        _positive_int(self.threads, "threads", allow_none=True)
        if self.device is not None:
            _check(self.device == "cpu" or self.device.startswith("cuda"), f"--device must be cpu or cuda, got {self.device!r}")


@dataclass(frozen=True)
class TrainConfig:
    recipe: str = _f("layerskip", "layerskip: layer dropout + early-exit loss; lm: plain next-token loss (the baseline); "
                     "exit-adapter: a small block on a frozen model's layer E, distilled from the full model", RECIPES)
    out: str = _f("train-out", "output directory: checkpoints/, final/, metrics.jsonl, loss_curve.png")
    resume: bool = _f(False, "continue the run in --out from its latest checkpoint (same settings)")
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    layerskip: LayerSkipConfig = field(default_factory=LayerSkipConfig)
    adapter: AdapterConfig = field(default_factory=AdapterConfig)
    loop: LoopConfig = field(default_factory=LoopConfig)

    def __post_init__(self):
        _check(self.recipe in RECIPES, f"--recipe must be one of {', '.join(RECIPES)}, got {self.recipe!r}")
        _check(bool(self.out), "--out is required")
        if self.recipe == "exit-adapter":
            _check(self.adapter.exit_layer is not None, "the exit-adapter recipe needs --exit-layer E")
            _check(not (self.model.preset or self.model.config), "the exit-adapter recipe trains on a given --model, not from scratch")
        else:
            _check(self.model.model or self.model.preset or self.model.config,
                   "choose what to train: --model PATH (continue) or --preset NAME / --config FILE (from scratch)")
        _check(self.loop.batch_size * self.loop.grad_accum >= 1, "empty batch")

    def resolved(self) -> "TrainConfig":
        """Fill the recipe-dependent defaults (model, tokenizer, learning rate, warm-up)."""
        model, loop = self.model, self.loop
        if self.recipe == "exit-adapter" and model.model is None:
            model = replace(model, model="gemma-3-270m")
        if model.from_scratch and model.tokenizer is None and model.train_tokenizer is None:
            model = replace(model, train_tokenizer=8192)
        if loop.lr is None:
            loop = replace(loop, lr=3e-3 if self.recipe == "exit-adapter" else 1e-3 if model.from_scratch else 2e-5)
        if loop.warmup_steps is None:
            loop = replace(loop, warmup_steps=min(200, loop.max_steps // 20))
        return replace(self, model=model, loop=loop)

    @property
    def dropout_curriculum(self) -> str:
        c = self.layerskip.layer_dropout_curriculum
        return ("exp" if self.model.from_scratch else "none") if c == "auto" else c

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "TrainConfig":
        groups = {"data": DataConfig, "model": ModelConfig, "layerskip": LayerSkipConfig, "adapter": AdapterConfig, "loop": LoopConfig}
        kw = {k: v for k, v in d.items() if k not in groups}
        for name, sub in groups.items():
            raw = dict(d.get(name, {}))
            known = {f.name for f in fields(sub)}
            for k, v in raw.items():
                if isinstance(v, list):
                    raw[k] = tuple(v)
            kw[name] = sub(**{k: v for k, v in raw.items() if k in known})
        return cls(**kw)


# Fields that may change between a run and its --resume: budgets, logging, and where it runs.
# Everything else defines the optimisation and must match for the continuation to be exact.
RESUMABLE_CHANGES = {
    "loop": {"max_steps", "max_minutes", "eval_every", "checkpoint_every", "keep_checkpoints", "threads", "device", "no_progress"},
    "data": {"eval_sequences"},
}
