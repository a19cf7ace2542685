"""`selfspec serve`: an OpenAI-compatible HTTP server around one loaded model.

    from selfspec.server import create_app, ServerSettings
    app = create_app(model, model.draft_config("early-exit", exit_layer=12), ServerSettings(model_name="gemma"))
    # then: uvicorn.run(app, host="127.0.0.1", port=8000)

Endpoints: POST /v1/completions, POST /v1/chat/completions (both with `stream: true` as
server-sent events), GET /v1/models, GET /health, GET /metrics (Prometheus). See app.py for
the modules (parsing.py: the request fields honoured and the `selfspec` extension field), and
ray_deploy.py for running several replicas behind one endpoint with Ray Serve.

fastapi, uvicorn and prometheus-client are imported lazily by `create_app`, so importing
this package (as the CLI does to register `serve`) needs none of them.
"""

from __future__ import annotations

__all__ = ["ServerSettings", "create_app"]


def __getattr__(name):
    if name in __all__:
        # lazily: create_app needs fastapi/prometheus-client (slow to import), the CLI does not
        from selfspec.server.app import ServerSettings, create_app

        return {"ServerSettings": ServerSettings, "create_app": create_app}[name]
    raise AttributeError(name)
