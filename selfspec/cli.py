"""Command line: `selfspec <command>`. Flags map one-to-one onto the config dataclasses
(DraftConfig, SamplingConfig, GenerationConfig) so defaults live in one place.

Errors a user can cause print one line and exit with status 2; nothing prints a traceback
unless SELFSPEC_DEBUG=1.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import types
import typing
from dataclasses import MISSING, fields

from selfspec.config import STRATEGIES, DraftConfig, GenerationConfig, SamplingConfig
from selfspec.errors import SelfSpecError

_HELP = {
    "strategy": "how to draft: " + ", ".join(STRATEGIES),
    "exit_layer": "early-exit: draft with layers 0..E-1",
    "num_speculations": "K, the most tokens drafted per verify step",
    "skip_attn": "layer-skip: attention sub-layers to skip while drafting, e.g. 3,5,7",
    "skip_mlp": "layer-skip: MLP sub-layers to skip while drafting, e.g. 4,9",
    "draft_threshold": "stop drafting when the draft's top-1 probability is below this",
    "adaptive": "adapt the draft threshold from observed acceptance (Draft & Verify)",
    "draft_model": "draft-model: path or alias of a smaller model with the same tokenizer",
    "draft_vocab": "draft over the N most frequent tokens only (verification uses all)",
    "max_ngram": "prompt-lookup: longest n-gram to match",
    "adapter": "exit-adapter: the trained adapter file (selfspec train --recipe exit-adapter)",
    "lookup_first": "early-exit/layer-skip/exit-adapter: use a prompt-lookup match when there is one",
    "temperature": "0 = greedy; > 0 samples",
    "top_k": "sample from the k most likely tokens",
    "top_p": "nucleus sampling mass",
    "seed": "random seed for sampling",
    "max_new_tokens": "the most tokens to generate",
    "stop": "stop string (repeatable)",
    "chat": "apply the tokenizer's chat template",
}


def _flag_type(tp):
    """int | None -> int; tuple[int, ...] -> str (parsed by the dataclass)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return _flag_type(args[0])
    if origin is tuple:
        return str
    return tp


def add_config_args(parser: argparse.ArgumentParser, cls, skip: tuple[str, ...] = (), helps: dict | None = None) -> None:
    hints = typing.get_type_hints(cls)
    helps = {**_HELP, **(helps or {})}
    for f in fields(cls):
        if f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        tp = _flag_type(hints[f.name])
        default = None  # None = "not given": the dataclass (or a profile) supplies the default
        shown = f.default if f.default is not MISSING else None
        help_ = f"{helps.get(f.name, '')} (default: {shown})"
        if tp is bool:
            parser.add_argument(flag, action="store_true", default=None, help=helps.get(f.name))
        elif f.name == "stop":
            parser.add_argument(flag, action="append", default=None, help=help_)
        elif f.name == "strategy":
            parser.add_argument(flag, choices=STRATEGIES, default=default, help=help_)
        else:
            parser.add_argument(flag, type=tp, default=default, help=help_)


def config_kwargs(args, cls) -> dict:
    return {f.name: getattr(args, f.name) for f in fields(cls) if getattr(args, f.name, None) is not None}


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="gemma-3-270m", help="alias, HF model directory, or .gguf file (default: gemma-3-270m)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None, help="default: bfloat16 where supported")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")


def add_draft_args(p: argparse.ArgumentParser) -> None:
    add_config_args(p, DraftConfig, skip=("base",))  # auto's base comes from a profile
    p.add_argument("--profile", default=None, help="a draft profile JSON (from search/sweep/train)")


def load_model(args):
    import selfspec

    return selfspec.load(args.model, dtype=args.dtype, device=args.device)


def draft_config_from_args(model, args) -> DraftConfig:
    return model.draft_config(profile=args.profile, **config_kwargs(args, DraftConfig))


# ---- commands ---------------------------------------------------------------------------


def cmd_generate(args) -> int:
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    if not prompt or not prompt.strip():
        raise SelfSpecError("the prompt is empty")
    sampling = SamplingConfig(**config_kwargs(args, SamplingConfig))  # validate before loading
    gen = GenerationConfig(**{k: (tuple(v) if k == "stop" else v) for k, v in config_kwargs(args, GenerationConfig).items()})
    model = load_model(args)
    draft = draft_config_from_args(model, args)
    on_event = None
    if not args.json and args.stream_style != "none":
        from rich.console import Console
        from rich.text import Text

        console = Console(highlight=False, soft_wrap=True)
        speculative = args.stream_style == "speculative"

        def on_event(ev):
            if ev.text:
                style = ("green" if ev.drafted else "bold") if speculative else None
                console.print(Text(ev.text, style=style), end="")

    result = model.generate(
        prompt,
        max_new_tokens=gen.max_new_tokens,
        stop=list(gen.stop),
        chat=bool(args.chat),
        temperature=sampling.temperature,
        top_k=sampling.top_k,
        top_p=sampling.top_p,
        seed=sampling.seed,
        draft=draft,
        on_event=on_event,
    )
    if args.json:
        out = result.to_dict()
        out["strategy"] = draft.to_dict()
        print(json.dumps(out))
    else:
        if on_event is None:
            print(result.text, end="")
        print()
        s = result.stats
        line = f"[{s.new_tokens} tokens, {s.tokens_per_second:.1f} tok/s"
        if draft.speculative:
            line += f", acceptance {s.acceptance_rate:.0%}, {s.mean_accepted_length:.2f} tokens/step"
        print(line + "]", file=sys.stderr)
    return 0


def cmd_models(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from selfspec.architectures import SUPPORTED_ARCHITECTURES
    from selfspec.loading import ALIASES, DEFAULT_MODEL

    t = Table(title="Built-in models")
    t.add_column("alias")
    t.add_column("what")
    for k, v in ALIASES.items():
        t.add_row(k + (" (default)" if k == DEFAULT_MODEL else ""), v)
    c = Console()
    c.print(t)
    c.print("Supported architectures (model_type): " + ", ".join(SUPPORTED_ARCHITECTURES))
    c.print("Any Hugging Face directory (config.json + *.safetensors) or .gguf file of these loads with --model PATH.")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="selfspec", description="Lossless self-speculative decoding.")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text (streams as it goes)")
    g.add_argument("prompt", help="the prompt, or - to read it from stdin")
    add_model_args(g)
    add_config_args(g, GenerationConfig)
    add_config_args(g, SamplingConfig)
    add_draft_args(g)
    g.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    g.add_argument("--stream-style", choices=["plain", "speculative", "none"], default="plain",
                   help="speculative: colour accepted drafts (green) apart from verifier tokens")
    g.set_defaults(func=cmd_generate)

    m = sub.add_parser("models", help="list built-in aliases and supported architectures")
    m.set_defaults(func=cmd_models)

    for register in _extra_commands():
        register(sub)
    return parser


def _extra_commands():
    """Commands that live in their own modules (tools, server, training) register here."""
    import importlib

    out = []
    for mod in ("selfspec.tools.cli", "selfspec.server.cli", "selfspec.training.cli", "selfspec.search.cli"):
        try:
            out.append(importlib.import_module(mod).register)
        except ModuleNotFoundError as e:
            if e.name is None or not mod.startswith(e.name):
                raise
    return out


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except SelfSpecError as e:
        print(f"selfspec: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("selfspec: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
    except Exception as e:  # a bug, not bad input: still one line unless debugging
        if os.environ.get("SELFSPEC_DEBUG"):
            raise
        print(f"selfspec: internal error: {type(e).__name__}: {e} (set SELFSPEC_DEBUG=1 for a traceback)", file=sys.stderr)
        return 1
