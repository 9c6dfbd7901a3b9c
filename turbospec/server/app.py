"""The FastAPI app: `create_app(engine, ServerConfig)` wires the routes (/v1/completions, /v1/chat/completions,
/v1/models, /health, /metrics, /slots, and the web page's: see `web`), the API-key and request-counting middleware and the OpenAI-style error
handlers to one `Server`, which parses a request (`protocol`), queues its job on the `Worker` and answers
with one JSON body or a server-sent-event stream. A client that disconnects cancels its job."""

from __future__ import annotations

import asyncio
import re
import time
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from turbospec.errors import TurboSpecError
from turbospec.sampling import SamplingParams
from turbospec.server import protocol, security, tools, web
from turbospec.server.batch_worker import BatchWorker
from turbospec.server.metrics import Metrics, endpoint_label
from turbospec.server.protocol import DEFAULT_MAX_BODY, SSE_DONE, APIError, Reply, sse
from turbospec.server.worker import Channel, Job, Worker

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
INLINE_BODY_BYTES = 64 << 10  # bodies up to this size are parsed and tokenized on the event loop


@dataclass
class ServerConfig:
    model_name: str
    api_keys: tuple[str, ...] = ()  # accepted bearer keys; empty = no key (then the keyless checks apply)
    host: str = "127.0.0.1"  # the bind address: a keyless server also accepts it as the Host header
    max_body_bytes: int = DEFAULT_MAX_BODY
    max_queue: int = 64
    timeout: float = 600.0
    defaults: SamplingParams | None = None  # None = SamplingParams() (llama.cpp defaults)
    body_timeout: float = 30.0  # seconds to receive a request body (then 408)
    max_per_key: int = 0  # concurrent generation requests per API key (0: no limit)
    max_connections: int = 256  # requests in flight at once; more get a 503 (OpenAI JSON)
    stream_interval: float = 0.05  # seconds between two writes of a stream (the first token goes out at once)
    parallel: int = 1  # sequences generated together (continuous batching) when above 1, else one at a time
    slot_save_path: str | None = None  # folder of /slots save and restore files (None: those actions are off)
    web_ui: bool = True  # the page at / (chat and reports) and its read-only routes (turbospec.server.web)
    reports: tuple[str, ...] = ()  # folders (or files) of lab reports the page lists
    history_db: str | None = None  # a `bench --db` history the page lists and compares



SLOT_FILENAME = re.compile(r"[A-Za-z0-9._-]{1,200}")

class ClientGone(Exception):
    """The client disconnected while its request waited or generated."""


async def read_json(request: Request, limit: int, deadline_s: float) -> bytes:
    """The body's bytes; 413 past `limit` bytes (declared or read), 408 when it takes over `deadline_s`."""
    protocol.check_content_length(request.headers.get("content-length"), limit)
    buf = bytearray()

    async def receive_all() -> None:
        async for part in request.stream():
            buf.extend(part)
            if len(buf) > limit:
                raise protocol.body_too_large(limit)

    try:
        await asyncio.wait_for(receive_all(), deadline_s)
    except ClientDisconnect:  # the client hung up while sending
        raise ClientGone from None
    except asyncio.TimeoutError:
        raise APIError(408, f"request body not received within {deadline_s:g} s (--body-timeout)",
                       "invalid_request_error", None, "request_timeout") from None
    return bytes(buf)


class Generation:
    """A queued job seen from its request: the worker's events as they come, counting the generated tokens
    and noticing a client that went away."""

    def __init__(self, job: Job, reply: Reply, t_arrival: float, pace: float = 0.0):
        self.job = job
        self.pace = pace  # seconds between two batches of events taken from the worker (see worker.Channel)
        self.pending: deque[tuple] = deque()  # events taken from the channel, not yet handled
        self.gone = False  # the client disconnected
        self.reply = reply
        self.t_arrival = t_arrival
        self.t_first: float | None = None
        self.n_gen = 0
        self.tool_calls: tools.ToolCallParser | None = None  # set when the output is parsed for tool calls
        self.echo: str | None = None  # the prompt text, when the reply starts with it (completions' echo)
        self.logprobs: protocol.LogprobWriter | None = None  # set when the request asks for logprobs

    async def next_event(self) -> tuple:
        """The worker's next event; raises ClientGone if the client disconnected (the job is cancelled by
        `watch`)."""
        if not self.pending:
            if self.gone:
                raise ClientGone
            self.pending.extend(await self.job.channel.take(self.pace if self.t_first is not None else 0.0))
        item = self.pending.popleft()
        if self.gone and item[0] != "chunk":
            raise ClientGone
        if item[0] == "chunk":
            if self.t_first is None and item[1]:  # not the echo's prompt-logprobs chunk
                self.t_first = time.perf_counter()
            self.n_gen += len(item[1])
        return item

    def usage(self, stats) -> dict:
        return protocol.usage(stats, len(self.job.tokens), self.n_gen)

    def delta(self, item: tuple) -> tuple[str, dict | None]:
        """A streamed chunk event's text (after the echoed prompt, for the chunk with the prompt's logprobs)
        and the wire-format logprobs of its tokens (None: none asked for, or no tokens)."""
        text, lp = item[2], self.logprobs
        if lp is None:
            return text, None
        chunk = item[3]
        lp.add(chunk.logprobs, chunk.prompt_logprobs)
        if chunk.prompt_logprobs is not None and self.echo:
            text = self.echo + text
        return text, lp.pop() if lp.pending else None

    async def watch(self, receive: Receive, worker: Worker) -> None:
        """Wait for the client to hang up (the body is read, so the next ASGI message is the disconnect), then
        cancel the job at once: still queued, in prefill or decoding."""
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                break
        self.gone = True
        worker.cancel(self.job)


class EventStream(Response):
    """The streamed response: the events of `gen` as server-sent events. Everything the worker
    produced since the last write goes out in one write, and a disconnect is noticed at once (not only at the
    next write), cancelling the job."""

    def __init__(self, server: Server, gen: Generation, events: AsyncIterator[bytes]):  # noqa: D107
        self.background = None
        self.status_code = 200
        self.server = server
        self.gen = gen
        self.events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        gen = self.gen
        watcher = asyncio.create_task(gen.watch(receive, self.server.worker))
        headers = [(b"content-type", b"text/event-stream; charset=utf-8")]
        headers += [(k.lower().encode(), v.encode()) for k, v in SSE_HEADERS.items()]
        try:
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            buf: list[bytes] = []
            async for piece in self.events:
                buf.append(piece)
                if not gen.pending:  # nothing more at hand: write what we have
                    await send({"type": "http.response.body", "body": b"".join(buf), "more_body": True})
                    buf.clear()
            await send({"type": "http.response.body", "body": b"".join(buf), "more_body": False})
        except OSError:  # the client is gone (uvicorn raises on a write to a closed connection)
            gen.gone = True
        finally:
            watcher.cancel()
            if gen.gone:
                self.server.worker.cancel(gen.job)
            await self.events.aclose()
            self.server.release(gen.job.key)


class Server:
    """One app's engine, settings, metrics and worker, and its handlers."""

    def __init__(self, engine, cfg: ServerConfig, worker_thread: bool = True):
        self.engine = engine
        self.cfg = cfg
        self.metrics = Metrics()
        self.defaults = cfg.defaults or SamplingParams()
        # the worker runs in a thread started by the app's lifespan, or (worker_thread=False) in the thread that
        # calls `worker.run()`: `turbospec serve` runs it on the main thread (see Worker)
        if cfg.parallel > 1:
            self.worker: Worker = BatchWorker(engine, cfg.max_queue, cfg.parallel, self.metrics, thread=False)
        else:
            self.worker = Worker(engine, cfg.max_queue, self.metrics, thread=False)
        self.worker_thread = worker_thread
        self.created = int(time.time())
        if isinstance(cfg.api_keys, str) or any(not k for k in cfg.api_keys):
            raise TurboSpecError("ServerConfig.api_keys must be a tuple of non-empty keys")
        self.api_keys = tuple(k.encode() for k in cfg.api_keys)
        self.vocab = int(engine.model.cfg.vocab_size)
        self.per_key: dict[str | None, int] = {}  # generation requests in flight per API key label

    @asynccontextmanager
    async def lifespan(self, app: FastAPI) -> AsyncIterator[None]:
        if self.worker_thread:
            self.worker.start()
        yield
        self.worker.stop()

    # ---- errors and middleware ---------------------------------------------------------------------------
    def error_response(self, e: APIError) -> JSONResponse:
        self.metrics.errors.labels(e.type).inc()
        headers = None
        if e.status == 401:
            headers = {"WWW-Authenticate": "Bearer"}
        elif e.status in (429, 503):
            headers = {"Retry-After": "1"}
        return JSONResponse(e.body(), status_code=e.status, headers=headers)

    async def on_api_error(self, request: Request, e: APIError) -> JSONResponse:
        return self.error_response(e)

    async def on_http_error(self, request: Request, e: StarletteHTTPException) -> JSONResponse:
        type_ = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return self.error_response(APIError(e.status_code, str(e.detail), type_, None, None))

    async def on_internal_error(self, request: Request, e: Exception) -> JSONResponse:
        return self.error_response(APIError(500, f"internal error: {type(e).__name__}: {e}", "server_error"))

    def key_of(self, request: Request) -> str | None:
        """Which configured API key the request carries, as a short stable label (`key0`, `key1`, ... in
        configuration order; never the key itself), or None: no keys configured, none sent, or a wrong one."""
        if not self.api_keys:
            return None
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer":
            return None
        i = security.match_key(token.strip(), self.api_keys)
        return None if i is None else security.key_label(i)

    def authorized(self, request: Request) -> APIError | None:
        """Why the request is refused, or None. With API keys: a missing or wrong key (401). Without: a Host
        that is not loopback or the bind address (403), a POST body not declared JSON (415) -- see
        `security`. /health is always open; so are the web page and its assets with an API key (they hold no
        data: the page asks the user for the key)."""
        path = request.url.path
        if path == "/health":
            return None
        if self.api_keys:
            if self.cfg.web_ui and path in web.PUBLIC_PATHS:
                return None
            if self.key_of(request) is not None:
                return None
            return APIError(401, "invalid or missing API key (Authorization: Bearer ...)",
                            "authentication_error", None, "invalid_api_key")
        return security.check_keyless(request.method, request.headers.get("host"),
                                      request.headers.get("content-type"), self.cfg.host)

    # ---- routes ------------------------------------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        return await self.handle(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self.handle(request, chat=True)

    async def models(self):  # no return annotation: FastAPI would take it as a response model
        meta = {"n_ctx": self.engine.ctx, "n_vocab": self.vocab, "speculative": self.engine.drafter is not None,
                "max_tokens": self.defaults.max_tokens or None}  # the -n cap on a request's max_tokens
        return {"object": "list", "data": [{
            "id": self.cfg.model_name, "object": "model", "created": self.created, "owned_by": "turbospec",
            "meta": meta,
        }]}

    async def health(self):
        return {"status": "ok", "waiting": self.worker.waiting, "running": self.worker.running}

    async def slots(self, request: Request, id_slot: int):
        """POST /slots/{id}?action=save|restore|erase, llama-server's shape: save or restore a slot's context to or
        from a file (body {"filename": ...}) in --slot-save-path, or forget it."""
        from functools import partial
        from pathlib import Path

        from turbospec.engine import slots

        action = request.query_params.get("action")
        if action not in slots.ACTIONS:
            raise protocol.bad(f"action must be one of {', '.join(slots.ACTIONS)}", "action")
        path = None
        if action != "erase":
            if not self.cfg.slot_save_path:
                raise APIError(501, "slot save and restore need --slot-save-path DIR", "not_supported_error")
            body = protocol.parse_body(await read_json(request, self.cfg.max_body_bytes, self.cfg.body_timeout))
            name = body.get("filename")
            if not isinstance(name, str) or not SLOT_FILENAME.fullmatch(name) or name.startswith("."):
                raise protocol.bad("filename must be a plain file name (letters, digits, '.', '_', '-')", "filename")
            path = Path(self.cfg.slot_save_path) / name
        if not self.worker.has_room():
            raise self.worker.queue_full()
        job = Job([], self.defaults, Channel(asyncio.get_running_loop()),
                  deadline=time.perf_counter() + self.cfg.timeout,
                  action=partial(slots.run, action, id_slot, path, self.engine, self.worker.scheduler))
        self.worker.submit(job)
        while True:
            for item in await job.channel.take():
                if item[0] == "result":
                    return item[1]
                if item[0] == "error":
                    e = item[1]
                    raise e if isinstance(e, APIError) else APIError(500, f"slot {action} failed: {e}", "server_error")
                if item[0] == "done":  # cancelled or timed out in the queue
                    raise APIError(503, "the server stopped the request", "server_overloaded")

    async def prometheus(self) -> PlainTextResponse:
        text, content_type = self.metrics.render()
        return PlainTextResponse(text, media_type=content_type)

    # ---- generation --------------------------------------------------------------------------------------
    def parse(self, raw: bytes, chat: bool) -> tuple[dict, list[int]]:
        """The body checked and its prompt tokenized."""
        body = protocol.parse_body(raw)
        protocol.check_common(body, self.cfg.model_name, chat)
        tokens = protocol.prompt_tokens(body, self.engine.tokenizer, self.vocab, chat)
        if not tokens:
            raise protocol.bad("the prompt is empty after tokenization", protocol.prompt_param(chat))
        return body, tokens

    def release(self, key: str | None) -> None:
        """A request is over: its API key's concurrency slot is free."""
        n = self.per_key.get(key, 0) - 1
        if n > 0:
            self.per_key[key] = n
        else:
            self.per_key.pop(key, None)

    async def handle(self, request: Request, chat: bool) -> Response:
        """Parse and queue a completion request; answer with one JSON body or a stream."""
        t_arrival = time.perf_counter()
        if not self.worker.has_room():  # before reading the body: a full queue costs no parsing
            raise self.worker.queue_full()
        key = self.key_of(request)
        limit = self.cfg.max_per_key if self.api_keys else 0  # a per-key limit needs keys
        if limit and self.per_key.get(key, 0) >= limit:
            raise APIError(429, f"too many concurrent requests for this API key (limit {limit}, "
                                "--max-concurrent-per-key)", "rate_limit_error", None, "rate_limit_exceeded")
        self.per_key[key] = self.per_key.get(key, 0) + 1  # the key's slot, held until the reply is over
        resp: Response | None = None
        try:
            resp = await self._handle(request, chat, key, t_arrival)
            return resp
        except ClientGone:  # left before its request was read: nobody to answer (the status is for the logs)
            resp = Response(status_code=499)
            return resp
        finally:
            if not isinstance(resp, EventStream):  # a stream frees the slot when it ends
                self.release(key)

    async def _handle(self, request: Request, chat: bool, key: str | None, t_arrival: float) -> Response:
        raw = await read_json(request, self.cfg.max_body_bytes, self.cfg.body_timeout)
        # big prompts are parsed and tokenized off the event loop; small ones are not worth a thread hop
        if len(raw) > INLINE_BODY_BYTES:
            body, tokens = await run_in_threadpool(self.parse, raw, chat)
        else:
            body, tokens = self.parse(raw, chat)
        stream = protocol.flag(body, "stream")
        include_usage = protocol.include_usage(body, stream)
        params = protocol.sampling_params(body, self.defaults, self.engine.ctx, len(tokens), chat)
        params = protocol.with_logprobs_and_bias(params, body, chat, self.vocab)
        job = Job(tokens, params, Channel(asyncio.get_running_loop()), deadline=t_arrival + self.cfg.timeout,
                  key=key)
        gen = Generation(job, Reply.new(self.cfg.model_name, chat), t_arrival, self.cfg.stream_interval)
        if chat and protocol.parse_tools(body).parse_calls:
            gen.tool_calls = tools.ToolCallParser()
        if protocol.echo(body, chat):
            gen.echo = protocol.echo_text(body, self.engine.tokenizer, tokens)
        if params.logprobs is not None:
            gen.logprobs = protocol.LogprobWriter(self.engine.tokenizer, chat, tokens)
        self.worker.submit(job)
        if stream:
            return EventStream(self, gen, self.events(gen, include_usage))
        watcher = asyncio.create_task(gen.watch(request.receive, self.worker))
        try:
            return await self.complete(gen)
        finally:
            watcher.cancel()

    def finish(self, gen: Generation, stats, reason: str | None) -> str:
        """The finish reason (the server's cut-off, else the engine's), recorded in the metrics."""
        reason = reason or (stats.finish_reason if stats is not None else "stop") or "stop"
        self.metrics.record(stats, gen.t_arrival, gen.t_first, reason)
        if reason == "stop" and gen.tool_calls is not None and gen.tool_calls.calls:
            reason = "tool_calls"  # as llama-server: a reply cut off by length stays "length"
        return reason

    async def complete(self, gen: Generation) -> Response:
        """The whole completion as one JSON body."""
        text: list[str] = []
        try:
            while True:
                item = await gen.next_event()
                if item[0] == "chunk":
                    text.append(item[2])
                    if gen.logprobs is not None:
                        gen.logprobs.add(item[3].logprobs, item[3].prompt_logprobs)
                elif item[0] == "error":
                    raise protocol.engine_error(item[1])
                else:
                    stats, reason = item[1], item[2]
                    break
        except ClientGone:
            self.metrics.success.labels("abort").inc()
            return Response(status_code=499)  # nobody is listening; the status is for the logs
        finally:
            self.worker.cancel(gen.job)  # no-op once done; stops generation if this handler is cancelled
        content: str | None = (gen.echo or "") + "".join(text)
        calls: list[tools.ToolCall] = []
        if gen.tool_calls is not None:
            content, calls = gen.tool_calls.split(content or "")
        reason = self.finish(gen, stats, reason)
        body = gen.reply.completion(content or "", reason, gen.usage(stats), protocol.timings(stats),
                                    gen.logprobs.pop() if gen.logprobs is not None else None)
        if calls:
            tools.with_tool_calls(body, content, calls)
        return JSONResponse(body)

    async def events(self, gen: Generation, include_usage: bool) -> AsyncIterator[bytes]:
        """The completion as server-sent events: text deltas, the finish reason, usage, [DONE]."""
        reply = gen.reply
        finished = False
        try:
            if reply.chat:
                yield sse(reply.chunk("", role=True))
            if gen.echo and gen.logprobs is None:  # with logprobs the echo goes out with the prompt's logprobs
                yield sse(reply.chunk(gen.echo))
            while True:
                item = await gen.next_event()
                if item[0] == "chunk":
                    delta, logprobs = gen.delta(item)
                    if delta and gen.tool_calls is not None:  # content flows, a tool call comes whole
                        for piece in gen.tool_calls.feed(delta):
                            yield sse(tools.piece_chunk(reply, piece))
                        if logprobs is not None:
                            yield sse(reply.chunk("", logprobs=logprobs))
                    elif delta or logprobs is not None:
                        yield sse(reply.chunk(delta, logprobs=logprobs))
                    continue
                if item[0] == "error":
                    e = protocol.engine_error(item[1])
                    self.metrics.errors.labels(e.type).inc()
                    finished = True
                    yield sse(e.body())
                else:
                    for text in gen.tool_calls.flush() if gen.tool_calls is not None else ():
                        yield sse(reply.chunk(text))
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
            self.worker.cancel(gen.job)  # client went away (or we are done): stop generating, free the worker

    def final_events(self, gen: Generation, stats, reason: str | None, include_usage: bool) -> list[bytes]:
        """The finish-reason chunk (with timings) and, if asked for, the usage chunk."""
        reason = self.finish(gen, stats, reason)
        reply = gen.reply
        out = [sse(reply.chunk(None if reply.chat else "", reason, timings=protocol.timings(stats)))]
        if include_usage:
            out.append(sse(reply.usage_chunk(gen.usage(stats))))
        return out


class Guard:
    """ASGI middleware in front of every route: access (API key, or the keyless Host / Content-Type checks), the
    limit on requests in flight (a 503 in OpenAI JSON), and every request counted by endpoint and status. A
    plain ASGI layer, so streamed bodies pass through it untouched (Starlette's BaseHTTPMiddleware would copy
    each chunk through a memory stream and hide the client's disconnect from the route)."""

    def __init__(self, app: ASGIApp, server: Server):
        self.app = app
        self.server = server
        self.active = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        server = self.server
        request = Request(scope)
        endpoint = endpoint_label(request.url.path)
        refused = server.authorized(request)
        if refused is None and self.active >= server.cfg.max_connections and endpoint != "/health":
            refused = APIError(503, f"server busy: {self.active} requests in flight (--max-connections)",
                               "server_overloaded", None, "too_many_connections")
        if refused is not None:
            await server.error_response(refused)(scope, receive, send)
            server.metrics.requests.labels(endpoint, str(refused.status)).inc()
            return
        status = 500

        async def send_status(msg: Message) -> None:
            nonlocal status
            if msg["type"] == "http.response.start":
                status = msg["status"]
            await send(msg)

        self.active += 1
        try:
            await self.app(scope, receive, send_status)
        finally:
            self.active -= 1
            server.metrics.requests.labels(endpoint, str(status)).inc()


def create_app(engine, cfg: ServerConfig, worker_thread: bool = True) -> FastAPI:
    """The OpenAI-compatible app serving `engine`. Its worker (`app.state.worker`) runs in a thread while the app's
    lifespan does, or, with `worker_thread=False`, wherever the caller runs `app.state.worker.run()`."""
    server = Server(engine, cfg, worker_thread)
    app = FastAPI(title="turbospec", lifespan=server.lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.metrics = server.metrics
    app.state.engine = engine
    app.state.worker = server.worker
    app.add_exception_handler(APIError, server.on_api_error)
    app.add_exception_handler(StarletteHTTPException, server.on_http_error)
    app.add_exception_handler(Exception, server.on_internal_error)
    app.add_middleware(Guard, server=server)
    app.add_api_route("/v1/completions", server.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", server.chat_completions, methods=["POST"])
    app.add_api_route("/v1/models", server.models, methods=["GET"])
    app.add_api_route("/health", server.health, methods=["GET"])
    app.add_api_route("/metrics", server.prometheus, methods=["GET"])
    app.add_api_route("/slots/{id_slot}", server.slots, methods=["POST"])
    if cfg.web_ui:
        web.add_routes(app, engine, cfg.model_name, web.Lab(cfg.reports, cfg.history_db))
    return app
