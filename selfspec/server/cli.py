"""`selfspec serve`: registered into the main CLI by selfspec.cli._extra_commands.

    selfspec serve --model gemma-3-270m --strategy early-exit --exit-layer 12 --port 8000
    selfspec serve --model ./my-model --profile prof.json --api-key "$KEY" --max-concurrency 8
    selfspec serve --model ./my-model --ray --replicas 2          # Ray Serve, one endpoint
"""

from __future__ import annotations

import logging
import os
import sys

import torch

from selfspec import strategies
from selfspec.batch.engine import default_prefill_chunk
from selfspec.cli_args import add_chat_template_arg, add_draft_args, add_model_args, check_before_loading, choice, draft_config_from_args, load_model
from selfspec.config import COUPLINGS, MAX_SPECULATIONS, SamplingConfig
from selfspec.errors import SelfSpecError
from selfspec.extras import missing, require
from selfspec.server.ray_deploy import serve_with_ray
from selfspec.server.settings import PROMPT_TOKENS_PER_CORE, ServerSettings, default_max_batch
from selfspec.server.worker import warmup


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "serve",
        help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, /metrics)",
        description="Serve one model over an OpenAI-compatible HTTP API, decoding with self-speculation.",
    )
    add_model_args(p)
    add_chat_template_arg(p)
    add_draft_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default: %(default)s)")
    p.add_argument("--served-model-name", default=None,
                   help="the model id clients send and /v1/models lists (default: the --model value)")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: $SELFSPEC_API_KEY; none if unset)")
    p.add_argument("--max-concurrency", type=int, default=16,
                   help="requests admitted at once (up to --max-batch decode together, the rest wait for a slot in "
                        "arrival order); more get 429 (default: %(default)s)")
    p.add_argument("--max-batch", type=int, default=None,
                   help="the most requests decoding together in one continuous batch (default: 4 per CPU core, "
                        f"between 4 and 32: {default_max_batch()} on this machine)")
    p.add_argument("--prefill-chunk", type=int, default=None,
                   help="prompt tokens prefilled per batch step, shortest prompt first: a running stream waits at most "
                        f"one chunk (default: 32 per CPU core, between 32 and 512: {default_prefill_chunk()} on this machine)")
    p.add_argument("--queue-timeout", type=float, default=30.0, help="seconds a request may wait for the engine before 503 (default: %(default)s)")
    p.add_argument("--max-new-tokens-limit", type=int, default=1024, help="the largest max_tokens a request may ask for (default: %(default)s)")
    p.add_argument("--default-max-tokens", type=int, default=128, help="max_tokens when a request gives none (default: %(default)s)")
    p.add_argument("--max-prompt-tokens", type=int, default=None,
                   help=f"the longest prompt a request may send, in tokens; a text prompt longer than this times the "
                        f"tokenizer's longest token (in characters) is refused without tokenizing it (default: "
                        f"{PROMPT_TOKENS_PER_CORE} per CPU core, at most the model's context - 1)")
    p.add_argument("--allowed-strategies", default=None,
                   help="comma-separated strategies a request may pick in its 'selfspec' field "
                        f"(default: all but draft-model; choose from {', '.join(strategies.names())})")
    p.add_argument("--max-num-speculations", type=int, default=MAX_SPECULATIONS,
                   help="the largest num_speculations a request may ask for (default: %(default)s)")
    p.add_argument("--no-request-draft", action="store_true", help="reject per-request 'selfspec' draft options")
    p.add_argument("--coupling", type=choice(COUPLINGS, "coupling"), default=SamplingConfig.coupling,
                   help="how sampled requests accept drafts unless they say ('selfspec': {'coupling': ...}): gumbel (a seed "
                        "is one text, whatever the load, threads or draft) or rejection (default: %(default)s)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads for the engine (default: torch's choice; 1 is often faster for small models "
                        "on a busy machine)")
    p.add_argument("--no-warmup", action="store_true", help="skip the one-token warm-up generation at start")
    p.add_argument("--log-level", default="info", type=choice(("debug", "info", "warning", "error"), "log level"),
                   help="debug, info, warning or error (default: %(default)s)")
    p.add_argument("--ray", action="store_true", help="run on Ray Serve: --replicas copies of the model behind one endpoint")
    p.add_argument("--replicas", type=int, default=1, help="with --ray: number of replicas (default: %(default)s)")
    p.add_argument("--ray-address", default=None,
                   help="with --ray: an existing cluster's address (default: start a private local Ray instance)")
    p.add_argument("--replica-cpus", type=float, default=None,
                   help="with --ray: CPUs reserved per replica (default: the machine's CPUs / replicas)")
    p.set_defaults(func=cmd_serve)


def settings_from_args(args) -> ServerSettings:
    allowed = None
    if args.allowed_strategies:
        allowed = tuple(s.strip() for s in args.allowed_strategies.split(",") if s.strip())
    model_name = args.served_model_name or str(args.model)
    api_key = args.api_key if args.api_key is not None else os.environ.get("SELFSPEC_API_KEY")
    return ServerSettings(
        model_name=model_name,
        aliases=(str(args.model),),
        api_key=api_key or None,
        max_concurrency=args.max_concurrency,
        queue_timeout_s=args.queue_timeout,
        max_new_tokens_limit=args.max_new_tokens_limit,
        default_max_tokens=args.default_max_tokens,
        allowed_strategies=allowed,
        max_num_speculations=args.max_num_speculations,
        allow_request_draft=not args.no_request_draft,
        max_prompt_tokens=args.max_prompt_tokens,
        max_batch=args.max_batch,
        prefill_chunk=args.prefill_chunk,
        coupling=args.coupling,
    )


def _check_deps(ray: bool) -> None:
    require("selfspec serve", "fastapi", "uvicorn", "prometheus_client")
    if ray and missing("ray.serve"):
        raise SelfSpecError("selfspec serve --ray needs ray[serve]: pip install 'selfspec[ray]'")


def cmd_serve(args) -> int:
    if not 0 <= args.port <= 65535:
        raise SelfSpecError(f"--port must be in 0..65535, got {args.port}")
    if args.threads is not None and args.threads < 1:
        raise SelfSpecError(f"--threads must be >= 1, got {args.threads}")
    if args.replicas < 1:
        raise SelfSpecError(f"--replicas must be >= 1, got {args.replicas}")
    settings = settings_from_args(args)  # validate before loading anything
    check_before_loading(args)
    _check_deps(args.ray)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    if args.ray:
        return serve_with_ray(args, settings)
    # the web stack is an optional dependency (checked above): imported only to serve
    import uvicorn

    from selfspec.server.routes import create_app  # fastapi and prometheus-client: only serve needs them

    if args.threads:
        torch.set_num_threads(args.threads)
    model = load_model(args)
    draft = draft_config_from_args(model, args)
    draft.check_model(model.runtime.num_layers, model.spec.vocab_size)
    if not args.no_warmup:
        warmup(model, draft)
    app = create_app(model, draft, settings)
    print(f"selfspec: serving {settings.model_name} ({draft.strategy}; chat template: {model.chat_template_source}; "
          f"arithmetic: {model.runtime.numerics}; sampling: {settings.coupling} coupling) "
          f"on http://{args.host}:{args.port}/v1", file=sys.stderr, flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_config=None, access_log=False, log_level=args.log_level,
                timeout_graceful_shutdown=5)
    return 0
