"""What every command's parser shares: one-line usage errors, choices that suggest the closest
value, flags generated from the config dataclasses (DraftConfig, SamplingConfig,
GenerationConfig) so defaults live in one place, the model options, and the checks made
before the weights load."""

from __future__ import annotations

import argparse
import sys
import types
import typing
from dataclasses import MISSING, fields

from selfspec import strategies
from selfspec.chat_templates import names, resolve
from selfspec.config import COUPLINGS, DraftConfig, GenerationConfig, Grammar, SamplingConfig
from selfspec.errors import SelfSpecError, unknown_choice
from selfspec.grammar import compile_grammar
from selfspec.loading import peek_shape
from selfspec.model import load, merge_profile_draft
from selfspec.profiles import load_profile, losing_note

_HELP = {
    "strategy": "how to draft: " + ", ".join(strategies.names()) + " (named alone: its best measured options for the model; "
                "options given override only themselves)",
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
    "lookup_first": ("early-exit/layer-skip/exit-adapter/quantized: use a prompt-lookup match when there is one "
                     "(greedy, over quantized: a match that foretold the whole draft adds its next tokens, up to 16 in all)"),
    "draft_bits": "quantized: bits of the model's own weights the draft uses, 8 (default) or 4",
    "head_bits": "quantized: bits of the draft's LM head (default: --draft-bits)",
    "temperature": "0 = greedy; > 0 samples",
    "top_k": "sample from the k most likely tokens",
    "top_p": "nucleus sampling mass",
    "seed": "random seed for sampling",
    "coupling": ("how a sampled draft is accepted: gumbel (Gumbel-max coupling: a seed gives one text whatever drafts it, "
                 "the threads or the batch) or rejection (speculative sampling's accept/resample: the same distribution, "
                 "but the sample depends on the draft)"),
    "max_new_tokens": "the most tokens to generate",
    "stop": "stop string (repeatable)",
    "stop_token_ids": "token ids that end generation like EOS, e.g. 106,1 (kept out of the text)",
    "logprobs": "record each new token's log-probability and this many most likely alternatives (0..20; see --json)",
    "presence_penalty": "OpenAI's: subtract this from the logit of every token generated so far (-2..2)",
    "frequency_penalty": "OpenAI's: subtract this times how often a token was generated so far (-2..2)",
    "repetition_penalty": "transformers': divide a positive logit (multiply a negative one) of every prompt or generated token by this",
    "min_p": "keep the tokens whose probability is at least this times the top token's (after temperature)",
    "logit_bias": "add to token logits, e.g. 50256=-100,198=2 (-100 bans a token)",
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


def with_default(help_: str, default, label: str = "default") -> str:
    shown = format_default(default)
    if shown is None or "default" in help_:  # a help text may describe its default itself
        return help_
    return f"{help_} ({label}: {shown})".strip()


def _flag_type(tp):
    """int | None -> int; tuple[int, ...] -> str (parsed by the dataclass)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return _flag_type(args[0])
    if origin is tuple:
        return str
    return tp


def add_config_args(parser: argparse.ArgumentParser, cls, skip: tuple[str, ...] = (), helps: dict | None = None,
                    default_label: str = "default") -> None:
    hints = typing.get_type_hints(cls)
    helps = {**_HELP, **(helps or {})}
    for f in fields(cls):
        if f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        tp = _flag_type(hints[f.name])
        default = None  # None = "not given": the dataclass (or a profile) supplies the default
        help_ = with_default(helps.get(f.name, ""), f.default, "default" if f.name == "strategy" else default_label)
        if hasattr(tp, "parse"):  # a value type with a text form of its own (LogitBias)
            parser.add_argument(flag, type=str, default=None, help=help_)
        elif tp is bool:  # --x / --no-x: a profile's default may be turned off
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=helps.get(f.name))
        elif f.name == "stop":
            parser.add_argument(flag, action="append", default=None, help=help_)
        elif f.name == "strategy":
            parser.add_argument(flag, type=choice(strategies.names(), "strategy"), default=default, help=help_)
        elif f.name == "coupling":
            parser.add_argument(flag, type=choice(COUPLINGS, "coupling"), default=default, help=help_)
        else:
            parser.add_argument(flag, type=tp, default=default, help=help_)


def config_kwargs(args, cls) -> dict:
    return {f.name: getattr(args, f.name) for f in fields(cls) if getattr(args, f.name, None) is not None}


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="gemma-3-270m",
                   help="a built-in alias, a HF model directory, a .gguf file, or a Hugging Face Hub id: org/name, "
                        "org/name@revision, org/name:file.gguf (default: gemma-3-270m)")
    p.add_argument("--allow-pickle", action="store_true",
                   help="accept pickled .bin weights where a model has no safetensors (unpickling can run code)")
    p.add_argument("--dtype", type=choice(("auto", "native", "float32", "bfloat16"), "dtype"), default=None,
                   help="auto (default): bfloat16 where supported; a GGUF of 1B and up runs its own blocks (CPU), a "
                        "smaller one is dequantized at load; native: a GGUF's quantized blocks as stored; float32 or bfloat16")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")


def add_chat_template_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--chat-template", default=None, metavar="FILE|NAME",
                   help="the chat template: a Jinja file or a built-in name (" + ", ".join(names()) + "); default: the "
                        "tokenizer's own, else the built-in one of the model's family")


def add_draft_args(p: argparse.ArgumentParser) -> None:
    # auto's base comes from a profile; a named strategy's defaults from the model's (see --strategy)
    add_config_args(p, DraftConfig, skip=("base",), default_label="static default")
    p.add_argument("--profile", default=None, help="a draft profile JSON (from search/sweep/train)")


def load_model(args):
    return load(args.model, dtype=args.dtype, device=args.device, chat_template=getattr(args, "chat_template", None),
                allow_pickle=bool(getattr(args, "allow_pickle", False)))


def check_before_loading(args) -> None:
    """What can be checked without the weights, checked before they load (a minute the first
    time): the chat template, the draft options, and that they fit the model's shape, which
    comes from its config."""
    if getattr(args, "chat_template", None) is not None:
        resolve(args.chat_template)
    if not hasattr(args, "profile"):
        return
    given = config_kwargs(args, DraftConfig)
    if args.profile is None:
        # a required option not given may come from the model's profile (known once it loads):
        # the others are checked now, against a stand-in for it
        required = strategies.strategy(given["strategy"]).required if strategies.known(given.get("strategy")) else ()
        missing = [required[0]] if required and not any(given.get(n) for n in required) else []
        stand_in = {"exit_layer": 1, "skip_attn": (0,), "adapter": "-", "draft_model": "-"}
        draft = DraftConfig.from_dict({**{n: stand_in[n] for n in missing}, **given})
    else:
        draft = merge_profile_draft(load_profile(args.profile).draft, given.pop("strategy", None), given)
    shape = peek_shape(args.model)
    if shape is not None:
        draft.check_model(*shape)


def draft_config_from_args(model, args) -> DraftConfig:
    draft = model.draft_config(profile=args.profile, **config_kwargs(args, DraftConfig))
    warn_losing_profile(args)
    return draft


def warn_losing_profile(args) -> None:
    """A warning when --profile names a profile that measured slower than plain decoding."""
    if args.profile is not None:
        note = losing_note(load_profile(args.profile))
        if note:
            print(f"selfspec: warning: {note}", file=sys.stderr)


def request_options(args, chat: bool) -> dict:
    """The generation flags as the request builder's keywords (request.configs), one to one:
    GenerationConfig's, SamplingConfig's and DraftConfig's fields, --profile, and the grammar
    flags as grammar= (read and compiled here)."""
    return {**config_kwargs(args, GenerationConfig), **config_kwargs(args, SamplingConfig), "grammar": grammar_from_args(args),
            **config_kwargs(args, DraftConfig), "profile": args.profile, "chat": chat}


def add_grammar_args(p: argparse.ArgumentParser) -> None:
    """Structured output (SamplingConfig.grammar): at most one of these."""
    g = p.add_mutually_exclusive_group()
    g.add_argument("--json-schema", default=None, metavar="FILE", help="the output is JSON valid under this JSON schema")
    g.add_argument("--json-object", action="store_true", default=None, help="the output is a JSON object")
    g.add_argument("--regex", default=None, metavar="PATTERN", help="the output matches this regular expression")
    g.add_argument("--grammar", default=None, metavar="FILE", help="the output matches this Lark grammar (llguidance's dialect)")


def grammar_from_args(args) -> Grammar | None:
    """The grammar the flags name, read and compiled (a bad one fails before the weights load)."""
    if getattr(args, "json_schema", None):
        g = Grammar("json_schema", _read(args.json_schema))
    elif getattr(args, "json_object", None):
        g = Grammar("json_object")
    elif getattr(args, "regex", None):
        g = Grammar("regex", args.regex)
    elif getattr(args, "grammar", None):
        g = Grammar("lark", _read(args.grammar))
    else:
        return None
    compile_grammar(g)
    return g


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        raise SelfSpecError(f"cannot read {path}: {e.strerror}") from None
