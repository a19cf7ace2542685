"""The server's public entry points, kept at their original import path:

    from selfspec.server.app import create_app, ServerSettings

The implementation lives in one module per job (dependencies run downward):
    settings.py   ServerSettings and the prompt limits derived from it
    errors.py     APIError (OpenAI's error shape) and the cancellation signals
    parsing.py    request body -> Params (a selfspec.Request each), pure functions (tokenized once, off the event loop)
    metrics.py    Prometheus metrics; each request's one recorded outcome
    worker.py     admission, the engine thread driving one continuous batch (selfspec.batch), warm-up
    streaming.py  response bodies, SSE streams, the access log
    routes.py     create_app: the FastAPI app and its endpoints
"""

from selfspec.server.errors import APIError
from selfspec.server.routes import create_app
from selfspec.server.settings import MAX_REQUEST_NGRAM, REQUEST_DRAFT_OPTIONS, ServerSettings

__all__ = ["APIError", "MAX_REQUEST_NGRAM", "REQUEST_DRAFT_OPTIONS", "ServerSettings", "create_app"]
