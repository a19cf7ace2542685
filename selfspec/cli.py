"""Command line: `selfspec <command>`. Flags map one-to-one onto the config dataclasses
(DraftConfig, SamplingConfig, GenerationConfig) so defaults live in one place; `generate`
builds its request with the library's own builder (request.py) from them.

Errors a user can cause print one line and exit with status 2; nothing prints a traceback
unless SELFSPEC_DEBUG=1.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from selfspec.architectures import SUPPORTED_ARCHITECTURES
from selfspec.cli_args import (
    Parser,
    add_chat_template_arg,
    add_config_args,
    add_grammar_args,
    add_draft_args,
    add_model_args,
    check_before_loading,
    choice,
    load_model,
    request_options,
    warn_losing_profile,
)
from selfspec.config import GenerationConfig, SamplingConfig
from selfspec.errors import SelfSpecError
from selfspec import hub
from selfspec.loading import ALIASES, DEFAULT_MODEL, available_memory
from selfspec.profiles import builtin_profiles
from selfspec.request import Request, configs
from selfspec.search import cli as search_cli
from selfspec.server import cli as server_cli
from selfspec.tools import cli as tools_cli
from selfspec.training import cli as training_cli

# commands that live with their subsystem register their subparsers here
COMMAND_MODULES = (tools_cli, server_cli, training_cli, search_cli)

# ---- commands ---------------------------------------------------------------------------


def cmd_generate(args) -> int:
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    if not prompt or not prompt.strip():
        raise SelfSpecError("the prompt is empty")
    chat = bool(args.chat) or args.chat_template is not None  # naming a template asks for chat
    options = request_options(args, chat)
    configs(**options)  # every option checked before the weights load (the draft as far as it can be without them)
    check_before_loading(args)
    model = load_model(args)
    stream, speculative = not args.json and args.stream_style != "none", args.stream_style == "speculative"
    console = Console(highlight=False, soft_wrap=True)

    def on_event(ev):
        if ev.text:
            style = ("green" if ev.drafted else "bold") if speculative else None
            console.print(Text(ev.text, style=style), end="")

    request = Request.build(model, prompt, on_event=on_event if stream else None, **options)
    warn_losing_profile(args)
    draft = request.draft
    if stream and speculative:
        Console(stderr=True, highlight=False).print(Text.assemble(
            "[", ("green", "green"), ": drafted tokens the full model accepted; ", ("bold", "bold"),
            ": tokens the full model computed itself]"), soft_wrap=True)
    result = model.run(request)
    if args.json:
        out = result.to_dict()
        out["strategy"] = draft.to_dict()
        out["memory"] = model.memory()
        print(json.dumps(out))
    else:
        if not stream:
            print(result.text, end="")
        print()
        s = result.stats
        line = f"[{s.new_tokens} tokens, {s.tokens_per_second:.1f} tok/s"
        if draft.speculative:
            line += f", acceptance {s.acceptance_rate:.0%}, {s.mean_accepted_length:.2f} tokens/step"
        print(line + "]", file=sys.stderr)
    return 0


def cmd_models(args) -> int:
    c = Console()
    t = Table(title="Built-in models")
    t.add_column("alias")
    t.add_column("what")
    for k, v in ALIASES.items():
        t.add_row(k + (" (default)" if k == DEFAULT_MODEL else ""), v)
    c.print(t)
    have = available_memory("cpu")
    t = Table(title="Published checkpoints with a built-in profile", box=box.SIMPLE_HEAD, pad_edge=False)
    t.add_column("Hub id", no_wrap=True)
    t.add_column("bf16 weights", justify="right", no_wrap=True)
    t.add_column("cached", no_wrap=True)
    t.add_column("auto drafts with", no_wrap=True)
    too_big = False
    for prof in builtin_profiles():
        rid, m, d = prof.model_ids[0], prof.model, prof.draft
        need = int(m.get("params", 0)) * 2
        big = have is not None and need > have
        too_big |= big
        cached = hub.cached_bytes(rid)
        t.add_row(rid, f"{m.get('params', 0) / 1e9:.1f}B {need / 1e9:.1f} GB" + ("*" if big else ""),
                  f"{cached / 1e9:.1f} GB" if cached else "no",
                  f"exit {d.exit_layer}/{m.get('num_layers', '?')}, K={d.num_speculations}" if d.strategy == "early-exit" else d.label())
    c.print(t)
    c.print("LayerSkip checkpoints are gated: accept the license on the model's Hub page, then `hf auth login`." +
            (f" *: more than the {have / 1e9:.1f} GB of memory available here." if too_big else ""))
    c.print("Supported architectures (model_type): " + ", ".join(SUPPORTED_ARCHITECTURES))
    c.print("--model takes any Hugging Face directory (config.json + *.safetensors), a .gguf file, or a Hub id "
            "(org/name, org/name@revision, org/name:file.gguf), downloaded into the Hub cache "
            f"({hub.cache_dir()}; HF_HUB_OFFLINE=1 uses only what is there).")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="selfspec", description="Lossless self-speculative decoding.")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text (streams as it goes)")
    g.add_argument("prompt", help="the prompt, or - to read it from stdin")
    add_model_args(g)
    add_config_args(g, GenerationConfig)
    add_config_args(g, SamplingConfig, skip=("grammar",))
    add_grammar_args(g)
    add_chat_template_arg(g)
    add_draft_args(g)
    g.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    g.add_argument("--stream-style", type=choice(("plain", "speculative", "none"), "stream style"), default="plain",
                   help="plain, speculative or none; speculative shows drafted tokens the full model accepted in green "
                        "and the tokens it computed itself in bold (default: plain)")
    g.set_defaults(func=cmd_generate)

    m = sub.add_parser("models", help="list built-in aliases, the checkpoints with built-in profiles, and supported architectures")
    m.set_defaults(func=cmd_models)

    for module in COMMAND_MODULES:
        module.register(sub)
    return parser


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
