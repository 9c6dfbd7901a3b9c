"""`turbospec serve`: the server's flags, and serving: build the engine, the default sampling settings and the
`ServerConfig` from the flags, then run the app under uvicorn."""

from __future__ import annotations

import argparse
from pathlib import Path

from turbospec import env
from turbospec.cli.args import (
    add_model_args,
    add_sampling_args,
    add_spec_args,
    engine_config,
    sampling_params,
)
from turbospec.engine import build_engine
from turbospec.errors import TurboSpecError
from turbospec.server import DEFAULT_MAX_BODY


def register(sub) -> None:
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (completions, chat, metrics)")
    add_model_args(s)
    add_spec_args(s)
    add_sampling_args(s)
    add_serve_args(s)
    s.set_defaults(func=cmd_serve)


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1, loopback only)")
    p.add_argument("--port", type=int, default=8080, help="port (default 8080)")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' (default: none; also TURBOSPEC_API_KEY)")
    p.add_argument("--alias", default=None,
                   help="model name served in the API (default: the model directory name)")
    p.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY,
                   help=f"largest accepted request body (default {DEFAULT_MAX_BODY})")
    p.add_argument("--max-queue", type=int, default=64,
                   help="requests allowed to wait for the generation worker; more get 503 (default 64)")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="per-request limit in seconds: queue wait beyond it -> 503, generation is cut off "
                        "(finish_reason length) (default 600)")
    p.add_argument("--log-level", default="warning", help="uvicorn log level (default warning)")


def cmd_serve(a: argparse.Namespace) -> int:
    import uvicorn

    from turbospec.server import ServerConfig, create_app

    if a.max_body_bytes <= 0 or a.max_queue <= 0 or not (a.timeout > 0):
        raise TurboSpecError("--max-body-bytes, --max-queue and --timeout must be positive")
    if not (0 < a.port < 65536):
        raise TurboSpecError("--port must be in 1..65535")
    defaults = sampling_params(a)
    engine = build_engine(engine_config(a))
    name = a.alias or Path(engine.model_path).name
    key = a.api_key or env.get("TURBOSPEC_API_KEY") or None
    cfg = ServerConfig(model_name=name, api_key=key, max_body_bytes=a.max_body_bytes, max_queue=a.max_queue,
                       timeout=a.timeout, defaults=defaults)
    app = create_app(engine, cfg)
    print(f"turbospec serve: model '{name}' on http://{a.host}:{a.port} (ctx {engine.ctx}, "
          f"queue {a.max_queue}{', api key required' if key else ''})", flush=True)
    uvicorn.run(app, host=a.host, port=a.port, log_level=a.log_level,
                limit_concurrency=max(64, 4 * a.max_queue), timeout_keep_alive=30, access_log=False,
                timeout_graceful_shutdown=10)
    return 0
