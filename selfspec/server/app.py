"""The OpenAI-compatible HTTP app: `create_app(model, draft_config, settings)` -> FastAPI.

Endpoints
    POST /v1/completions        prompt (string, or token ids) -> text; `stream: true` = SSE
    POST /v1/chat/completions   messages -> the tokenizer's chat template -> text; SSE too
    GET  /v1/models             the served model (one)
    GET  /health                liveness + queue depth (no API key needed)
    GET  /metrics               Prometheus text format (no API key needed)

Request fields honoured: model, max_tokens (chat: also max_completion_tokens), temperature
(OpenAI's default 1.0 when absent), top_p, top_k (extension; 0 or -1 = off), seed, stop
(string or list), n (1 only), stream, stream_options.include_usage, user (ignored), and the
extension object

    "selfspec": {"strategy": "early-exit", "exit_layer": 12, "num_speculations": 4, ...}

which changes the draft configuration for this request only, within the operator's limits
(`ServerSettings.allowed_strategies`, `.max_num_speculations`, `.allow_request_draft`).
Greedy output never depends on it (decoding is lossless); only speed does.

Every non-streamed response, and the final usage chunk of a stream with
`stream_options: {"include_usage": true}`, carries an extra top-level `selfspec` object with
the generation's speculative statistics (drafted, accepted, acceptance_rate,
mean_accepted_length, verify_steps, timings, the draft config used).

Concurrency: the engine is synchronous and single-threaded, so one dedicated worker thread
runs one generation at a time, in arrival (FIFO) order. At most `max_concurrency` requests
are admitted at once (one generating, the rest waiting); the next gets 429 at once with
Retry-After. One that waits longer than `queue_timeout_s` gets 503. A client that goes away
(mid-stream or while waiting) sets its job's cancel flag, which the engine's on_event
callback checks after every committed token, so the engine is free for the next request
after at most one more decoding step.

Errors use OpenAI's shape: {"error": {"message", "type", "param", "code"}}.
"""

import asyncio
import hmac
import json
import logging
import math
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, fields, replace

from selfspec.config import MAX_SPECULATIONS, STRATEGIES, ConfigError, ConfigTypeError, DraftConfig, SamplingConfig, coerce_fields, typed
from selfspec.errors import SelfSpecError

log = logging.getLogger("selfspec.server")

# Draft options a request may set in its `selfspec` object. Never draft_model (a path on the
# server's disk) nor draft_vocab (allocates a slice of the LM head per value).
REQUEST_DRAFT_OPTIONS = (
    "strategy",
    "exit_layer",
    "num_speculations",
    "skip_attn",
    "skip_mlp",
    "draft_threshold",
    "adaptive",
    "max_ngram",
)
MAX_REQUEST_NGRAM = 8


@dataclass
class ServerSettings:
    """What the operator decides. Validated on creation (SelfSpecError)."""

    model_name: str = "selfspec"  # the `model` id clients send and /v1/models lists
    aliases: tuple[str, ...] = ()  # other accepted `model` values (e.g. the --model path)
    api_key: str | None = None  # when set, /v1/* needs `Authorization: Bearer KEY`
    max_concurrency: int = 16  # requests admitted at once (1 generating + waiting); more -> 429
    queue_timeout_s: float = 30.0  # waiting longer than this for the engine -> 503
    max_new_tokens_limit: int = 1024  # max_tokens above this -> 400
    default_max_tokens: int = 128  # when a request gives no max_tokens
    allowed_strategies: tuple[str, ...] | None = None  # per-request strategies; None = all but draft-model
    max_num_speculations: int = MAX_SPECULATIONS  # per-request K cap
    allow_request_draft: bool = True  # honour the `selfspec` extension object at all
    max_stop: int = 16  # most stop strings per request
    max_request_bytes: int = 8 * 1024 * 1024  # larger bodies -> 413
    replica_id: str = ""  # shown in the X-SelfSpec-Replica header and the stats (Ray Serve)

    def __post_init__(self):
        coerce_fields(self)
        self.aliases = tuple(a for a in self.aliases if a and a != self.model_name)
        if not self.model_name:
            raise SelfSpecError("the served model name is empty")
        for name in ("max_concurrency", "max_new_tokens_limit", "default_max_tokens", "max_stop", "max_request_bytes"):
            v = getattr(self, name)
            if v < 1:
                raise SelfSpecError(f"{name} must be a positive integer, got {v!r}")
        if not (self.queue_timeout_s > 0):
            raise SelfSpecError(f"queue_timeout_s must be > 0, got {self.queue_timeout_s!r}")
        if not 1 <= self.max_num_speculations <= MAX_SPECULATIONS:
            raise SelfSpecError(f"max_num_speculations must be in 1..{MAX_SPECULATIONS}, got {self.max_num_speculations}")
        if self.allowed_strategies is not None:
            self.allowed_strategies = tuple(self.allowed_strategies)
            bad = [s for s in self.allowed_strategies if s not in STRATEGIES]
            if bad:
                raise SelfSpecError(f"unknown strategy {bad[0]!r} in allowed strategies; choose from {', '.join(STRATEGIES)}")
        self.default_max_tokens = min(self.default_max_tokens, self.max_new_tokens_limit)
        if self.api_key == "":
            self.api_key = None

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


# ---- errors -----------------------------------------------------------------------------


class APIError(Exception):
    """An error answered to the client in OpenAI's shape."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param=None, code=None, headers=None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class _Cancelled(Exception):
    """Raised from on_event inside the engine to abandon a generation whose client left."""


class _ClientGone(Exception):
    pass


def _bad(message: str, param=None, code=None) -> APIError:
    return APIError(400, message, param=param, code=code)


# ---- request parsing --------------------------------------------------------------------

_COMMON_FIELDS = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "n", "stream",
                  "stream_options", "user", "selfspec", "metadata", "store", "service_tier"}
_COMPLETION_FIELDS = _COMMON_FIELDS | {"prompt"}
_CHAT_FIELDS = _COMMON_FIELDS | {"messages", "max_completion_tokens"}
# Accepted only at their "off" value (or null): anything else is a clear 400.
_OFF_VALUES = {
    "presence_penalty": (0,),
    "frequency_penalty": (0,),
    "repetition_penalty": (1,),
    "logit_bias": ({},),
    "logprobs": (False, 0),
    "top_logprobs": (0,),
    "best_of": (1,),
    "echo": (False,),
    "suffix": ("",),
    "tools": ([],),
    "tool_choice": ("none", "auto"),
    "functions": ([],),
    "function_call": ("none", "auto"),
    "parallel_tool_calls": (True, False),
    "response_format": ({"type": "text"},),
    "modalities": (["text"],),
}
_COMPLETION_OFF = ("presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "logprobs", "best_of", "echo", "suffix")
_CHAT_OFF = ("presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "logprobs", "top_logprobs", "tools",
             "tool_choice", "functions", "function_call", "parallel_tool_calls", "response_format", "modalities")


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


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


@dataclass
class _Params:
    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingConfig
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    draft: DraftConfig
    model: str


# ---- the job a request hands to the engine thread ---------------------------------------


class _Job:
    def __init__(self, loop: asyncio.AbstractEventLoop, params: _Params, stream: bool, t_arrival: float | None = None):
        self.loop = loop
        self.params = params
        self.stream = stream
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancelled = threading.Event()
        self.finished = False
        self.t_arrival = time.perf_counter() if t_arrival is None else t_arrival
        self.t_start: float | None = None
        self.t_first: float | None = None
        self.t_last: float | None = None
        self.n_tokens = 0

    def post(self, *item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, item)
        except RuntimeError:  # the loop is closed: the server is shutting down
            self.cancelled.set()

    def on_event(self, ev) -> None:  # runs on the engine thread, once per committed token
        if self.cancelled.is_set():
            raise _Cancelled()
        now = time.perf_counter()
        if self.t_first is None:
            self.t_first = now
        self.t_last = now
        self.n_tokens += 1
        if self.stream and ev.text:
            self.post("tok", ev.text)

    def cancel(self) -> None:
        self.cancelled.set()


# ---- the app ----------------------------------------------------------------------------


class _Metrics:
    def __init__(self, model_name: str, fingerprint: str, strategy: str):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        r = self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("selfspec_requests", "HTTP requests answered, by endpoint and status", ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("selfspec_prompt_tokens", "Prompt tokens processed", registry=r)
        self.generation_tokens = Counter("selfspec_generation_tokens", "Tokens generated", registry=r)
        self.drafted = Counter("selfspec_draft_tokens", "Draft tokens proposed", registry=r)
        self.accepted = Counter("selfspec_accepted_draft_tokens", "Draft tokens accepted by the verifier", registry=r)
        self.verify_steps = Counter("selfspec_verify_steps", "Verify (full model) steps", registry=r)
        self.cancelled = Counter("selfspec_cancelled_generations", "Generations abandoned because the client left", registry=r)
        self.rejected = Counter("selfspec_rejected_requests", "Requests refused for overload", ["reason"], registry=r)
        self._totals = {"drafted": 0, "accepted": 0, "steps": 0}
        self._lock = threading.Lock()
        g = Gauge("selfspec_acceptance_rate", "Accepted / drafted tokens since start", registry=r)
        g.set_function(lambda: self._totals["accepted"] / max(self._totals["drafted"], 1))
        g = Gauge("selfspec_mean_accepted_length", "Tokens committed per verify step since start (the verifier's own included)", registry=r)
        g.set_function(lambda: (self._totals["accepted"] + self._totals["steps"]) / self._totals["steps"] if self._totals["steps"] else 0.0)
        self.waiting = Gauge("selfspec_requests_waiting", "Requests admitted and waiting for the engine", registry=r)
        self.running = Gauge("selfspec_requests_running", "Requests being generated (0 or 1)", registry=r)
        self.ttft = Histogram("selfspec_time_to_first_token_seconds", "Request arrival to first generated token",
                              buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60), registry=r)
        self.tpot = Histogram("selfspec_time_per_output_token_seconds", "Mean time per generated token after the first, per request",
                              buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1), registry=r)
        self.latency = Histogram("selfspec_request_latency_seconds", "Request arrival to last token",
                                 buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120), registry=r)
        self.queue_time = Histogram("selfspec_queue_time_seconds", "Time waiting for the engine",
                                    buckets=(0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30), registry=r)
        info = Gauge("selfspec_model_info", "The served model", ["model", "fingerprint", "strategy"], registry=r)
        info.labels(model_name, fingerprint, strategy).set(1)

    def add_generation(self, stats) -> None:
        self.drafted.inc(stats.drafted)
        self.accepted.inc(stats.accepted)
        self.verify_steps.inc(stats.verify_steps)
        with self._lock:
            self._totals["drafted"] += stats.drafted
            self._totals["accepted"] += stats.accepted
            self._totals["steps"] += stats.verify_steps


class _Server:
    """State shared by the routes: the model, the engine thread, admission, metrics."""

    def __init__(self, model, draft_config: DraftConfig, settings: ServerSettings):
        self.model = model
        self.draft = draft_config
        self.settings = settings
        self.names = {settings.model_name, *settings.aliases}
        self.created = int(time.time())
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="selfspec-engine")
        self.admitted = 0  # requests between admission and their response's end
        self.submitted = 0  # jobs handed to the engine thread (written on the event loop only)
        self.taken = 0  # jobs the engine thread has picked up, run or skipped (written there only)
        self.ewma_job_s = 1.0  # for Retry-After
        fp = getattr(model, "fingerprint", "") or ""
        self.fingerprint = f"selfspec-{fp}" if fp else "selfspec"
        self.metrics = _Metrics(settings.model_name, fp, draft_config.strategy)
        self.metrics.waiting.set_function(lambda: self.waiting)
        self.num_layers = model.runtime.num_layers
        self.vocab_size = model.spec.vocab_size
        if settings.allowed_strategies is None:
            allowed = [s for s in STRATEGIES if s != "draft-model"]
        else:
            allowed = list(settings.allowed_strategies)
        if draft_config.strategy not in allowed:
            allowed.append(draft_config.strategy)  # the served configuration itself is always allowed
        self.allowed = tuple(allowed)
        self.live: set = set()  # jobs submitted and not yet finished by the engine thread

    def shutdown(self) -> None:
        for job in list(self.live):
            job.cancel()
        self.executor.shutdown(wait=False, cancel_futures=True)

    # -- parsing ------------------------------------------------------------------------

    def check_auth(self, request) -> None:
        key = self.settings.api_key
        if key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if not header:
            raise APIError(401, "Missing API key: send it as 'Authorization: Bearer KEY'.", code="invalid_api_key")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
            raise APIError(401, "Incorrect API key provided.", code="invalid_api_key")

    async def read_json(self, request) -> dict:
        limit = self.settings.max_request_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise APIError(413, f"The request body is larger than {limit} bytes.", code="request_too_large")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise APIError(413, f"The request body is larger than {limit} bytes.", code="request_too_large")
            chunks.append(chunk)
        raw = b"".join(chunks)
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise _bad(f"The request body is not valid JSON: {e}", code="invalid_json") from None
        if not isinstance(body, dict):
            raise _bad("The request body must be a JSON object.", code="invalid_json")
        return body

    def parse(self, body: dict, chat: bool) -> _Params:
        allowed = _CHAT_FIELDS if chat else _COMPLETION_FIELDS
        off = _CHAT_OFF if chat else _COMPLETION_OFF
        for k, v in body.items():
            if k in off:
                if not _is_off(k, v):
                    raise _bad(f"'{k}' is not supported by this server (only its default value is accepted).", param=k, code="unsupported_parameter")
            elif k not in allowed:
                raise _bad(f"Unrecognized request argument supplied: {k}", param=k, code="unrecognized_argument")

        model = body.get("model")
        if model is None:
            raise _bad("You must provide a model parameter.", param="model", code="missing_required_parameter")
        if not isinstance(model, str):
            raise _bad("'model' must be a string.", param="model", code="invalid_type")
        if model not in self.names:
            raise APIError(404, f"The model '{model}' does not exist; this server serves '{self.settings.model_name}'.",
                           param="model", code="model_not_found")

        n = body.get("n")
        if n is not None and (not _is_int(n) or n != 1):
            raise _bad("Only n=1 is supported (one completion per request).", param="n", code="unsupported_parameter")

        stream = body.get("stream")
        if stream is None:
            stream = False
        if not isinstance(stream, bool):
            raise _bad("'stream' must be a boolean.", param="stream", code="invalid_type")
        include_usage = False
        so = body.get("stream_options")
        if so is not None:
            if not stream:
                raise _bad("'stream_options' is only allowed when 'stream' is true.", param="stream_options")
            if not isinstance(so, dict):
                raise _bad("'stream_options' must be an object.", param="stream_options", code="invalid_type")
            iu = so.get("include_usage", False)
            if not isinstance(iu, bool):
                raise _bad("'stream_options.include_usage' must be a boolean.", param="stream_options", code="invalid_type")
            include_usage = iu

        max_tokens = body.get("max_tokens")
        pname = "max_tokens"
        if chat and body.get("max_completion_tokens") is not None:
            max_tokens, pname = body["max_completion_tokens"], "max_completion_tokens"
        if max_tokens is None:
            max_tokens = self.settings.default_max_tokens
        elif not _is_int(max_tokens):
            raise _bad(f"'{pname}' must be an integer.", param=pname, code="invalid_type")
        elif max_tokens < 1:
            raise _bad(f"'{pname}' must be at least 1, got {max_tokens}.", param=pname, code="invalid_value")
        elif max_tokens > self.settings.max_new_tokens_limit:
            raise _bad(f"'{pname}' is {max_tokens}; this server allows at most {self.settings.max_new_tokens_limit}.",
                       param=pname, code="max_tokens_exceeded")

        sampling = self._parse_sampling(body)
        stop = self._parse_stop(body.get("stop"))
        draft = self._parse_draft(body.get("selfspec"))
        ids = self._encode_chat(body.get("messages")) if chat else self._encode_prompt(body.get("prompt"))
        ctx = self.model.context_length
        if len(ids) >= ctx:
            raise _bad(f"This model's maximum context length is {ctx} tokens; the prompt has {len(ids)} tokens.",
                       param="messages" if chat else "prompt", code="context_length_exceeded")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise _bad(f"Token id {bad[0]} is outside the vocabulary (size {self.vocab_size}).", param="prompt", code="invalid_value")
        return _Params(ids, max_tokens, sampling, stop, stream, include_usage, draft, model)

    def _parse_sampling(self, body: dict) -> SamplingConfig:
        t = body.get("temperature")
        if t is None:
            t = 1.0
        if not _is_num(t):
            raise _bad("'temperature' must be a number.", param="temperature", code="invalid_type")
        if not 0 <= t <= 2:
            raise _bad(f"'temperature' must be in [0, 2], got {t}.", param="temperature", code="invalid_value")
        top_p = body.get("top_p")
        if top_p is not None:
            if not _is_num(top_p):
                raise _bad("'top_p' must be a number.", param="top_p", code="invalid_type")
            if not 0 < top_p <= 1:
                raise _bad(f"'top_p' must be in (0, 1], got {top_p}.", param="top_p", code="invalid_value")
            top_p = None if top_p == 1 else float(top_p)
        top_k = body.get("top_k")
        if top_k is not None:
            if not _is_int(top_k):
                raise _bad("'top_k' must be an integer.", param="top_k", code="invalid_type")
            if top_k < -1:
                raise _bad(f"'top_k' must be >= 1 (0 or -1: off), got {top_k}.", param="top_k", code="invalid_value")
            top_k = None if top_k <= 0 else top_k
        seed = body.get("seed")
        if seed is not None:
            if not _is_int(seed):
                raise _bad("'seed' must be an integer.", param="seed", code="invalid_type")
            if not -(2**63) <= seed < 2**64:
                raise _bad("'seed' must fit in 64 bits.", param="seed", code="invalid_value")
        try:
            return SamplingConfig(temperature=float(t), top_k=top_k, top_p=top_p, seed=seed)
        except SelfSpecError as e:
            raise _bad(str(e), code="invalid_value") from None

    def _parse_stop(self, stop) -> tuple[str, ...]:
        if stop is None:
            return ()
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise _bad("'stop' must be a string or a list of strings.", param="stop", code="invalid_type")
        if len(stop) > self.settings.max_stop:
            raise _bad(f"At most {self.settings.max_stop} stop strings are allowed.", param="stop", code="invalid_value")
        return tuple(s for s in stop if s)

    def _parse_draft(self, ext) -> DraftConfig:
        if ext is None:
            return self.draft
        if not isinstance(ext, dict):
            raise _bad("'selfspec' must be an object.", param="selfspec", code="invalid_type")
        if not ext:
            return self.draft
        if not self.settings.allow_request_draft:
            raise _bad("This server does not accept per-request draft options ('selfspec').", param="selfspec", code="unsupported_parameter")
        unknown = [k for k in ext if k not in REQUEST_DRAFT_OPTIONS]
        if unknown:
            raise _bad(f"'selfspec.{unknown[0]}' cannot be set per request; allowed: {', '.join(REQUEST_DRAFT_OPTIONS)}.",
                       param=f"selfspec.{unknown[0]}", code="unsupported_parameter")
        try:
            opts = typed(DraftConfig, ext, text=False)  # JSON: values must have their field's type
        except ConfigError as e:
            raise _bad(f"Invalid 'selfspec' draft options: {e}", param=f"selfspec.{e.field}", code="invalid_type") from None
        strategy = opts.get("strategy", self.draft.strategy)
        if strategy not in self.allowed:
            raise _bad(f"Strategy {strategy!r} is not allowed on this server; allowed: {', '.join(self.allowed)}.",
                       param="selfspec.strategy", code="invalid_value")
        try:
            # a request that changes the strategy starts from that strategy's defaults, not from
            # options of the served one it would not use
            cfg = (replace(self.draft, **opts) if strategy == self.draft.strategy else DraftConfig.from_dict(opts))
            if cfg.strategy == "draft-model" and self.draft.strategy != "draft-model":
                raise SelfSpecError("draft-model is not allowed per request")
            if cfg.num_speculations > self.settings.max_num_speculations:
                raise ConfigError(f"num_speculations must be in 1..{self.settings.max_num_speculations} on this server, "
                                  f"got {cfg.num_speculations}", "num_speculations")
            if cfg.max_ngram > MAX_REQUEST_NGRAM:
                raise ConfigError(f"max_ngram must be in 1..{MAX_REQUEST_NGRAM}, got {cfg.max_ngram}", "max_ngram")
            cfg.check_model(self.num_layers, self.vocab_size)
        except SelfSpecError as e:
            field = getattr(e, "field", None)
            raise _bad(f"Invalid 'selfspec' draft options: {e}", param=f"selfspec.{field}" if field else "selfspec",
                       code="invalid_type" if isinstance(e, ConfigTypeError) else "invalid_value") from None
        return cfg

    def _encode_prompt(self, prompt) -> list[int]:
        if prompt is None:
            raise _bad("You must provide a prompt.", param="prompt", code="missing_required_parameter")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            if not prompt.strip():
                raise _bad("The prompt is empty.", param="prompt", code="empty_prompt")
            return self._tokenize(prompt, param="prompt")
        if isinstance(prompt, list):
            if not prompt:
                raise _bad("The prompt is empty.", param="prompt", code="empty_prompt")
            if all(_is_int(t) for t in prompt):
                return list(prompt)
            if all(isinstance(p, (str, list)) for p in prompt):
                raise _bad("Batched prompts are not supported: send one prompt per request.", param="prompt", code="unsupported_parameter")
        raise _bad("'prompt' must be a string or a list of token ids.", param="prompt", code="invalid_type")

    def _tokenize(self, text: str, param: str) -> list[int]:
        try:
            return self.model.encode(text, chat=False)
        except SelfSpecError as e:
            if "context" in str(e):  # reported with the right code by the caller
                return self.model.tokenizer(text).input_ids
            raise _bad(str(e), param=param, code="invalid_value") from None

    def _encode_chat(self, messages) -> list[int]:
        if messages is None:
            raise _bad("You must provide messages.", param="messages", code="missing_required_parameter")
        if not isinstance(messages, list):
            raise _bad("'messages' must be a list.", param="messages", code="invalid_type")
        if not messages:
            raise _bad("'messages' is empty.", param="messages", code="empty_prompt")
        msgs = []
        for i, m in enumerate(messages):
            p = f"messages[{i}]"
            if not isinstance(m, dict):
                raise _bad(f"'{p}' must be an object.", param=p, code="invalid_type")
            role = m.get("role")
            if role not in ("system", "developer", "user", "assistant"):
                raise _bad(f"'{p}.role' must be one of system, developer, user, assistant; got {role!r}.", param=f"{p}.role", code="invalid_value")
            content = m.get("content")
            if isinstance(content, list):
                parts = []
                for part in content:
                    if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                        raise _bad(f"'{p}.content' parts must be text parts ({{\"type\": \"text\", \"text\": ...}}).",
                                   param=f"{p}.content", code="unsupported_parameter")
                    parts.append(part["text"])
                content = "".join(parts)
            if content is None and role == "assistant":
                content = ""
            if not isinstance(content, str):
                raise _bad(f"'{p}.content' must be a string.", param=f"{p}.content", code="invalid_type")
            msgs.append({"role": "system" if role == "developer" else role, "content": content})
        if not any(m["content"].strip() for m in msgs):
            raise _bad("The messages are empty.", param="messages", code="empty_prompt")
        if self.model.tokenizer is None or not self.model.chat_template:
            raise _bad("This model has no chat template (start the server with --chat-template FILE|NAME): use /v1/completions.",
                       param="messages", code="unsupported_parameter")
        try:
            return self.model.chat_ids(msgs)  # the model's template: its tokenizer's, --chat-template, or its family's
        except SelfSpecError as e:  # e.g. roles that do not alternate
            msg = str(e)
            raise _bad(f"{msg[:1].upper()}{msg[1:]}.", param="messages", code="invalid_value") from None

    # -- admission and the engine thread -------------------------------------------------

    @property
    def waiting(self) -> int:
        return max(self.submitted - self.taken, 0)

    def admit(self) -> None:
        if self.admitted >= self.settings.max_concurrency:
            self.metrics.rejected.labels("queue_full").inc()
            wait = max(1, min(60, math.ceil(self.ewma_job_s * max(self.waiting, 1))))
            raise APIError(429, f"The server is at capacity ({self.settings.max_concurrency} requests in progress); retry later.",
                           type="rate_limit_error", code="rate_limit_exceeded", headers={"Retry-After": str(wait)})
        self.admitted += 1

    def release(self) -> None:
        self.admitted -= 1

    def submit(self, job: _Job) -> None:
        self.submitted += 1
        self.live.add(job)
        self.executor.submit(self._run, job)

    def _run(self, job: _Job) -> None:  # the engine thread
        self.taken += 1
        if job.cancelled.is_set():
            self.live.discard(job)
            job.post("skipped")
            return
        job.t_start = time.perf_counter()
        job.post("start")
        self.metrics.running.set(1)
        self.metrics.queue_time.observe(job.t_start - job.t_arrival)
        p = job.params
        try:
            result = self.model.generate(
                p.prompt_ids,
                max_new_tokens=p.max_tokens,
                temperature=p.sampling.temperature,
                top_k=p.sampling.top_k,
                top_p=p.sampling.top_p,
                seed=p.sampling.seed,
                stop=list(p.stop),
                draft=p.draft,
                on_event=job.on_event,
            )
        except _Cancelled:
            job.post("cancelled")
        except BaseException as e:  # reported to this request only; the server goes on
            job.post("error", e)
            if not isinstance(e, Exception):
                raise
        else:
            job.post("done", result)
        finally:
            job.finished = True
            self.live.discard(job)
            self.metrics.running.set(0)
            self.ewma_job_s = 0.8 * self.ewma_job_s + 0.2 * (time.perf_counter() - job.t_start)

    async def wait_for_start(self, job: _Job, watcher: asyncio.Future | None) -> None:
        """Wait until the engine picks the job up; 503 after queue_timeout_s; _ClientGone."""
        try:
            item = await self._next(job, watcher, self.settings.queue_timeout_s)
        except asyncio.TimeoutError:
            job.cancel()
            self.metrics.rejected.labels("queue_timeout").inc()
            raise APIError(503, f"The server is busy: the request waited {self.settings.queue_timeout_s:g}s for the engine; retry later.",
                           type="server_error", code="server_overloaded",
                           headers={"Retry-After": str(max(1, math.ceil(self.ewma_job_s)))}) from None
        except _ClientGone:
            job.cancel()
            raise
        if item[0] != "start":  # "skipped": only when cancelled meanwhile
            raise _ClientGone()

    async def _next(self, job: _Job, watcher: asyncio.Future | None, timeout: float | None = None):
        if watcher is None and timeout is None:
            return await job.events.get()
        get = asyncio.ensure_future(job.events.get())
        waiters = {get} if watcher is None else {get, watcher}
        done, _ = await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        if get in done:
            return get.result()
        get.cancel()
        try:
            await get
        except asyncio.CancelledError:
            pass
        else:  # it completed while being cancelled: put the item back
            job.events.put_nowait(get.result())
        if watcher is not None and watcher in done:
            raise _ClientGone()
        raise asyncio.TimeoutError()

    # -- results --------------------------------------------------------------------------

    def stats(self, job: _Job, result) -> dict:
        s = result.stats
        d = {
            "strategy": job.params.draft.strategy,
            "draft": job.params.draft.to_dict(),
            "drafted": s.drafted,
            "accepted": s.accepted,
            "acceptance_rate": s.acceptance_rate,
            "mean_accepted_length": s.mean_accepted_length,
            "verify_steps": s.verify_steps,
            "per_position_accepted": s.per_position_accepted,
            "per_position_drafted": s.per_position_drafted,
            "new_tokens": s.new_tokens,
            "stop_reason": result.finish_reason,
            "time_to_first_token_s": s.time_to_first_token_s,
            "time_s": s.time_s,
            "tokens_per_second": s.tokens_per_second,
            "queue_time_s": (job.t_start - job.t_arrival) if job.t_start else 0.0,
            "server_time_to_first_token_s": (job.t_first - job.t_arrival) if job.t_first else None,
        }
        if self.settings.replica_id:
            d["replica"] = self.settings.replica_id
        return d

    def record(self, endpoint: str, status: int, job: _Job | None = None, result=None, request=None) -> None:
        m = self.metrics
        m.requests.labels(endpoint, str(status)).inc()
        if result is not None:
            s = result.stats
            m.prompt_tokens.inc(result.prompt_tokens)
            m.generation_tokens.inc(len(result.token_ids))
            m.add_generation(s)
            end = job.t_last or time.perf_counter()
            if job.t_first is not None:
                m.ttft.observe(job.t_first - job.t_arrival)
                if job.n_tokens > 1:
                    m.tpot.observe((end - job.t_first) / (job.n_tokens - 1))
            m.latency.observe(end - job.t_arrival)
        if request is not None:
            info = request.scope.setdefault("state", {})
            if job is not None:
                info["selfspec_prompt_tokens"] = len(job.params.prompt_ids)
                info["selfspec_strategy"] = job.params.draft.strategy
                if job.t_start is not None:
                    info["selfspec_queue_s"] = job.t_start - job.t_arrival
                if job.t_first is not None:
                    info["selfspec_ttft_s"] = job.t_first - job.t_arrival
            if result is not None:
                info["selfspec_completion_tokens"] = len(result.token_ids)
                info["selfspec_finish"] = result.finish_reason
                info["selfspec_acceptance"] = result.stats.acceptance_rate


def _usage(result) -> dict:
    n = len(result.token_ids)
    return {"prompt_tokens": result.prompt_tokens, "completion_tokens": n, "total_tokens": result.prompt_tokens + n}


def _finish(result) -> str:
    return "length" if result.finish_reason == "length" else "stop"


def _sse(obj) -> str:
    return "data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False) + "\n\n"


def create_app(model, draft_config: DraftConfig | None = None, settings: ServerSettings | None = None):
    """A FastAPI app serving `model` (a loaded SelfSpecModel) with `draft_config` as the
    default draft configuration (None: auto)."""
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
    from starlette.exceptions import HTTPException as StarletteHTTPException

    settings = settings or ServerSettings()
    draft_config = draft_config or DraftConfig()
    draft_config.check_model(model.runtime.num_layers, model.spec.vocab_size)
    srv = _Server(model, draft_config, settings)
    replica_headers = {"X-SelfSpec-Replica": settings.replica_id} if settings.replica_id else {}

    async def lifespan(app):
        yield
        srv.shutdown()

    app = FastAPI(title="selfspec", version="0.1.0", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.selfspec = srv

    def error_response(e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status, headers={**e.headers, **replica_headers})

    @app.exception_handler(APIError)
    async def _api_error(request, e: APIError):
        return error_response(e)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, e):
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        msg = {404: f"Unknown endpoint {request.method} {request.url.path}.",
               405: f"Method {request.method} is not allowed on {request.url.path}."}.get(e.status_code, str(e.detail))
        return error_response(APIError(e.status_code, msg, code=code))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request, e):
        return error_response(_bad(f"Invalid request: {e.errors()[:1]}", code="invalid_value"))

    @app.exception_handler(Exception)
    async def _internal_error(request, e):
        log.exception("internal error on %s %s", request.method, request.url.path)
        return error_response(APIError(500, f"Internal server error: {type(e).__name__}", type="server_error", code="internal_error"))

    # -- one log line per request (pure ASGI: no buffering of streams) --------------------
    class _LogRequests:
        def __init__(self, app):
            self.app = app

        async def __call__(self, scope, receive, send):
            if scope["type"] != "http":
                return await self.app(scope, receive, send)
            t0 = time.perf_counter()
            status = {"code": 0}

            async def send_wrapper(message):
                if message["type"] == "http.response.start":
                    status["code"] = message["status"]
                await send(message)

            try:
                await self.app(scope, receive, send_wrapper)
            except BaseException:
                status["code"] = status["code"] or 500
                raise
            finally:
                st = scope.get("state", {})
                extra = "".join(
                    f" {label}={st[key]:.3f}" if isinstance(st[key], float) else f" {label}={st[key]}"
                    for key, label in (("selfspec_prompt_tokens", "prompt"), ("selfspec_completion_tokens", "completion"),
                                       ("selfspec_finish", "finish"), ("selfspec_strategy", "strategy"),
                                       ("selfspec_acceptance", "acceptance"), ("selfspec_queue_s", "queue_s"),
                                       ("selfspec_ttft_s", "ttft_s"), ("selfspec_outcome", "outcome"))
                    if key in st
                )
                client = scope.get("client") or ("-", 0)
                log.info('%s "%s %s" %s %.3fs%s', client[0], scope["method"], scope["path"], status["code"] or "-",
                         time.perf_counter() - t0, extra)

    app.add_middleware(_LogRequests)

    # -- routes -----------------------------------------------------------------------------

    @app.get("/health")
    async def health():
        return JSONResponse({"status": "ok", "model": settings.model_name, "fingerprint": srv.fingerprint,
                             "in_progress": srv.admitted, "waiting": srv.waiting, "max_concurrency": settings.max_concurrency},
                            headers=replica_headers)

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(srv.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    def model_card(name: str) -> dict:
        return {"id": name, "object": "model", "created": srv.created, "owned_by": "selfspec",
                "max_model_len": model.context_length, "fingerprint": srv.fingerprint,
                "draft": draft_config.to_dict()}

    @app.get("/v1/models")
    async def list_models(request: Request):
        srv.check_auth(request)
        return JSONResponse({"object": "list", "data": [model_card(settings.model_name)]}, headers=replica_headers)

    @app.get("/v1/models/{name:path}")
    async def get_model(name: str, request: Request):
        srv.check_auth(request)
        if name not in srv.names:
            raise APIError(404, f"The model '{name}' does not exist.", param="model", code="model_not_found")
        return JSONResponse(model_card(settings.model_name), headers=replica_headers)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, chat=True)

    async def watch_disconnect(request: Request) -> None:
        """Returns when the client disconnects (the body has been read: the next ASGI
        message is http.disconnect)."""
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    async def handle(request: Request, chat: bool):
        t_arrival = time.perf_counter()
        endpoint = "chat" if chat else "completions"
        info = request.scope.setdefault("state", {})
        try:
            srv.check_auth(request)
            body = await srv.read_json(request)
            params = srv.parse(body, chat)
            srv.admit()
        except APIError as e:
            srv.record(endpoint, e.status, request=request)
            return error_response(e)
        job = _Job(asyncio.get_running_loop(), params, params.stream, t_arrival)
        handed_over = False
        watcher = asyncio.ensure_future(watch_disconnect(request))
        try:
            srv.submit(job)
            await srv.wait_for_start(job, watcher)
            if params.stream:
                # first event (token, end or error) before sending headers: errors in the
                # prefill still get a proper status code
                first = await srv._next(job, watcher)
                if first[0] not in ("tok", "done"):
                    return finish_plain(request, job, first, chat, endpoint)
                response = make_stream(request, job, first, chat, endpoint)
                handed_over = True
                return response
            item = await srv._next(job, watcher)
            while item[0] == "tok":
                item = await srv._next(job, watcher)
            return finish_plain(request, job, item, chat, endpoint)
        except APIError as e:
            srv.record(endpoint, e.status, job, request=request)
            return error_response(e)
        except _ClientGone:
            info["selfspec_outcome"] = "client-gone"
            srv.metrics.cancelled.inc()
            srv.record(endpoint, 499, job, request=request)
            return Response(status_code=499)
        finally:
            watcher.cancel()
            if not handed_over:
                job.cancel()
                srv.release()

    def finish_plain(request, job: _Job, item, chat: bool, endpoint: str):
        kind = item[0]
        if kind == "error":
            e = item[1]
            if isinstance(e, SelfSpecError):
                err = _bad(str(e), code="invalid_value")
            else:
                log.error("generation failed: %s: %s", type(e).__name__, e, exc_info=e)
                err = APIError(500, f"Generation failed: {type(e).__name__}: {e}", type="server_error", code="internal_error")
            srv.record(endpoint, err.status, job, request=request)
            return error_response(err)
        if kind != "done":
            raise _ClientGone()
        result = item[1]
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        choice = {"index": 0, "logprobs": None, "finish_reason": _finish(result)}
        if chat:
            choice["message"] = {"role": "assistant", "content": result.text}
        else:
            choice["text"] = result.text
        body = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                "model": job.params.model, "system_fingerprint": srv.fingerprint, "choices": [choice],
                "usage": _usage(result), "selfspec": srv.stats(job, result)}
        srv.record(endpoint, 200, job, result, request=request)
        return JSONResponse(body, headers={"X-Request-Id": rid, **replica_headers})

    def make_stream(request, job: _Job, first, chat: bool, endpoint: str):
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"
        base = {"id": rid, "object": obj, "created": created, "model": job.params.model, "system_fingerprint": srv.fingerprint}
        include_usage = job.params.include_usage
        info = request.scope.setdefault("state", {})
        state = {"status": 200, "result": None, "closed": False}

        def chunk(delta_text: str | None, finish: str | None = None, role: bool = False) -> str:
            if chat:
                delta = {}
                if role:
                    delta["role"] = "assistant"
                    delta["content"] = ""
                elif delta_text is not None:
                    delta["content"] = delta_text
                choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": delta_text or "", "logprobs": None, "finish_reason": finish}
            c = {**base, "choices": [choice]}
            if include_usage:
                c["usage"] = None
            return _sse(c)

        async def events():
            # The engine's deltas are already safe to send: it holds back text that could
            # still become a stop string or an incomplete character (engine._Output).
            sent = ""
            item = first
            if chat:
                yield chunk(None, role=True)
            while True:
                kind = item[0]
                if kind == "tok":
                    out = item[1]
                    while not job.events.empty():  # coalesce what the engine committed meanwhile
                        nxt = job.events.get_nowait()
                        if nxt[0] != "tok":
                            item = nxt
                            break
                        out += nxt[1]
                    else:
                        item = None
                    if out:
                        sent += out
                        yield chunk(out)
                    if item is None:
                        item = await job.events.get()
                    continue
                if kind == "done":
                    result = item[1]
                    state["result"] = result
                    if result.text.startswith(sent):
                        rest = result.text[len(sent):]
                    else:  # cannot happen with a prefix-stable detokenizer; never resend
                        log.warning("streamed text diverged from the final text (request %s)", rid)
                        rest = ""
                    if rest:
                        yield chunk(rest)
                    yield chunk(None if chat else "", finish=_finish(result))
                    if include_usage:
                        yield _sse({**base, "choices": [], "usage": _usage(result), "selfspec": srv.stats(job, result)})
                    yield "data: [DONE]\n\n"
                    return
                if kind == "error":
                    e = item[1]
                    log.error("generation failed mid-stream: %s: %s", type(e).__name__, e, exc_info=e)
                    state["status"] = 500
                    err = APIError(500, f"Generation failed: {type(e).__name__}: {e}", type="server_error", code="internal_error")
                    yield _sse(err.body())
                    return
                # "cancelled" / "skipped": only after our own cancel
                state["status"] = 499
                return

        def on_close():
            if state["closed"]:
                return
            state["closed"] = True
            if state["result"] is None:
                job.cancel()
                if state["status"] == 200:
                    state["status"] = 499
                    info["selfspec_outcome"] = "client-gone"
                    srv.metrics.cancelled.inc()
            srv.record(endpoint, state["status"], job, state["result"], request=request)
            srv.release()

        return _JobStream(events(), on_close, media_type="text/event-stream",
                          headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", "X-Request-Id": rid, **replica_headers})

    class _JobStream(StreamingResponse):
        """A StreamingResponse that always runs `on_close` (client gone or not, started or
        not), which cancels the job if it is still running and frees the admission slot."""

        def __init__(self, content, on_close, **kw):
            super().__init__(content, **kw)
            self._on_close = on_close
            self._gen = content

        async def __call__(self, scope, receive, send):
            try:
                await super().__call__(scope, receive, send)
            finally:
                self._on_close()
                try:
                    await self._gen.aclose()
                except Exception:  # already finished or failed: nothing left to clean up
                    pass

    return app
