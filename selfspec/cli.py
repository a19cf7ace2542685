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
from selfspec.errors import SelfSpecError, unknown_choice

_HELP = {
    "strategy": "how to draft: " + ", ".join(STRATEGIES),
    "exit_layer": "early-exit: draft with layers 0..E-1 (quantized: the copy's first E layers)",
    "num_speculations": "K, the most tokens drafted per verify step",
    "skip_attn": "layer-skip/quantized: attention sub-layers to skip while drafting, e.g. 3,5,7",
    "skip_mlp": "layer-skip/quantized: MLP sub-layers to skip while drafting, e.g. 4,9",
    "draft_threshold": "stop drafting when the draft's top-1 probability is below this",
    "adaptive": "adapt the draft threshold from observed acceptance (Draft & Verify)",
    "draft_model": "draft-model: path or alias of a smaller model with the same tokenizer",
    "draft_vocab": "draft over the N most frequent tokens only (verification uses all)",
    "max_ngram": "prompt-lookup: longest n-gram to match",
    "adapter": "exit-adapter: the trained adapter file (selfspec train --recipe exit-adapter)",
    "lookup_first": "early-exit/layer-skip/exit-adapter/quantized: use a prompt-lookup match when there is one",
    "draft_bits": "quantized: bits of the model's own weights the draft uses, 8 (default) or 4",
    "head_bits": "quantized: bits of the draft's LM head (default: --draft-bits)",
    "temperature": "0 = greedy; > 0 samples",
    "top_k": "sample from the k most likely tokens",
    "top_p": "nucleus sampling mass",
    "seed": "random seed for sampling",
    "max_new_tokens": "the most tokens to generate",
    "stop": "stop string (repeatable)",
    "chat": "wrap the prompt as a user turn of the chat template (the tokenizer's, --chat-template, or the built-in "
            "one of the model's family)",
}


class Parser(argparse.ArgumentParser):
    """Usage mistakes are one line and exit status 2, like every other bad input (the full
    usage is one --help away)."""

    def error(self, message: str):
        self.exit(2, f"selfspec: error: {message} (see: {self.prog} --help)\n")


def choice(choices: typing.Sequence[str], what: str):
    """An argparse type for a value among `choices` whose error names the closest one
    (argparse's own `choices` prints every option, and on a mistyped one no suggestion)."""
    def check(value: str) -> str:
        if value not in choices:
            raise argparse.ArgumentTypeError(unknown_choice(what, value, choices))
        return value

    check.__name__ = what
    return check


def format_default(value) -> str | None:
    """A default as a user would type it ("3,5", "early-exit"); None when there is nothing to show."""
    if value is None or value is MISSING or isinstance(value, bool):
        return None
    if isinstance(value, (tuple, list)):
        return ",".join(map(str, value)) if value else None
    return str(value)


def with_default(help_: str, default) -> str:
    shown = format_default(default)
    if shown is None or "default" in help_:  # a help text may describe its default itself
        return help_
    return f"{help_} (default: {shown})".strip()


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
        help_ = with_default(helps.get(f.name, ""), f.default)
        if tp is bool:
            parser.add_argument(flag, action="store_true", default=None, help=helps.get(f.name))
        elif f.name == "stop":
            parser.add_argument(flag, action="append", default=None, help=help_)
        elif f.name == "strategy":
            parser.add_argument(flag, type=choice(STRATEGIES, "strategy"), default=default, help=help_)
        else:
            parser.add_argument(flag, type=tp, default=default, help=help_)


def config_kwargs(args, cls) -> dict:
    return {f.name: getattr(args, f.name) for f in fields(cls) if getattr(args, f.name, None) is not None}


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="gemma-3-270m", help="alias, HF model directory, or .gguf file (default: gemma-3-270m)")
    p.add_argument("--dtype", type=choice(("float32", "bfloat16"), "dtype"), default=None,
                   help="float32 or bfloat16 (default: bfloat16 where supported)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")


def add_chat_template_arg(p: argparse.ArgumentParser) -> None:
    from selfspec.chat_templates import names

    p.add_argument("--chat-template", default=None, metavar="FILE|NAME",
                   help="the chat template: a Jinja file or a built-in name (" + ", ".join(names()) + "); default: the "
                        "tokenizer's own, else the built-in one of the model's family")


def add_draft_args(p: argparse.ArgumentParser) -> None:
    add_config_args(p, DraftConfig, skip=("base",))  # auto's base comes from a profile
    p.add_argument("--profile", default=None, help="a draft profile JSON (from search/sweep/train)")


def load_model(args):
    import selfspec

    return selfspec.load(args.model, dtype=args.dtype, device=args.device, chat_template=getattr(args, "chat_template", None))


def check_before_loading(args) -> None:
    """What can be checked without the weights, checked before they load (a minute the first
    time): the chat template, the draft options, and that they fit the model's shape, which
    comes from its config."""
    from selfspec.loading import peek_shape
    from selfspec.profiles import load_profile

    if getattr(args, "chat_template", None) is not None:
        from selfspec.chat_templates import resolve

        resolve(args.chat_template)
    if not hasattr(args, "profile"):
        return
    given = config_kwargs(args, DraftConfig)
    if args.profile is None:
        draft = DraftConfig.from_dict(given)
    else:
        from selfspec.model import merge_profile_draft

        draft = merge_profile_draft(load_profile(args.profile).draft, given.pop("strategy", None), given)
    shape = peek_shape(args.model)
    if shape is not None:
        draft.check_model(*shape)


def draft_config_from_args(model, args) -> DraftConfig:
    draft = model.draft_config(profile=args.profile, **config_kwargs(args, DraftConfig))
    if args.profile is not None:
        from selfspec.profiles import load_profile, losing_note

        note = losing_note(load_profile(args.profile))
        if note:
            print(f"selfspec: warning: {note}", file=sys.stderr)
    return draft


# ---- commands ---------------------------------------------------------------------------


def cmd_generate(args) -> int:
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    if not prompt or not prompt.strip():
        raise SelfSpecError("the prompt is empty")
    sampling = SamplingConfig(**config_kwargs(args, SamplingConfig))  # validate before loading
    gen = GenerationConfig(**{k: (tuple(v) if k == "stop" else v) for k, v in config_kwargs(args, GenerationConfig).items()})
    check_before_loading(args)
    chat = bool(args.chat) or args.chat_template is not None  # naming a template asks for chat
    model = load_model(args)
    draft = draft_config_from_args(model, args)
    on_event = None
    if not args.json and args.stream_style != "none":
        from rich.console import Console
        from rich.text import Text

        console = Console(highlight=False, soft_wrap=True)
        speculative = args.stream_style == "speculative"
        if speculative:
            Console(stderr=True, highlight=False).print(Text.assemble(
                "[", ("green", "green"), ": drafted tokens the full model accepted; ", ("bold", "bold"),
                ": tokens the full model computed itself]"), soft_wrap=True)

        def on_event(ev):
            if ev.text:
                style = ("green" if ev.drafted else "bold") if speculative else None
                console.print(Text(ev.text, style=style), end="")

    result = model.generate(
        prompt,
        max_new_tokens=gen.max_new_tokens,
        stop=list(gen.stop),
        chat=chat,
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
    parser = Parser(prog="selfspec", description="Lossless self-speculative decoding.")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text (streams as it goes)")
    g.add_argument("prompt", help="the prompt, or - to read it from stdin")
    add_model_args(g)
    add_config_args(g, GenerationConfig)
    add_config_args(g, SamplingConfig)
    add_chat_template_arg(g)
    add_draft_args(g)
    g.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    g.add_argument("--stream-style", type=choice(("plain", "speculative", "none"), "stream style"), default="plain",
                   help="plain, speculative or none; speculative shows drafted tokens the full model accepted in green "
                        "and the tokens it computed itself in bold (default: plain)")
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
