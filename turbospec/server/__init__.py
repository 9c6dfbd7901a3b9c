"""OpenAI-compatible HTTP server: `turbospec serve -m MODEL`.

Endpoints: /v1/completions, /v1/chat/completions (stream and non-stream), /v1/models, /health, /metrics.

Concurrency model: the engine decodes one sequence at a time, so generation runs in one worker fed by a bounded
FIFO queue (`turbospec serve` runs it on the main thread and HTTP on a second one; see `worker.Worker`). Requests
wait their turn (this is a queue, not batched decoding of concurrent sequences); when more than ``max_queue``
requests are waiting, new ones get 503. A client that disconnects stops its job at once: queued, between prefill
chunks or between tokens, and the worker moves on to the next request.

Modules: `protocol` (the OpenAI wire format), `worker` (the generation worker and its channel to the event loop),
`metrics` (Prometheus), `security` (keyless-server checks), `tools` (tool-call parsing), `app` (FastAPI). `create_app` and `ServerConfig` load FastAPI when first asked for, so importing this package (as
the command line does for its flags) stays cheap.
"""

from turbospec.server.protocol import BODY_BYTES_PER_TOKEN, DEFAULT_MAX_BODY, APIError, body_limit
from turbospec.server.worker import Job, Worker

__all__ = ["BODY_BYTES_PER_TOKEN", "DEFAULT_MAX_BODY", "APIError", "body_limit", "Job", "ServerConfig", "Worker",
           "create_app"]


def __getattr__(name: str):
    if name in ("ServerConfig", "create_app"):
        from turbospec.server import app

        return getattr(app, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
