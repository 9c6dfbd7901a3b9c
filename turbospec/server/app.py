"""The FastAPI app: `create_app(engine, ServerConfig)` wires the routes (/v1/completions, /v1/chat/completions,
/v1/models, /health, /metrics), the API-key and request-counting middleware and the OpenAI-style error
handlers to one `Server`, which parses a request (`protocol`), queues its job on the `Worker` and answers
with one JSON body or a server-sent-event stream. A client that disconnects cancels its job."""

from __future__ import annotations

import asyncio
import hmac
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from turbospec.sampling import SamplingParams
from turbospec.server import protocol
from turbospec.server.metrics import Metrics, endpoint_label
from turbospec.server.protocol import DEFAULT_MAX_BODY, SSE_DONE, APIError, Reply, sse
from turbospec.server.worker import Job, Worker

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
POLL_S = 0.5  # how often a waiting request checks whether its client is still there


@dataclass
class ServerConfig:
    model_name: str
    api_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY
    max_queue: int = 64
    timeout: float = 600.0
    defaults: SamplingParams | None = None  # None = SamplingParams() (llama.cpp defaults)


class ClientGone(Exception):
    """The client disconnected while its request waited or generated."""


async def read_json(request: Request, limit: int) -> dict:
    """The body as a JSON object; 413 past `limit` bytes (declared or read)."""
    protocol.check_content_length(request.headers.get("content-length"), limit)
    buf = bytearray()
    async for part in request.stream():
        buf += part
        if len(buf) > limit:
            raise protocol.body_too_large(limit)
    return protocol.parse_body(bytes(buf))


class Generation:
    """A queued job seen from its request: the worker's events as they come, counting the generated tokens
    and noticing a client that went away."""

    def __init__(self, request: Request, job: Job, reply: Reply, t_arrival: float):
        self.request = request
        self.job = job
        self.reply = reply
        self.t_arrival = t_arrival
        self.t_first: float | None = None
        self.n_gen = 0

    async def next_event(self) -> tuple:
        """The worker's next event; raises ClientGone (and cancels the job) if the client disconnected."""
        while True:
            try:
                item = await asyncio.wait_for(self.job.out.get(), timeout=POLL_S)
                break
            except asyncio.TimeoutError:
                if await self.request.is_disconnected():
                    self.job.cancelled.set()
                    raise ClientGone from None
        if item[0] == "chunk":
            if self.t_first is None:
                self.t_first = time.perf_counter()
            self.n_gen += len(item[1])
        return item

    def usage(self, stats) -> dict:
        return protocol.usage(stats, len(self.job.tokens), self.n_gen)


class Server:
    """One app's engine, settings, metrics and worker, and its handlers."""

    def __init__(self, engine, cfg: ServerConfig):
        self.engine = engine
        self.cfg = cfg
        self.metrics = Metrics()
        self.defaults = cfg.defaults or SamplingParams()
        self.worker: Worker | None = None  # started by the app's lifespan
        self.created = int(time.time())
        self.api_key = cfg.api_key.encode() if cfg.api_key else None
        self.vocab = int(engine.model.cfg.vocab_size)

    @asynccontextmanager
    async def lifespan(self, app: FastAPI) -> AsyncIterator[None]:
        self.worker = Worker(self.engine, self.cfg.max_queue, self.metrics)
        yield
        self.worker.stop()

    # ---- errors and middleware ---------------------------------------------------------------------------
    def error_response(self, e: APIError) -> JSONResponse:
        self.metrics.errors.labels(e.type).inc()
        headers = {"WWW-Authenticate": "Bearer"} if e.status == 401 else None
        return JSONResponse(e.body(), status_code=e.status, headers=headers)

    async def on_api_error(self, request: Request, e: APIError) -> JSONResponse:
        return self.error_response(e)

    async def on_http_error(self, request: Request, e: StarletteHTTPException) -> JSONResponse:
        type_ = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return self.error_response(APIError(e.status_code, str(e.detail), type_, None, None))

    async def on_internal_error(self, request: Request, e: Exception) -> JSONResponse:
        return self.error_response(APIError(500, f"internal error: {type(e).__name__}: {e}", "server_error"))

    def authorized(self, request: Request) -> bool:
        if self.api_key is None or request.url.path == "/health":
            return True
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self.api_key)

    async def guard(self, request: Request, call_next) -> Response:
        """Middleware: the API key, and every request counted by endpoint and status."""
        endpoint = endpoint_label(request.url.path)
        if not self.authorized(request):
            resp = self.error_response(APIError(401, "invalid or missing API key (Authorization: Bearer ...)",
                                                "authentication_error", None, "invalid_api_key"))
            self.metrics.requests.labels(endpoint, "401").inc()
            return resp
        try:
            resp = await call_next(request)
        except Exception as e:  # noqa: BLE001 - reached when a handler raises past the routing layer
            resp = self.error_response(APIError(500, f"internal error: {e}", "server_error"))
        self.metrics.requests.labels(endpoint, str(resp.status_code)).inc()
        return resp

    # ---- routes ------------------------------------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        return await self.handle(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self.handle(request, chat=True)

    async def models(self):  # no return annotation: FastAPI would take it as a response model
        meta = {"n_ctx": self.engine.ctx, "n_vocab": self.vocab, "speculative": self.engine.drafter is not None}
        return {"object": "list", "data": [{
            "id": self.cfg.model_name, "object": "model", "created": self.created, "owned_by": "turbospec",
            "meta": meta,
        }]}

    async def health(self):
        w = self.worker
        return {"status": "ok", "waiting": w.waiting if w else 0, "running": w.running if w else 0}

    async def prometheus(self) -> PlainTextResponse:
        text, content_type = self.metrics.render()
        return PlainTextResponse(text, media_type=content_type)

    # ---- generation --------------------------------------------------------------------------------------
    def tokenize(self, body: dict, chat: bool) -> list[int]:
        return protocol.prompt_tokens(body, self.engine.tokenizer, self.vocab, chat)

    async def handle(self, request: Request, chat: bool) -> Response:
        """Parse and queue a completion request; answer with one JSON body or a stream."""
        t_arrival = time.perf_counter()
        body = await read_json(request, self.cfg.max_body_bytes)
        protocol.check_common(body, self.cfg.model_name)
        stream = protocol.flag(body, "stream")
        include_usage = protocol.include_usage(body, stream)
        tokens = await run_in_threadpool(self.tokenize, body, chat)  # big prompts must not stall the loop
        if not tokens:
            raise protocol.bad("the prompt is empty after tokenization", protocol.prompt_param(chat))
        params = protocol.sampling_params(body, self.defaults, self.engine.ctx, len(tokens), chat)
        job = Job(tokens, params, asyncio.get_running_loop(), asyncio.Queue(),
                  deadline=t_arrival + self.cfg.timeout)
        self.worker.submit(job)
        gen = Generation(request, job, Reply.new(self.cfg.model_name, chat), t_arrival)
        if stream:
            return StreamingResponse(self.events(gen, include_usage), media_type="text/event-stream",
                                     headers=SSE_HEADERS)
        return await self.complete(gen)

    def finish(self, gen: Generation, stats, reason: str | None) -> str:
        """The finish reason (the server's cut-off, else the engine's), recorded in the metrics."""
        reason = reason or (stats.finish_reason if stats is not None else "stop") or "stop"
        self.metrics.record(stats, gen.t_arrival, gen.t_first, reason)
        return reason

    async def complete(self, gen: Generation) -> Response:
        """The whole completion as one JSON body."""
        text: list[str] = []
        try:
            while True:
                item = await gen.next_event()
                if item[0] == "chunk":
                    text.append(item[2])
                elif item[0] == "error":
                    raise protocol.engine_error(item[1])
                else:
                    stats, reason = item[1], item[2]
                    break
        except ClientGone:
            self.metrics.success.labels("abort").inc()
            return Response(status_code=499)  # nobody is listening; the status is for the logs
        finally:
            gen.job.cancelled.set()  # no-op once done; stops generation if this handler is cancelled
        reason = self.finish(gen, stats, reason)
        body = gen.reply.completion("".join(text), reason, gen.usage(stats), protocol.timings(stats))
        return JSONResponse(body)

    async def events(self, gen: Generation, include_usage: bool) -> AsyncIterator[bytes]:
        """The completion as server-sent events: text deltas, the finish reason, usage, [DONE]."""
        reply = gen.reply
        finished = False
        try:
            if reply.chat:
                yield sse(reply.chunk("", role=True))
            while True:
                item = await gen.next_event()
                if item[0] == "chunk":
                    if item[2]:
                        yield sse(reply.chunk(item[2]))
                    continue
                if item[0] == "error":
                    e = protocol.engine_error(item[1])
                    self.metrics.errors.labels(e.type).inc()
                    finished = True
                    yield sse(e.body())
                else:
                    for event in self.final_events(gen, item[1], item[2], include_usage):
                        yield event
                    finished = True
                yield SSE_DONE
                return
        except ClientGone:
            return
        finally:
            if not finished:
                self.metrics.success.labels("abort").inc()
            gen.job.cancelled.set()  # client went away (or we are done): stop generating, free the worker

    def final_events(self, gen: Generation, stats, reason: str | None, include_usage: bool) -> list[bytes]:
        """The finish-reason chunk (with timings) and, if asked for, the usage chunk."""
        reason = self.finish(gen, stats, reason)
        reply = gen.reply
        out = [sse(reply.chunk(None if reply.chat else "", reason, timings=protocol.timings(stats)))]
        if include_usage:
            out.append(sse(reply.usage_chunk(gen.usage(stats))))
        return out


def create_app(engine, cfg: ServerConfig) -> FastAPI:
    """The OpenAI-compatible app serving `engine`; its worker thread runs while the app's lifespan does."""
    server = Server(engine, cfg)
    app = FastAPI(title="turbospec", lifespan=server.lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.metrics = server.metrics
    app.state.engine = engine
    app.add_exception_handler(APIError, server.on_api_error)
    app.add_exception_handler(StarletteHTTPException, server.on_http_error)
    app.add_exception_handler(Exception, server.on_internal_error)
    app.middleware("http")(server.guard)
    app.add_api_route("/v1/completions", server.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", server.chat_completions, methods=["POST"])
    app.add_api_route("/v1/models", server.models, methods=["GET"])
    app.add_api_route("/health", server.health, methods=["GET"])
    app.add_api_route("/metrics", server.prometheus, methods=["GET"])
    return app
