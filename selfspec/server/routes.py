"""The OpenAI-compatible HTTP app: `create_app(model, draft_config, settings)` -> FastAPI.

Endpoints
    POST /v1/completions        prompt (string, token ids, or a list of those) -> text; `stream: true` = SSE
    POST /v1/chat/completions   messages -> the tokenizer's chat template -> text; SSE too
    GET  /v1/models             the served model (one)
    GET  /health                liveness, queue depth, outcomes so far (no API key needed)
    GET  /metrics               Prometheus text format (no API key needed)

A request: auth -> body read with a byte limit (413) -> parse_request (parsing.py, cheap; a
text longer than the character bound is refused untokenized) -> tokenized once in a
tokenizer thread -> admission (429) -> the worker (worker.py: one continuous batch; a slot
in arrival order, 503 after the queue timeout) -> a JSON response or an SSE stream. Every non-streamed response, and the final
usage chunk of a stream with `stream_options: {"include_usage": true}`, carries a top-level
`selfspec` object with the generation's speculative statistics. A client that goes away
(waiting or mid-stream) cancels its job and is recorded once, as 499 client-gone.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from selfspec.config import DraftConfig
from selfspec.errors import SelfSpecError
from selfspec.server.choices import Choices
from selfspec.server.errors import APIError, ClientGone, bad
from selfspec.server.metrics import CLIENT_GONE, Metrics
from selfspec.server.parsing import ParseContext, encode_all, parse_request
from selfspec.server.settings import ServerSettings
from selfspec.server.streaming import LogRequests, plain_body, stream_response
from selfspec.server.worker import Admission, Worker

log = logging.getLogger("selfspec.server")


class Server:
    """State shared by the routes: the model, parsing context, metrics, admission, worker."""

    def __init__(self, model, draft_config: DraftConfig, settings: ServerSettings):
        self.model = model
        self.draft = draft_config
        self.settings = settings
        self.ctx = ParseContext.for_model(model, draft_config, settings)
        self.created = int(time.time())
        fp = getattr(model, "fingerprint", "") or ""
        # OpenAI's system_fingerprint: what may change outputs: the model, a sampled request's
        # coupling (fingerprint_of: each response names its own), the arithmetic (Runtime.numerics)
        self._fingerprint_parts = ["selfspec", *([fp] if fp else [])], model.runtime.numerics
        self.fingerprint = self.fingerprint_of(settings.coupling)
        self.metrics = Metrics(settings.model_name, fp, draft_config.strategy)
        self.admission = Admission(settings, self.metrics)
        self.worker = Worker(model, settings, self.metrics, self.admission)
        # Tokenizing a prompt (up to the character bound) takes a while: never on the event loop.
        self.tokenizer_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="selfspec-tokenize")
        self.headers = {"X-SelfSpec-Replica": settings.replica_id} if settings.replica_id else {}

    def fingerprint_of(self, coupling: str) -> str:
        """The system_fingerprint of responses sampled with `coupling` (SamplingConfig.coupling):
        selfspec-<model>-<coupling>-<numerics>."""
        head, numerics = self._fingerprint_parts
        return "-".join([*head, coupling, numerics])

    def shutdown(self) -> None:
        self.worker.shutdown()
        self.tokenizer_pool.shutdown(wait=False, cancel_futures=True)

    def check_auth(self, request: Request) -> None:
        key = self.settings.api_key
        if key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if not header:
            raise APIError(401, "Missing API key: send it as 'Authorization: Bearer KEY'.", code="invalid_api_key")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
            raise APIError(401, "Incorrect API key provided.", code="invalid_api_key")

    async def read_json(self, request: Request) -> dict:
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
        try:
            body = json.loads(b"".join(chunks))
        except (ValueError, UnicodeDecodeError) as e:
            raise bad(f"The request body is not valid JSON: {e}", code="invalid_json") from None
        if not isinstance(body, dict):
            raise bad("The request body must be a JSON object.", code="invalid_json")
        return body

    async def params(self, request: Request, chat: bool):
        """Auth, body, validation, then tokenization (once, in the tokenizer thread) -> a Params per prompt."""
        self.check_auth(request)
        req = parse_request(await self.read_json(request), chat, self.ctx)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.tokenizer_pool, encode_all, req, self.model, self.ctx)

    def error_response(self, e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status, headers={**e.headers, **self.headers})

    def health(self) -> dict:
        return {"status": "ok", "model": self.settings.model_name, "fingerprint": self.fingerprint,
                "in_progress": self.admission.admitted, "waiting": self.worker.waiting, "running": self.worker.running,
                "batch_size": self.worker.batch_size, "max_batch": self.worker.max_batch,
                "max_concurrency": self.settings.max_concurrency, "max_prompt_tokens": self.ctx.limits.max_prompt_tokens,
                "outcomes": self.metrics.outcome_counts()}

    def model_card(self) -> dict:
        return {"id": self.settings.model_name, "object": "model", "created": self.created, "owned_by": "selfspec",
                "max_model_len": self.model.context_length, "fingerprint": self.fingerprint, "draft": self.draft.to_dict(),
                "max_prompt_tokens": self.ctx.limits.max_prompt_tokens}


async def _watch_disconnect(request: Request) -> None:
    """Returns when the client disconnects (the body has been read: the next ASGI message is
    http.disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _next(job: Choices, watcher: asyncio.Future, timeout: float | None = None):
    """The job's next event; ClientGone if the client leaves first; TimeoutError."""
    get = asyncio.ensure_future(job.events.get())
    done, _ = await asyncio.wait({get, watcher}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    if get in done:
        return get.result()
    get.cancel()
    try:
        await get
    except asyncio.CancelledError:
        pass
    else:  # it completed while being cancelled: put the item back
        job.events.put_nowait(get.result())
    if watcher in done:
        raise ClientGone()
    raise asyncio.TimeoutError()


async def _wait_for_start(srv: Server, job: Choices, watcher: asyncio.Future) -> None:
    """Until the engine takes the job up; 503 after queue_timeout_s; ClientGone."""
    timeout = srv.settings.queue_timeout_s
    try:
        item = await _next(job, watcher, timeout)
    except asyncio.TimeoutError:
        job.cancel()
        srv.metrics.rejected.labels("queue_timeout").inc()
        raise APIError(503, f"The server is busy: the request waited {timeout:g}s for the engine; retry later.",
                       type="server_error", code="server_overloaded",
                       headers={"Retry-After": str(max(1, round(srv.admission.ewma_job_s + 0.5)))}) from None
    if item[0] != "start":  # "skipped": only when cancelled meanwhile
        raise ClientGone()


async def handle(srv: Server, request: Request, chat: bool):
    t_arrival = time.perf_counter()
    endpoint = "chat" if chat else "completions"
    info = request.scope.setdefault("state", {})
    try:
        params = await srv.params(request, chat)
        srv.admission.admit(srv.worker.waiting)
    except APIError as e:
        srv.metrics.record(endpoint, e.status, info=info)
        return srv.error_response(e)
    job = Choices(asyncio.get_running_loop(), params, t_arrival)
    handed_over = False
    watcher = asyncio.ensure_future(_watch_disconnect(request))
    try:
        for j in job.jobs:
            srv.worker.submit(j)
        await _wait_for_start(srv, job, watcher)
        item = await _next(job, watcher)
        if job.params.stream and item[0] in ("tok", "done"):
            # headers only once the first event is in: errors in the prefill still get a status
            response = stream_response(srv, job, item, chat, endpoint, info)
            handed_over = True
            return response
        while item[0] == "tok":
            item = await _next(job, watcher)
        return _finish_plain(srv, job, item, chat, endpoint, info)
    except APIError as e:
        srv.metrics.record(endpoint, e.status, job, info=info)
        return srv.error_response(e)
    except ClientGone:
        srv.metrics.record(endpoint, CLIENT_GONE, job, info=info)
        return Response(status_code=CLIENT_GONE)
    finally:
        watcher.cancel()
        if not handed_over:
            job.cancel()
            srv.admission.release()


def _finish_plain(srv: Server, job: Choices, item, chat: bool, endpoint: str, info: dict):
    kind = item[0]
    if kind == "error":
        e = item[1]
        if isinstance(e, SelfSpecError):
            err = bad(str(e), code="invalid_value")
        else:
            log.error("generation failed: %s: %s", type(e).__name__, e, exc_info=e)
            err = APIError(500, f"Generation failed: {type(e).__name__}: {e}", type="server_error", code="internal_error")
        srv.metrics.record(endpoint, err.status, job, info=info)
        return srv.error_response(err)
    if kind != "done":
        raise ClientGone()
    results = item[1]
    body, rid = plain_body(srv, job, results, chat)
    srv.metrics.record(endpoint, 200, job, results, info=info)
    return JSONResponse(body, headers={"X-Request-Id": rid, **srv.headers})


def _install_error_handlers(app: FastAPI, srv: Server) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request, e: APIError):
        return srv.error_response(e)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, e):
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        msg = {404: f"Unknown endpoint {request.method} {request.url.path}.",
               405: f"Method {request.method} is not allowed on {request.url.path}."}.get(e.status_code, str(e.detail))
        return srv.error_response(APIError(e.status_code, msg, code=code))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request, e):
        return srv.error_response(bad(f"Invalid request: {e.errors()[:1]}", code="invalid_value"))

    @app.exception_handler(Exception)
    async def _internal_error(request, e):
        log.exception("internal error on %s %s", request.method, request.url.path)
        return srv.error_response(APIError(500, f"Internal server error: {type(e).__name__}", type="server_error",
                                           code="internal_error"))


def _install_routes(app: FastAPI, srv: Server) -> None:
    @app.get("/health")
    async def health():
        return JSONResponse(srv.health(), headers=srv.headers)

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(srv.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def list_models(request: Request):
        srv.check_auth(request)
        return JSONResponse({"object": "list", "data": [srv.model_card()]}, headers=srv.headers)

    @app.get("/v1/models/{name:path}")
    async def get_model(name: str, request: Request):
        srv.check_auth(request)
        if name not in srv.ctx.names:
            raise APIError(404, f"The model '{name}' does not exist.", param="model", code="model_not_found")
        return JSONResponse(srv.model_card(), headers=srv.headers)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(srv, request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(srv, request, chat=True)


def create_app(model, draft_config: DraftConfig | None = None, settings: ServerSettings | None = None) -> FastAPI:
    """A FastAPI app serving `model` (a loaded SelfSpecModel) with `draft_config` as the
    default draft configuration (None: auto)."""
    settings = settings or ServerSettings()
    draft_config = draft_config or DraftConfig()
    draft_config.check_model(model.runtime.num_layers, model.spec.vocab_size)
    srv = Server(model, draft_config, settings)

    async def lifespan(app):
        yield
        srv.shutdown()

    app = FastAPI(title="selfspec", version="0.1.0", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.selfspec = srv
    _install_error_handlers(app, srv)
    app.add_middleware(LogRequests)
    _install_routes(app, srv)
    return app
