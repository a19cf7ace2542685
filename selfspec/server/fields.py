"""The generation options of a request body, one small parser per field (parsing.py runs them):
each returns the field's value for the engine or raises a 400 in OpenAI's shape naming it."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from typing import TYPE_CHECKING

from selfspec.coercion import ConfigError, ConfigTypeError, typed
from selfspec.config import COUPLINGS, MAX_LOGPROBS, DraftConfig, Grammar, LogitBias
from selfspec.errors import SelfSpecError
from selfspec.server.errors import bad
from selfspec.server.settings import MAX_REQUEST_NGRAM, REQUEST_DRAFT_OPTIONS

if TYPE_CHECKING:
    from selfspec.server.parsing import ParseContext

MAX_N = 16  # the most choices one request may ask for per prompt (each is a sequence of the batch)
MAX_CHOICES = 256  # the most choices of a request with a list of prompts (prompts x n)
MAX_STOP_TOKEN_IDS = 64
MAX_LOGIT_BIAS = 300  # OpenAI's bound on logit_bias entries


def is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_num(v) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


def parse_n(n) -> int:
    if n is None:
        return 1
    if not is_int(n):
        raise bad("'n' must be an integer.", param="n", code="invalid_type")
    if not 1 <= n <= MAX_N:
        raise bad(f"'n' must be in 1..{MAX_N}, got {n}.", param="n", code="invalid_value")
    return n


def parse_stop_token_ids(ids, vocab_size: int) -> tuple[int, ...]:
    if ids is None:
        return ()
    if not isinstance(ids, list) or not all(is_int(t) for t in ids):
        raise bad("'stop_token_ids' must be a list of token ids.", param="stop_token_ids", code="invalid_type")
    if len(ids) > MAX_STOP_TOKEN_IDS:
        raise bad(f"At most {MAX_STOP_TOKEN_IDS} stop token ids are allowed.", param="stop_token_ids", code="invalid_value")
    bad_ids = [t for t in ids if not 0 <= t < vocab_size]
    if bad_ids:
        raise bad(f"Stop token id {bad_ids[0]} is outside the vocabulary (size {vocab_size}).", param="stop_token_ids",
                  code="invalid_value")
    return tuple(ids)  # sorted and deduplicated by GenerationConfig


def parse_sampling(body: dict) -> dict:
    """temperature (OpenAI's default 1.0 when absent, at most 2), top_p (1: off), top_k (0 or -1:
    off) and seed (64 bits) as the request builder's keywords; their ranges otherwise are
    SamplingConfig's (checked by the builder: parsing._check_options)."""
    t = body.get("temperature")
    if t is None:
        t = 1.0
    if not is_num(t):
        raise bad("'temperature' must be a number.", param="temperature", code="invalid_type")
    if not 0 <= t <= 2:
        raise bad(f"'temperature' must be in [0, 2], got {t}.", param="temperature", code="invalid_value")
    top_p = body.get("top_p")
    if top_p is not None:
        if not is_num(top_p):
            raise bad("'top_p' must be a number.", param="top_p", code="invalid_type")
        top_p = None if top_p == 1 else float(top_p)
    top_k = body.get("top_k")
    if top_k is not None:
        if not is_int(top_k):
            raise bad("'top_k' must be an integer.", param="top_k", code="invalid_type")
        if top_k < -1:
            raise bad(f"'top_k' must be >= 1 (0 or -1: off), got {top_k}.", param="top_k", code="invalid_value")
        top_k = None if top_k <= 0 else top_k
    seed = body.get("seed")
    if seed is not None:
        if not is_int(seed):
            raise bad("'seed' must be an integer.", param="seed", code="invalid_type")
        if not -(2**63) <= seed < 2**64:
            raise bad("'seed' must fit in 64 bits.", param="seed", code="invalid_value")
    return {"temperature": float(t), "top_k": top_k, "top_p": top_p, "seed": seed}


def parse_stop(stop, max_stop: int) -> tuple[str, ...]:
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise bad("'stop' must be a string or a list of strings.", param="stop", code="invalid_type")
    if len(stop) > max_stop:
        raise bad(f"At most {max_stop} stop strings are allowed.", param="stop", code="invalid_value")
    return tuple(stop)  # empty strings dropped by GenerationConfig


def parse_coupling(ext, default: str):
    """(the request's coupling, the `selfspec` object without it): the server's rule when the
    object names none."""
    if not isinstance(ext, dict) or "coupling" not in ext:
        return default, ext
    c = ext["coupling"]
    if not isinstance(c, str):
        raise bad("'selfspec.coupling' must be a string.", param="selfspec.coupling", code="invalid_type")
    if c not in COUPLINGS:
        raise bad(f"'selfspec.coupling' must be one of {', '.join(COUPLINGS)}, got {c!r}.", param="selfspec.coupling",
                  code="invalid_value")
    return c, {k: v for k, v in ext.items() if k != "coupling"}


def parse_logprobs(body: dict, chat: bool) -> int | None:
    """How many alternatives per token to return (0: the chosen token's log-probability only), or
    None: no logprobs. Chat: logprobs (bool) + top_logprobs (0..20); completions: logprobs (0..20)."""
    lp = body.get("logprobs")
    if chat:
        if lp is not None and not isinstance(lp, bool):
            raise bad("'logprobs' must be a boolean.", param="logprobs", code="invalid_type")
        top = body.get("top_logprobs")
        if top is not None:
            if not is_int(top):
                raise bad("'top_logprobs' must be an integer.", param="top_logprobs", code="invalid_type")
            if not 0 <= top <= MAX_LOGPROBS:
                raise bad(f"'top_logprobs' must be in 0..{MAX_LOGPROBS}, got {top}.", param="top_logprobs", code="invalid_value")
            if not lp:
                raise bad("'top_logprobs' needs 'logprobs': true.", param="top_logprobs", code="invalid_value")
        return (top or 0) if lp else None
    if lp is None or lp is False:
        return None
    if not is_int(lp):
        raise bad("'logprobs' must be an integer (the number of alternatives per token).", param="logprobs", code="invalid_type")
    if not 0 <= lp <= MAX_LOGPROBS:
        raise bad(f"'logprobs' must be in 0..{MAX_LOGPROBS}, got {lp}.", param="logprobs", code="invalid_value")
    return lp


def parse_echo(body: dict, chat: bool) -> bool:
    echo = body.get("echo")
    if echo is None:
        return False
    if not isinstance(echo, bool):
        raise bad("'echo' must be a boolean.", param="echo", code="invalid_type")
    return echo and not chat


_PENALTIES = ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_p")


def parse_processors(body: dict, vocab_size: int) -> dict:
    """The logits processors' SamplingConfig fields (processors.py): penalties, min_p (their
    ranges are SamplingConfig's, checked by the builder), logit_bias."""
    out = {}
    for name in _PENALTIES:
        v = body.get(name)
        if v is None:
            continue
        if not is_num(v):
            raise bad(f"'{name}' must be a number.", param=name, code="invalid_type")
        out[name] = float(v)
    bias = body.get("logit_bias")
    if bias:
        if not isinstance(bias, dict):
            raise bad("'logit_bias' must be an object mapping token ids to biases.", param="logit_bias", code="invalid_type")
        if len(bias) > MAX_LOGIT_BIAS:
            raise bad(f"'logit_bias' may hold at most {MAX_LOGIT_BIAS} tokens.", param="logit_bias", code="invalid_value")
        items = {}
        for k, v in bias.items():
            if not (isinstance(k, str) and k.strip().lstrip("-").isdigit()) or not is_num(v):
                raise bad(f"'logit_bias' maps token ids to numbers; got {k!r}: {v!r}.", param="logit_bias", code="invalid_type")
            t = int(k)
            if not 0 <= t < vocab_size:
                raise bad(f"'logit_bias' names token {t}, outside the vocabulary (size {vocab_size}).", param="logit_bias",
                          code="invalid_value")
            if not -100 <= v <= 100:
                raise bad(f"'logit_bias' values must be in [-100, 100], got {v} for token {t}.", param="logit_bias",
                          code="invalid_value")
            items[t] = float(v)
        out["logit_bias"] = LogitBias(tuple(sorted(items.items())))
    return out


def parse_response_format(rf) -> Grammar | None:
    """OpenAI's response_format (text, json_object, json_schema) and this server's extension
    types {"type": "regex", "regex": ...} and {"type": "grammar", "grammar": <Lark>} -> the
    grammar the text must match (compiled and checked with the model's tokenizer later:
    parsing.encode)."""
    if rf is None:
        return None
    if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
        raise bad("'response_format' must be an object with a 'type'.", param="response_format", code="invalid_type")
    kind = rf["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return Grammar("json_object")
    if kind == "json_schema":
        spec = rf.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise bad("'response_format.json_schema.schema' must be a JSON schema object.", param="response_format",
                      code="invalid_type")
        return Grammar("json_schema", json.dumps(schema))
    if kind in ("regex", "grammar"):
        src = rf.get(kind)
        if not isinstance(src, str) or not src.strip():
            raise bad(f"'response_format.{kind}' must be a non-empty string.", param="response_format", code="invalid_type")
        return Grammar("regex" if kind == "regex" else "lark", src)
    raise bad(f"'response_format.type' must be one of text, json_object, json_schema, regex, grammar; got {kind!r}.",
              param="response_format", code="invalid_value")


def parse_draft(ext, ctx: ParseContext) -> DraftConfig:
    """The request's `selfspec` object -> the DraftConfig it runs with (the served one when
    absent or empty). Every check DraftConfig makes applies, unused options included."""
    served = ctx.draft
    if ext is None:
        return served
    if not isinstance(ext, dict):
        raise bad("'selfspec' must be an object.", param="selfspec", code="invalid_type")
    if not ext:
        return served
    if not ctx.settings.allow_request_draft:
        raise bad("This server does not accept per-request draft options ('selfspec').", param="selfspec",
                  code="unsupported_parameter")
    unknown = [k for k in ext if k not in REQUEST_DRAFT_OPTIONS]
    if unknown:
        raise bad(f"'selfspec.{unknown[0]}' cannot be set per request; allowed: {', '.join(REQUEST_DRAFT_OPTIONS)}.",
                  param=f"selfspec.{unknown[0]}", code="unsupported_parameter")
    try:
        opts = typed(DraftConfig, ext, text=False)  # JSON: values must have their field's type
    except ConfigError as e:
        raise bad(f"Invalid 'selfspec' draft options: {e}", param=f"selfspec.{e.field}", code="invalid_type") from None
    strategy = opts.get("strategy", served.strategy)
    if strategy not in ctx.allowed:
        raise bad(f"Strategy {strategy!r} is not allowed on this server; allowed: {', '.join(ctx.allowed)}.",
                  param="selfspec.strategy", code="invalid_value")
    try:
        # a request that changes the strategy starts from that strategy's defaults for this model,
        # not from options of the served one it would not use
        cfg = replace(served, **opts) if strategy == served.strategy else \
            DraftConfig.from_dict({**ctx.defaults.get(strategy, {}), **opts})
        if cfg.strategy == "draft-model" and served.strategy != "draft-model":
            raise SelfSpecError("draft-model is not allowed per request")
        if cfg.num_speculations > ctx.settings.max_num_speculations:
            raise ConfigError(f"num_speculations must be in 1..{ctx.settings.max_num_speculations} on this server, "
                              f"got {cfg.num_speculations}", "num_speculations")
        if cfg.max_ngram > MAX_REQUEST_NGRAM:
            raise ConfigError(f"max_ngram must be in 1..{MAX_REQUEST_NGRAM}, got {cfg.max_ngram}", "max_ngram")
        cfg.check_model(ctx.num_layers, ctx.vocab_size)
    except SelfSpecError as e:
        field = getattr(e, "field", None)
        raise bad(f"Invalid 'selfspec' draft options: {e}", param=f"selfspec.{field}" if field else "selfspec",
                  code="invalid_type" if isinstance(e, ConfigTypeError) else "invalid_value") from None
    return cfg
