"""Request parsing: a JSON body -> `Params`, as pure functions testable without HTTP.

Two stages, so that nothing expensive runs on the event loop:

    parse_request(body, chat, ctx) -> ParsedRequest   # validates every field; cheap, bounded
                                                      # work: a text prompt longer than the
                                                      # character bound is refused here, untokenized
    encode(parsed, model, ctx) -> Params              # tokenizes exactly once (run it in a thread)

The wire's fields become the keywords of selfspec's one request builder (request.configs,
Request.build, as `generate` takes them), checked by it in stage 1 (its errors as the 400 that
names the field) and built into each prompt's selfspec.Request in stage 2; what is the wire's
own (types, OpenAI's ranges and "off" values, the vocabulary, the server's limits) is checked
here and in fields.py.

Request fields honoured: model, max_tokens (or its newer name max_completion_tokens, which wins
when both are given), temperature (OpenAI's default 1.0 when absent), top_p, top_k (extension;
0 or -1 = off), seed, stop (string or list), stop_token_ids (vLLM's extension: token ids that end
the choice like EOS), n (1..MAX_N choices, one sequence each in the continuous batch; with a
seed, choice i samples with seed + i), logprobs / top_logprobs, echo (completions), the logits
processors presence_penalty, frequency_penalty, repetition_penalty, min_p, logit_bias,
response_format (text, json_object, json_schema; extensions regex and grammar), stream,
stream_options.include_usage, user (ignored), and the extension object
`"selfspec": {"strategy": ..., "exit_layer": ..., ...}` which changes the
draft configuration for this request only, within the operator's limits. An option the
chosen strategy does not use is an error (DraftConfig's own rule), as on the CLI. Its
"coupling" ("gumbel" or "rejection": SamplingConfig.coupling; the server's when absent) is a
sampling option, accepted even where draft options are not. The per-field parsers are in
fields.py; a grammar is compiled in encode (with the model's tokenizer, off the event loop).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from selfspec import strategies
from selfspec.config import DraftConfig, SamplingConfig
from selfspec.errors import SelfSpecError
from selfspec.grammar import grammar_matcher
from selfspec.request import Request, configs
from selfspec.server.errors import APIError, bad, config_error
from selfspec.server.fields import (MAX_CHOICES, is_int, parse_coupling, parse_draft, parse_echo, parse_logprobs, parse_n,
                                    parse_processors, parse_response_format, parse_sampling, parse_stop, parse_stop_token_ids)
from selfspec.server.settings import PromptLimits, ServerSettings

_COMMON_FIELDS = {"model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed", "stop",
                  "stop_token_ids", "n", "stream", "stream_options", "user", "selfspec", "metadata", "store", "service_tier",
                  "logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "logit_bias",
                  "response_format"}
_COMPLETION_FIELDS = _COMMON_FIELDS | {"prompt", "echo"}
_CHAT_FIELDS = _COMMON_FIELDS | {"messages", "top_logprobs"}
# Accepted only at their "off" value (or null): anything else is a clear 400.
_OFF_VALUES = {
    "best_of": (1,),
    "suffix": ("",),
    "tools": ([],),
    "tool_choice": ("none", "auto"),
    "functions": ([],),
    "function_call": ("none", "auto"),
    "parallel_tool_calls": (True, False),
    "modalities": (["text"],),
}
_COMPLETION_OFF = ("best_of", "suffix")
_CHAT_OFF = ("tools", "tool_choice", "functions", "function_call", "parallel_tool_calls", "modalities")
_ROLES = ("system", "developer", "user", "assistant")


@dataclass(frozen=True)
class ParseContext:
    """What parsing needs to know about the server and its model."""

    settings: ServerSettings
    names: frozenset[str]  # accepted `model` values
    draft: DraftConfig  # the served draft configuration
    allowed: tuple[str, ...]  # strategies a request may choose
    num_layers: int
    vocab_size: int
    limits: PromptLimits
    # strategy -> the options a request naming it starts from, as a call naming it would
    # (SelfSpecModel.strategy_defaults)
    defaults: dict = field(default_factory=dict)

    @classmethod
    def for_model(cls, model, draft: DraftConfig, settings: ServerSettings) -> ParseContext:
        if settings.allowed_strategies is None:
            allowed = [s for s in strategies.names() if s != "draft-model"]
        else:
            allowed = list(settings.allowed_strategies)
        if draft.strategy not in allowed:
            allowed.append(draft.strategy)  # the served configuration itself is always allowed
        # made here, at startup (a calibration, where one is made, once per model and machine)
        defaults = {s: model.strategy_defaults(s)[0] for s in allowed} if hasattr(model, "strategy_defaults") else {}
        return cls(settings, frozenset({settings.model_name, *settings.aliases}), draft, tuple(allowed),
                   model.runtime.num_layers, model.spec.vocab_size,
                   PromptLimits.for_model(settings, model.context_length, model.tokenizer), defaults)


@dataclass(frozen=True)
class ParsedRequest:
    """A validated request, its prompt not yet tokenized: exactly one of ids/text/messages
    (or `batch`)."""

    chat: bool
    model: str
    max_tokens: int  # 0: echo alone (the prompt, nothing generated)
    # request.configs' keywords (sampling, stop, stop_token_ids, logprobs, draft), checked by it:
    # Request.build's for each prompt (encode)
    options: dict
    stream: bool
    include_usage: bool
    n: int = 1
    echo: bool = False  # completions: the prompt's text (and logprobs) before the completion
    ids: list[int] | None = None  # a prompt given as token ids
    text: str | None = None  # a text prompt (completions)
    messages: list[dict] | None = None  # a conversation (chat), roles normalised
    batch: tuple[str | list[int], ...] = ()  # completions: a list of prompts (then ids and text are None)


@dataclass(frozen=True)
class Params:
    """One prompt of a request, ready for the worker: the selfspec.Request the engine runs
    (Request.build's, as `generate` builds its own) and what only the server needs."""

    request: Request
    model: str
    max_tokens: int  # as asked; 0: echo alone, the request is not run (its budget is then 1)
    stream: bool
    include_usage: bool
    n: int = 1  # choices
    echo: bool = False
    echo_text: str = ""  # echo: the prompt's text, returned before the completion

    @property
    def prompt_ids(self) -> list[int]:
        return list(self.request.prompt_ids)

    @property
    def sampling(self) -> SamplingConfig:
        return self.request.sampling

    @property
    def draft(self) -> DraftConfig:
        return self.request.draft

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        return self.request.gen.stop_token_ids

    @property
    def logprobs(self) -> int | None:
        return self.request.gen.logprobs


def _is_off(name: str, v) -> bool:
    if v is None:
        return True
    for o in _OFF_VALUES[name]:
        if isinstance(o, bool) or isinstance(v, bool):
            if v is o:
                return True
        elif v == o:
            return True
    return False


# ---- stage 1: validation (cheap, on the event loop) --------------------------------------


def parse_request(body: dict, chat: bool, ctx: ParseContext) -> ParsedRequest:
    """Validate every field of a request body; the prompt is checked against the limits as far
    as that is possible without tokenizing (token ids: exactly; text: the character bound)."""
    _check_fields(body, chat)
    model = _parse_model(body.get("model"), ctx)
    n = parse_n(body.get("n"))
    stream, include_usage = _parse_stream(body)
    echo = parse_echo(body, chat)
    max_tokens = _parse_max_tokens(body, chat, ctx.settings, echo)
    coupling, ext = parse_coupling(body.get("selfspec"), ctx.settings.coupling)
    options = {**parse_sampling(body), "coupling": coupling, **parse_processors(body, ctx.vocab_size),
               "grammar": parse_response_format(body.get("response_format")),
               "stop": parse_stop(body.get("stop"), ctx.settings.max_stop), "draft": parse_draft(ext, ctx),
               "logprobs": parse_logprobs(body, chat),
               "stop_token_ids": parse_stop_token_ids(body.get("stop_token_ids"), ctx.vocab_size)}
    _check_options(options, max_tokens)
    common = dict(chat=chat, model=model, max_tokens=max_tokens, options=options, stream=stream,
                  include_usage=include_usage, n=n, echo=echo)
    if chat:
        return ParsedRequest(**common, messages=parse_messages(body.get("messages"), ctx.limits))
    prompts = parse_prompts(body.get("prompt"), ctx, n)
    if len(prompts) > 1:
        return ParsedRequest(**common, batch=tuple(prompts))
    return ParsedRequest(**common, **_one(prompts[0]))


def _check_options(options: dict, max_tokens: int) -> None:
    """The options checked by the builder itself (request.configs), before any tokenizing."""
    try:
        configs(max_new_tokens=max(max_tokens, 1), **options)
    except SelfSpecError as e:
        raise config_error(e) from None


def _one(prompt: str | list[int]) -> dict:
    return {"text": prompt} if isinstance(prompt, str) else {"ids": prompt}


def _check_fields(body: dict, chat: bool) -> None:
    allowed = _CHAT_FIELDS if chat else _COMPLETION_FIELDS
    off = _CHAT_OFF if chat else _COMPLETION_OFF
    for k, v in body.items():
        if k in off:
            if not _is_off(k, v):
                raise bad(f"'{k}' is not supported by this server (only its default value is accepted).", param=k,
                          code="unsupported_parameter")
        elif k not in allowed:
            raise bad(f"Unrecognized request argument supplied: {k}", param=k, code="unrecognized_argument")


def _parse_model(model, ctx: ParseContext) -> str:
    if model is None:
        raise bad("You must provide a model parameter.", param="model", code="missing_required_parameter")
    if not isinstance(model, str):
        raise bad("'model' must be a string.", param="model", code="invalid_type")
    if model not in ctx.names:
        raise APIError(404, f"The model '{model}' does not exist; this server serves '{ctx.settings.model_name}'.",
                       param="model", code="model_not_found")
    return model


def _parse_stream(body: dict) -> tuple[bool, bool]:
    stream = body.get("stream")
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise bad("'stream' must be a boolean.", param="stream", code="invalid_type")
    so = body.get("stream_options")
    if so is None:
        return stream, False
    if not stream:
        raise bad("'stream_options' is only allowed when 'stream' is true.", param="stream_options")
    if not isinstance(so, dict):
        raise bad("'stream_options' must be an object.", param="stream_options", code="invalid_type")
    iu = so.get("include_usage", False)
    if not isinstance(iu, bool):
        raise bad("'stream_options.include_usage' must be a boolean.", param="stream_options", code="invalid_type")
    return stream, iu


def _parse_max_tokens(body: dict, chat: bool, settings: ServerSettings, echo: bool = False) -> int:
    """The budget; 0 only with echo (the prompt alone, e.g. to score it)."""
    max_tokens, pname = body.get("max_tokens"), "max_tokens"
    if body.get("max_completion_tokens") is not None:
        max_tokens, pname = body["max_completion_tokens"], "max_completion_tokens"
    if max_tokens is None:
        return settings.default_max_tokens
    if not is_int(max_tokens):
        raise bad(f"'{pname}' must be an integer.", param=pname, code="invalid_type")
    if max_tokens < 1 and not (echo and max_tokens == 0):
        raise bad(f"'{pname}' must be at least 1, got {max_tokens}.", param=pname, code="invalid_value")
    if max_tokens > settings.max_new_tokens_limit:
        raise bad(f"'{pname}' is {max_tokens}; this server allows at most {settings.max_new_tokens_limit}.",
                  param=pname, code="max_tokens_exceeded")
    return max_tokens


def too_long(n: int, limits: PromptLimits, param: str, at_least: bool = False) -> APIError:
    """The 400 for a prompt over the context or the server's prompt limit."""
    has = f"at least {n}" if at_least else str(n)
    if limits.max_prompt_tokens < limits.context_length - 1:
        msg = f"This server accepts prompts of at most {limits.max_prompt_tokens} tokens; the prompt has {has} tokens."
    else:
        msg = f"This model's maximum context length is {limits.context_length} tokens; the prompt has {has} tokens."
    return bad(msg, param=param, code="context_length_exceeded")


def _check_chars(chars: int, limits: PromptLimits, param: str) -> None:
    if chars > limits.max_prompt_chars:
        # each token covers at most max_prompt_chars / max_prompt_tokens characters
        per_token = max(limits.max_prompt_chars // limits.max_prompt_tokens, 1)
        raise too_long(-(-chars // per_token), limits, param, at_least=True)


def parse_prompts(prompt, ctx: ParseContext, n: int = 1) -> list[str | list[int]]:
    """A completion's prompts: one (text or token ids) or, as the OpenAI API allows, a list of
    them (of texts or of token id lists; lm-eval sends one with batch_size > 1)."""
    if prompt is None:
        raise bad("You must provide a prompt.", param="prompt", code="missing_required_parameter")
    if not (isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt)):
        return [parse_prompt(prompt, ctx)]
    if len(prompt) * n > MAX_CHOICES:
        raise bad(f"A request may ask for at most {MAX_CHOICES} choices (prompts x n); this one asks for {len(prompt) * n}.",
                  param="prompt", code="invalid_value")
    return [parse_prompt(p, ctx, f"prompt[{i}]") for i, p in enumerate(prompt)]


def parse_prompt(prompt, ctx: ParseContext, param: str = "prompt") -> str | list[int]:
    """A completion prompt: text (checked against the character bound) or token ids."""
    if isinstance(prompt, str):
        if not prompt.strip():
            raise bad("The prompt is empty.", param=param, code="empty_prompt")
        _check_chars(len(prompt), ctx.limits, param)
        return prompt
    if isinstance(prompt, list):
        if not prompt:
            raise bad("The prompt is empty.", param=param, code="empty_prompt")
        if all(is_int(t) for t in prompt):
            check_ids(prompt, ctx.limits, ctx.vocab_size, param)
            return list(prompt)
    raise bad(f"'{param}' must be a string, a list of token ids, or a list of those.", param=param, code="invalid_type")


def check_ids(ids: list[int], limits: PromptLimits, vocab_size: int, param: str) -> None:
    if len(ids) > limits.max_prompt_tokens:
        raise too_long(len(ids), limits, param)
    bad_ids = [t for t in ids if not 0 <= t < vocab_size]
    if bad_ids:
        raise bad(f"Token id {bad_ids[0]} is outside the vocabulary (size {vocab_size}).", param=param, code="invalid_value")


def parse_messages(messages, limits: PromptLimits) -> list[dict]:
    """Chat messages -> [{"role", "content"}] (text parts joined, developer = system),
    checked against the character bound (the template only adds characters)."""
    if messages is None:
        raise bad("You must provide messages.", param="messages", code="missing_required_parameter")
    if not isinstance(messages, list):
        raise bad("'messages' must be a list.", param="messages", code="invalid_type")
    if not messages:
        raise bad("'messages' is empty.", param="messages", code="empty_prompt")
    msgs = [_parse_message(m, f"messages[{i}]") for i, m in enumerate(messages)]
    if not any(m["content"].strip() for m in msgs):
        raise bad("The messages are empty.", param="messages", code="empty_prompt")
    _check_chars(sum(len(m["content"]) for m in msgs), limits, "messages")
    return msgs


def _parse_message(m, p: str) -> dict:
    if not isinstance(m, dict):
        raise bad(f"'{p}' must be an object.", param=p, code="invalid_type")
    role = m.get("role")
    if role not in _ROLES:
        raise bad(f"'{p}.role' must be one of {', '.join(_ROLES)}; got {role!r}.", param=f"{p}.role", code="invalid_value")
    content = m.get("content")
    if isinstance(content, list):
        parts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise bad(f"'{p}.content' parts must be text parts ({{\"type\": \"text\", \"text\": ...}}).",
                          param=f"{p}.content", code="unsupported_parameter")
            parts.append(part["text"])
        content = "".join(parts)
    if content is None and role == "assistant":
        content = ""
    if not isinstance(content, str):
        raise bad(f"'{p}.content' must be a string.", param=f"{p}.content", code="invalid_type")
    return {"role": "system" if role == "developer" else role, "content": content}


# ---- stage 2: tokenization (once; in a worker thread, never on the event loop) -----------


def encode_all(req: ParsedRequest, model, ctx: ParseContext) -> list[Params]:
    """encode() for each of the request's prompts (a list of them: `batch`; else the one)."""
    if not req.batch:
        return [encode(req, model, ctx)]
    return [encode(replace(req, batch=(), **_one(p)), model, ctx) for p in req.batch]


def encode(req: ParsedRequest, model, ctx: ParseContext) -> Params:
    """Tokenize the request's prompt exactly once, check the result against the limits, and
    build its selfspec.Request (Request.build: the budget cut to the context left)."""
    if req.ids is not None:
        ids, param = req.ids, "prompt"
    elif req.text is not None:
        ids, param = _tokenize(req.text, model), "prompt"
    else:
        ids, param = _chat_ids(req.messages, model), "messages"
    check_ids(ids, ctx.limits, ctx.vocab_size, param)
    grammar = req.options.get("grammar")
    if grammar is not None:
        try:
            grammar_matcher(model, grammar)  # compiled (and cached) here, off the event loop
        except SelfSpecError as e:
            raise bad(f"Invalid 'response_format': {e}.", param="response_format", code="invalid_value") from None
    try:  # max_tokens 0: echo alone, never run
        request = Request.build(model, ids, max_new_tokens=max(req.max_tokens, 1), **req.options)
    except SelfSpecError as e:
        raise config_error(e) from None
    return Params(request, req.model, req.max_tokens, req.stream, req.include_usage, req.n, req.echo,
                  _echo_text(req, ids, model) if req.echo else "")


def _echo_text(req: ParsedRequest, ids: list[int], model) -> str:
    if req.text is not None:
        return req.text
    return model.tokenizer.decode(ids) if model.tokenizer is not None else ""


def _tokenize(text: str, model) -> list[int]:
    if model.tokenizer is None:
        raise bad("This model has no tokenizer: send the prompt as token ids.", param="prompt", code="invalid_value")
    ids = model.tokenizer(text).input_ids  # what model.encode does, without its second pass over the limits
    if not ids:
        raise bad("The prompt is empty.", param="prompt", code="empty_prompt")
    return [int(t) for t in ids]


def _chat_ids(msgs: list[dict], model) -> list[int]:
    if model.tokenizer is None or not model.chat_template:
        raise bad("This model has no chat template (start the server with --chat-template FILE|NAME): use /v1/completions.",
                  param="messages", code="unsupported_parameter")
    try:
        return model.chat_ids(msgs)  # the model's template: its tokenizer's, --chat-template, or its family's
    except SelfSpecError as e:  # e.g. roles that do not alternate
        msg = str(e)
        raise bad(f"{msg[:1].upper()}{msg[1:]}.", param="messages", code="invalid_value") from None
