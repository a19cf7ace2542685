"""Scale-out: several selfspec replicas behind one HTTP endpoint with Ray Serve.

Each replica is a Ray actor that loads its own copy of the model and runs the same FastAPI
app as `selfspec serve` (create_app), so the API, errors, limits and statistics are
identical; Ray Serve's proxy listens on one port and routes each request to a replica
(power-of-two-choices on queue length, capped by `max_ongoing_requests` =
--max-concurrency per replica).

Three ways to run it (`pip install "ray[serve]"`):

1. The CLI starts a private local Ray instance and deploys N replicas:

       selfspec serve --model ./my-model --strategy early-exit --exit-layer 12 \\
           --ray --replicas 2 --host 127.0.0.1 --port 8000

   `--ray-address auto` (or ray://...) deploys onto an existing cluster instead; the model
   path must then exist on every node.

2. From Python:

       from ray import serve
       from selfspec.server.ray_deploy import build_app
       serve.start(http_options={"host": "127.0.0.1", "port": 8000})
       serve.run(build_app({"model": "./my-model", "strategy": "early-exit", "exit_layer": 12,
                            "replicas": 2}), name="selfspec", route_prefix="/")

3. With Serve's own CLI or a config file (an application builder):

       serve run selfspec.server.ray_deploy:build_app model=./my-model replicas=2 strategy=prompt-lookup

Notes. Each replica is an independent engine, so per-replica limits apply (admission,
queue, 429); Ray's proxy answers 503 when every replica's queue is full. /metrics and
/health answer for whichever replica receives the request (the X-SelfSpec-Replica header
and the `selfspec.replica` stat say which); scrape the replicas' metrics through Ray's own
metrics export for cluster-wide numbers. Replicas share the machine's cores: by default
each reserves CPUs / replicas and sets torch's thread count to match.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import tempfile
import threading
from dataclasses import fields

import torch

import selfspec
from selfspec.chat_templates import resolve
from selfspec.cli_args import config_kwargs
from selfspec.coercion import coerce
from selfspec.config import DraftConfig
from selfspec.errors import SelfSpecError
from selfspec.server.settings import ServerSettings
from selfspec.server.worker import warmup as _warmup

_DRAFT_FIELDS = {f.name for f in fields(DraftConfig)}


def _replica_class():
    # Ray is an optional dependency: imported only when deploying on it
    from ray import serve

    # the web stack (fastapi) is optional too, and the replica needs it
    from selfspec.server.routes import create_app

    @serve.ingress()
    class SelfSpecReplica:
        """One model + one engine thread; the ASGI app is create_app's."""

        def __init__(self, model: str, dtype=None, device=None, profile=None, draft_options=None, settings=None, threads=None,
                     warmup: bool = True, chat_template: str | None = None, allow_pickle: bool = False):
            if threads:
                torch.set_num_threads(int(threads))
            self.model = selfspec.load(model, dtype=dtype, device=device, chat_template=chat_template, allow_pickle=allow_pickle)
            self.draft = self.model.draft_config(profile=profile, **(draft_options or {}))
            self.draft.check_model(self.model.runtime.num_layers, self.model.spec.vocab_size)
            s = dict(settings or {})
            s.setdefault("model_name", str(model))
            s["replica_id"] = f"{socket.gethostname()}:{os.getpid()}"
            self.settings = ServerSettings(**s)
            if warmup:
                _warmup(self.model, self.draft)

        def __serve_build_asgi_app__(self):
            return create_app(self.model, self.draft, self.settings)

    return SelfSpecReplica


# The builder's own arguments; DraftConfig fields are typed by DraftConfig itself.
_BUILD_ARG_TYPES = {"replicas": int, "threads": int | None, "num_cpus": float | None, "warmup": bool, "allow_pickle": bool}


def _coerce(key: str, value):
    """Serve CLI builder args arrive as strings: give each its field's type (coercion.coerce)."""
    if key in _BUILD_ARG_TYPES:
        return coerce(key, _BUILD_ARG_TYPES[key], value)
    return value


def build_app(args: dict):
    """A Ray Serve application (a bound deployment) from a dict:

    model (required), dtype, device, profile, chat_template, strategy and any DraftConfig field
    (or a `draft` dict), replicas (1), num_cpus (per replica), threads (torch threads per replica),
    settings (a dict of ServerSettings fields), warmup (True), allow_pickle (False)."""
    from ray import serve  # optional dependency (see _replica_class)

    args = {k: _coerce(k, v) for k, v in dict(args).items()}
    if not args.get("model"):
        raise SelfSpecError("build_app needs a model")
    model = str(args["model"])
    if os.path.exists(model):
        model = os.path.abspath(model)  # replicas do not share the driver's working directory
    draft_options = dict(args.get("draft") or {})
    draft_options.update({k: v for k, v in args.items() if k in _DRAFT_FIELDS and v is not None})
    if args.get("profile") is None:
        DraftConfig.from_dict(draft_options)  # option errors here, not in every replica
    profile = args.get("profile")
    if profile is not None:
        profile = os.path.abspath(profile)
    chat_template = args.get("chat_template")
    if chat_template is not None:
        resolve(chat_template)  # a bad name or file fails here, not in every replica
        if os.path.exists(chat_template):
            chat_template = os.path.abspath(chat_template)
    settings = dict(args.get("settings") or {})
    settings.setdefault("model_name", str(args["model"]))
    replicas = int(args.get("replicas", 1))
    cpus = os.cpu_count() or 1
    num_cpus = args.get("num_cpus")
    if num_cpus is None:
        num_cpus = max(cpus / replicas, 0.1)
    threads = args.get("threads") or max(1, int(num_cpus))
    deployment = serve.deployment(
        _replica_class(),
        name="selfspec",
        num_replicas=replicas,
        max_ongoing_requests=int(settings.get("max_concurrency", 16)),
        max_queued_requests=int(settings.get("max_concurrency", 16)) * replicas,
        ray_actor_options={"num_cpus": num_cpus},
        health_check_period_s=10,
        graceful_shutdown_timeout_s=5,
    )
    return deployment.bind(model, args.get("dtype"), args.get("device"), profile, draft_options, settings, threads,
                           bool(args.get("warmup", True)), chat_template, bool(args.get("allow_pickle", False)))


def serve_with_ray(args, settings) -> int:
    """`selfspec serve --ray`: start (or join) Ray, deploy, block until SIGINT/SIGTERM."""
    import ray  # optional dependency (see _replica_class)
    from ray import serve

    draft_options = config_kwargs(args, DraftConfig)
    if not args.profile:
        DraftConfig.from_dict(draft_options)  # option errors before Ray starts
    s = settings.to_dict()
    s.pop("replica_id", None)
    app_args = {"model": args.model, "dtype": args.dtype, "device": args.device, "profile": args.profile,
                "draft": draft_options, "replicas": args.replicas, "num_cpus": args.replica_cpus, "settings": s,
                "threads": args.threads, "chat_template": args.chat_template, "allow_pickle": bool(args.allow_pickle),
                "warmup": not args.no_warmup}
    if args.ray_address:
        ray.init(address=args.ray_address, include_dashboard=False, logging_level="warning")
    else:
        tmp = tempfile.mkdtemp(prefix="selfspec-ray-", dir="/tmp")  # private session dir, never another user's cluster
        ray.init(address="local", include_dashboard=False, logging_level="warning", _temp_dir=tmp,
                 num_cpus=os.cpu_count() or 1, _node_ip_address="127.0.0.1")  # loopback only
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": args.host, "port": args.port}, logging_config={"log_level": "WARNING"})
        serve.run(build_app(app_args), name="selfspec", route_prefix="/", blocking=False)
        print(f"selfspec: serving {settings.model_name} on http://{args.host}:{args.port}/v1 with Ray Serve "
              f"({args.replicas} replica{'s' if args.replicas != 1 else ''})", file=sys.stderr, flush=True)
        stop.wait()
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
    return 0
