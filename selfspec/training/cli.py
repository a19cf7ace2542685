"""`selfspec train` (picked up by selfspec.cli). Every flag is a field of the dataclasses in
training/config.py, generated from them, so defaults and checks live in one place.

    selfspec train --recipe layerskip --preset llama-12l --data stdlib --max-steps 2000 --out runs/ls
    selfspec train --recipe lm        --preset llama-12l --data stdlib --max-steps 2000 --out runs/lm
    selfspec train --recipe layerskip --model gemma-3-270m --data notes/ --seq-len 512 --out runs/g
    selfspec train --recipe exit-adapter --model gemma-3-270m --exit-layer 12 [--adapter-heads 8] --out runs/ad
    selfspec train --out runs/ls --resume [--max-steps 4000]       # settings come from the run
    torchrun --nproc-per-node 2 -m selfspec train ...               # data parallel
"""

from __future__ import annotations

import sys
import types
import typing
from dataclasses import MISSING, fields
from pathlib import Path

from selfspec.cli_args import choice, with_default
from selfspec.errors import SelfSpecError
from selfspec.training import checkpoint as ckpt
from selfspec.training.config import AdapterConfig, DataConfig, LayerSkipConfig, LoopConfig, ModelConfig, TrainConfig
from selfspec.training.trainer import train

GROUPS = {"data": DataConfig, "model": ModelConfig, "layerskip": LayerSkipConfig, "adapter": AdapterConfig, "loop": LoopConfig}
_TITLES = {"data": "data", "model": "model", "layerskip": "layerskip recipe", "adapter": "exit-adapter recipe", "loop": "optimisation and budgets"}


def _scalar(tp):
    """int | None -> int; tuple[str, ...] -> str."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return _scalar(next(a for a in typing.get_args(tp) if a is not type(None)))
    if origin is tuple:
        return typing.get_args(tp)[0]
    return tp


def _add_fields(parser, cls, skip=()) -> None:
    hints = typing.get_type_hints(cls)
    for f in fields(cls):
        if f.name in skip or "help" not in f.metadata:
            continue
        flag = "--" + f.name.replace("_", "-")
        meta = f.metadata
        default = f.default if f.default is not MISSING else f.default_factory()
        help_ = meta["help"]
        if meta.get("choices") and not all(c in help_ for c in meta["choices"]):
            help_ += f" ({', '.join(meta['choices'])})"
        help_ = with_default(help_, default)
        tp = _scalar(hints[f.name])
        kw: dict = {"default": None, "help": help_}  # None = not given: the dataclass (or the resumed run) decides
        if tp is bool:
            parser.add_argument(flag, action="store_true", **kw)
            continue
        if meta.get("nargs"):
            kw["nargs"] = meta["nargs"]
        if meta.get("action"):
            kw["action"] = meta["action"]
        if meta.get("choices"):  # checked by `choice`: one line, with the closest name, for a typo
            tp = choice(tuple(meta["choices"]), f.name.replace("_", " "))
        parser.add_argument(flag, type=tp, **kw)


def _given(args, cls) -> dict:
    """The flags of cls's own fields (not its sub-config groups) that were given."""
    return {f.name: getattr(args, f.name) for f in fields(cls) if "help" in f.metadata and getattr(args, f.name, None) is not None}


def config_from_args(args) -> TrainConfig:
    """Flags given override the dataclass defaults, or, with --resume, the run's own settings."""
    top = _given(args, TrainConfig)
    groups = {name: _given(args, cls) for name, cls in GROUPS.items()}
    for g in groups.values():
        for k, v in g.items():
            if isinstance(v, list):
                g[k] = tuple(v)
    if args.resume:
        if args.out is None:
            raise SelfSpecError("--resume needs --out DIR, the run to continue")
        latest = ckpt.latest_checkpoint(Path(args.out).expanduser())
        if latest is None:
            raise SelfSpecError(f"nothing to resume: {args.out} has no complete checkpoint")
        base = ckpt.read_trainer_state(latest)["config"]
        merged = {**{k: v for k, v in base.items() if k not in GROUPS}, **top}
        for name in GROUPS:
            merged[name] = {**base.get(name, {}), **groups[name]}
        return TrainConfig.from_dict(merged)
    return TrainConfig(**top, **{name: cls(**groups[name]) for name, cls in GROUPS.items()})


def cmd_train(args) -> int:
    cfg = config_from_args(args)
    result = train(cfg)
    if result.loop.stopped_by == "interrupt":
        print(f"selfspec: interrupted at step {result.loop.step}; resume with --out {cfg.out} --resume", file=sys.stderr)
        return 130
    if result.is_main:
        print(result.final)
    return 0


def register(sub) -> None:
    p = sub.add_parser(
        "train",
        help="train for self-speculation: LayerSkip (layer dropout + early-exit loss), plain LM, or an exit adapter",
        description="Train a model whose early layers draft well (--recipe layerskip; --recipe lm is the plain baseline), "
                    "or a small exit adapter on a frozen model (--recipe exit-adapter). Writes OUT/final (a HF model "
                    "directory, or adapter.safetensors + profile.json), resumable checkpoints in OUT/checkpoints, "
                    "metrics.jsonl and loss_curve.png.",
    )
    _add_fields(p, TrainConfig)
    for name, cls in GROUPS.items():
        _add_fields(p.add_argument_group(_TITLES[name]), cls)
    p.set_defaults(func=cmd_train)
