"""OpenAI-compatible HTTP server: `turbospec serve -m MODEL`.

Endpoints: /v1/completions, /v1/chat/completions (stream and non-stream), /v1/models, /health, /metrics.

Concurrency model: the engine decodes one sequence at a time, so generation runs in a single worker thread
fed by a bounded FIFO queue. Requests wait their turn (this is a queue, not batched decoding of concurrent
sequences); when more than ``max_queue`` requests are waiting, new ones get 503. A client that disconnects
stops its generation between tokens, and the worker moves on to the next request.
"""

import argparse
import asyncio
import hmac
import json
import math
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from turbospec.errors import TurboSpecError

if TYPE_CHECKING:
    from turbospec.sampling import SamplingParams

DEFAULT_MAX_BODY = 1 << 20  # 1 MiB
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


# ---- errors ------------------------------------------------------------------------------------------------
class APIError(Exception):
    """An error returned to the client as OpenAI-style JSON."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class ClientGone(Exception):
    """The client disconnected while its request waited or generated."""


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


# ---- request parsing ---------------------------------------------------------------------------------------
def _bad(msg: str, param: str | None = None, code: str | None = "invalid_value") -> APIError:
    return APIError(400, msg, param=param, code=code)


def _num(body: dict, name: str, lo: float | None = None, hi: float | None = None, integer: bool = False,
         lo_open: bool = False):
    """A numeric field (None if absent / null); rejects bools, strings, NaN/inf and out-of-range values."""
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise _bad(f"'{name}' must be {'an integer' if integer else 'a number'}, got {type(v).__name__}",
                   name, "invalid_type")
    if integer and not isinstance(v, int):
        if not (isinstance(v, float) and v.is_integer()):
            raise _bad(f"'{name}' must be an integer, got {v!r}", name, "invalid_type")
        v = int(v)
    if isinstance(v, float) and not math.isfinite(v):
        raise _bad(f"'{name}' must be finite, got {v!r}", name)
    if lo is not None and (v <= lo if lo_open else v < lo):
        raise _bad(f"'{name}' must be {'>' if lo_open else '>='} {lo}, got {v!r}", name)
    if hi is not None and v > hi:
        raise _bad(f"'{name}' must be <= {hi}, got {v!r}", name)
    return v


def _flag(body: dict, name: str) -> bool:
    v = body.get(name)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise _bad(f"'{name}' must be a boolean", name, "invalid_type")
    return v


def _stop(body: dict) -> list[str]:
    v = body.get("stop")
    if v is None:
        return []
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise _bad("'stop' must be a string or a list of strings", "stop", "invalid_type")
    if len(v) > 16:
        raise _bad("'stop' may hold at most 16 strings", "stop")
    return [s for s in v if s]


def _message_text(content: Any, i: int) -> str:
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
        parts = []
        for part in content:
            ok = isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
            if not ok:
                raise _bad(f"messages[{i}].content: only text parts are supported", f"messages[{i}].content",
                           "invalid_type")
            parts.append(part["text"])
        return "".join(parts)
    raise _bad(f"messages[{i}].content must be a string or a list of text parts", f"messages[{i}].content",
               "invalid_type")


def parse_messages(body: dict) -> list[dict[str, str]]:
    msgs = body.get("messages")
    if msgs is None:
        raise _bad("'messages' is required", "messages", "missing_required_parameter")
    if not isinstance(msgs, list) or not msgs:
        raise _bad("'messages' must be a non-empty list", "messages", "invalid_type")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise _bad(f"messages[{i}] must be an object", f"messages[{i}]", "invalid_type")
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise _bad(f"messages[{i}].role must be a non-empty string", f"messages[{i}].role",
                       "invalid_type")
        out.append({"role": role, "content": _message_text(m.get("content"), i)})
    return out


def parse_prompt(body: dict, vocab: int) -> str | list[int]:
    p = body.get("prompt")
    if p is None:
        raise _bad("'prompt' is required", "prompt", "missing_required_parameter")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]  # a batch of one prompt
    if isinstance(p, str):
        if not p:
            raise _bad("'prompt' must not be empty", "prompt")
        return p
    if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        if any(t < 0 or t >= vocab for t in p):
            raise _bad(f"prompt token ids must lie in [0, {vocab})", "prompt")
        return list(p)
    if isinstance(p, list) and len(p) > 1 and all(isinstance(x, (str, list)) for x in p):
        raise _bad("only one prompt per request is supported", "prompt", "unsupported_value")
    raise _bad("'prompt' must be a string or a non-empty list of token ids", "prompt", "invalid_type")


# ---- the worker --------------------------------------------------------------------------------------------
@dataclass
class Job:
    tokens: list[int]
    params: "SamplingParams"
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue
    deadline: float
    cancelled: threading.Event = field(default_factory=threading.Event)
    enqueued: float = field(default_factory=time.perf_counter)

    def emit(self, item: tuple) -> None:
        try:
            self.loop.call_soon_threadsafe(self.out.put_nowait, item)
        except RuntimeError:  # the event loop is gone (shutdown)
            self.cancelled.set()


class Worker:
    """One thread that runs engine.stream for queued jobs, one at a time."""

    def __init__(self, engine, max_queue: int, metrics: "Metrics | None" = None):
        self.engine = engine
        self.max_queue = max_queue
        self.metrics = metrics
        self.q: queue.Queue[Job | None] = queue.Queue()
        self.waiting = 0
        self.running = 0
        self.lock = threading.Lock()
        self.current: Job | None = None
        self.thread = threading.Thread(target=self._loop, name="turbospec-worker", daemon=True)
        self.thread.start()

    def submit(self, job: Job) -> None:
        with self.lock:
            if self.waiting >= self.max_queue:
                raise APIError(503, f"server busy: {self.waiting} requests already waiting (--max-queue)",
                               "server_overloaded", None, "queue_full")
            self.waiting += 1
        self._gauges()
        self.q.put(job)

    def stop(self) -> None:
        cur = self.current
        if cur is not None:
            cur.cancelled.set()
        self.q.put(None)
        self.thread.join(timeout=5)

    def _gauges(self) -> None:
        if self.metrics is not None:
            self.metrics.waiting.set(self.waiting)
            self.metrics.running.set(self.running)

    def _loop(self) -> None:
        while True:
            job = self.q.get()
            if job is None:
                return
            with self.lock:
                self.waiting -= 1
                self.running = 1
                self.current = job
            self._gauges()
            try:
                self._run(job)
            finally:
                with self.lock:
                    self.running = 0
                    self.current = None
                self._gauges()

    def _run(self, job: Job) -> None:
        start = time.perf_counter()
        if self.metrics is not None:
            self.metrics.queue_time.observe(start - job.enqueued)
        if job.cancelled.is_set():
            job.emit(("done", None, "abort"))
            return
        if start > job.deadline:
            job.emit(("error", APIError(503, "request timed out waiting in the queue (--timeout)",
                                        "server_overloaded", None, "queue_timeout")))
            return
        reason = None
        gen = None
        try:
            gen = self.engine.stream(job.tokens, job.params)
            for chunk in gen:
                job.emit(("chunk", chunk.tokens, chunk.text))
                if job.cancelled.is_set():
                    reason = "abort"
                    break
                if time.perf_counter() > job.deadline:
                    reason = "length"
                    break
        except Exception as e:  # noqa: BLE001 - engine failure: report it, keep serving
            job.emit(("error", e))
            return
        finally:
            if gen is not None:
                gen.close()
        job.emit(("done", self.engine.last_stats, reason))


# ---- metrics -----------------------------------------------------------------------------------------------
class Metrics:
    def __init__(self):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        r = self.registry = CollectorRegistry()
        p = "turbospec:"
        lat = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320)
        tok = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
        self.requests = Counter(p + "http_requests", "HTTP requests by endpoint and status code",
                                ["endpoint", "code"], registry=r)
        self.success = Counter(p + "request_success", "Finished generations by finish reason",
                               ["finished_reason"], registry=r)
        self.errors = Counter(p + "request_errors", "Requests answered with an error, by error type",
                              ["type"], registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens processed", registry=r)
        self.gen_tokens = Counter(p + "generation_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram(p + "time_to_first_token_seconds",
                              "Request arrival to first token (incl. queue)", buckets=lat, registry=r)
        self.latency = Histogram(p + "e2e_request_latency_seconds", "Request arrival to last token",
                                 buckets=lat, registry=r)
        self.queue_time = Histogram(p + "request_queue_time_seconds", "Time spent waiting in the queue",
                                    buckets=lat, registry=r)
        self.tpot = Histogram(p + "time_per_output_token_seconds", "Decode time per output token",
                              buckets=tok, registry=r)
        self.waiting = Gauge(p + "num_requests_waiting", "Requests waiting in the queue", registry=r)
        self.running = Gauge(p + "num_requests_running", "Requests being generated", registry=r)
        self.spec_drafts = Counter(p + "spec_decode_num_drafts", "Verification steps that carried a draft",
                                   registry=r)
        self.spec_draft_tokens = Counter(p + "spec_decode_num_draft_tokens", "Draft tokens proposed",
                                         registry=r)
        self.spec_accepted = Counter(p + "spec_decode_num_accepted_tokens", "Draft tokens accepted",
                                     registry=r)
        self.spec_accepted_pos = Counter(p + "spec_decode_num_accepted_tokens_per_pos",
                                         "Draft tokens accepted at each draft position", ["position"],
                                         registry=r)
        self.spec_drafted_pos = Counter(p + "spec_decode_num_draft_tokens_per_pos",
                                        "Drafts reaching each draft position", ["position"], registry=r)

    def record(self, stats, t_arrival: float, t_first: float | None, reason: str) -> None:
        now = time.perf_counter()
        self.success.labels(reason).inc()
        self.latency.observe(now - t_arrival)
        if stats is None:
            return
        self.prompt_tokens.inc(stats.prompt_tokens)
        self.gen_tokens.inc(stats.gen_tokens)
        if t_first is not None:
            self.ttft.observe(t_first - t_arrival)
        if stats.gen_tokens > 1 and stats.decode_s > 0:
            self.tpot.observe(stats.decode_s / (stats.gen_tokens - 1))
        spec = stats.extra.get("spec")
        if spec is not None:
            self.spec_drafts.inc(spec.drafts)
            self.spec_draft_tokens.inc(spec.draft_tokens)
            self.spec_accepted.inc(spec.accepted)
            for i, (d, a) in enumerate(zip(spec.per_pos_drafted, spec.per_pos_accepted)):
                self.spec_drafted_pos.labels(str(i)).inc(d)
                self.spec_accepted_pos.labels(str(i)).inc(a)


def timings(stats) -> dict:
    """llama-server-style timings."""
    if stats is None:
        return {}
    gen_s = max(stats.ttft_s - stats.prefill_s, 0.0) + stats.decode_s
    spec = stats.extra.get("spec")
    return {
        "prompt_n": stats.prompt_tokens,
        "prompt_ms": stats.prefill_s * 1e3,
        "prompt_per_token_ms": stats.prefill_s * 1e3 / stats.prompt_tokens if stats.prompt_tokens else 0.0,
        "prompt_per_second": stats.prefill_tps,
        "predicted_n": stats.gen_tokens,
        "predicted_ms": gen_s * 1e3,
        "predicted_per_token_ms": gen_s * 1e3 / stats.gen_tokens if stats.gen_tokens else 0.0,
        "predicted_per_second": stats.gen_tokens / gen_s if gen_s > 0 else 0.0,
        "draft_n": spec.draft_tokens if spec is not None else 0,
        "draft_n_accepted": spec.accepted if spec is not None else 0,
    }


def usage(stats, n_prompt: int, n_gen: int) -> dict:
    if stats is not None:
        n_prompt, n_gen = stats.prompt_tokens, stats.gen_tokens
    return {"prompt_tokens": n_prompt, "completion_tokens": n_gen, "total_tokens": n_prompt + n_gen}


# ---- the app -----------------------------------------------------------------------------------------------
@dataclass
class ServerConfig:
    model_name: str
    api_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY
    max_queue: int = 64
    timeout: float = 600.0
    defaults: "SamplingParams | None" = None  # None = SamplingParams() (llama.cpp defaults)


def create_app(engine, cfg: ServerConfig):
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
    from starlette.concurrency import run_in_threadpool
    from starlette.exceptions import HTTPException as StarletteHTTPException

    from turbospec.sampling import SamplingParams

    metrics = Metrics()
    defaults = cfg.defaults or SamplingParams()
    state: dict[str, Any] = {}
    created = int(time.time())
    api_key = cfg.api_key.encode() if cfg.api_key else None
    vocab = int(engine.model.cfg.vocab_size)

    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(app):
        state["worker"] = Worker(engine, cfg.max_queue, metrics)
        yield
        state["worker"].stop()

    app = FastAPI(title="turbospec", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.metrics = metrics
    app.state.engine = engine

    def err_response(e: APIError) -> JSONResponse:
        metrics.errors.labels(e.type).inc()
        headers = {"WWW-Authenticate": "Bearer"} if e.status == 401 else None
        return JSONResponse(e.body(), status_code=e.status, headers=headers)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return err_response(e)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        type_ = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return err_response(APIError(e.status_code, str(e.detail), type_, None, None))

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception):
        return err_response(APIError(500, f"internal error: {type(e).__name__}: {e}", "server_error"))

    @app.middleware("http")
    async def _guard(request: Request, call_next):
        path = request.url.path
        if api_key is not None and path != "/health":
            auth = request.headers.get("authorization", "")
            scheme, _, token = auth.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key):
                resp = err_response(APIError(401, "invalid or missing API key (Authorization: Bearer ...)",
                                             "authentication_error", None, "invalid_api_key"))
                metrics.requests.labels(_endpoint(path), "401").inc()
                return resp
        try:
            resp = await call_next(request)
        except Exception as e:  # noqa: BLE001 - reached when a handler raises past the routing layer
            resp = err_response(APIError(500, f"internal error: {e}", "server_error"))
        metrics.requests.labels(_endpoint(path), str(resp.status_code)).inc()
        return resp

    async def read_json(request: Request) -> dict:
        cl = request.headers.get("content-length")
        if cl is not None:
            try:
                n = int(cl)
            except ValueError:
                raise _bad("invalid Content-Length header", None, "invalid_request") from None
            if n > cfg.max_body_bytes:
                raise APIError(413, f"request body too large ({n} > {cfg.max_body_bytes} bytes)",
                               code="request_too_large")
        buf = bytearray()
        async for part in request.stream():
            buf += part
            if len(buf) > cfg.max_body_bytes:
                raise APIError(413, f"request body too large (> {cfg.max_body_bytes} bytes)",
                               code="request_too_large")
        try:
            text = bytes(buf).decode("utf-8")
        except UnicodeDecodeError as e:
            raise _bad(f"request body is not valid UTF-8 ({e.reason} at byte {e.start})", None,
                       "invalid_utf8") from None
        try:
            body = json.loads(text)
        except (json.JSONDecodeError, RecursionError) as e:
            raise _bad(f"request body is not valid JSON: {str(e)[:200]}", None, "invalid_json") from None
        if not isinstance(body, dict):
            raise _bad("request body must be a JSON object", None, "invalid_type")
        return body

    def check_common(body: dict) -> None:
        model = body.get("model")
        if model is not None:
            if not isinstance(model, str):
                raise _bad("'model' must be a string", "model", "invalid_type")
            if model != cfg.model_name:
                raise APIError(404, f"model '{model[:100]}' not found; this server serves '{cfg.model_name}'",
                               "not_found_error", "model", "model_not_found")
        n = _num(body, "n", integer=True)
        if n is not None and n != 1:
            raise _bad("only n=1 is supported", "n", "unsupported_value")
        for name in ("best_of",):
            v = _num(body, name, integer=True)
            if v is not None and v != 1:
                raise _bad(f"only {name}=1 is supported", name, "unsupported_value")
        so = body.get("stream_options")
        if so is not None and not isinstance(so, dict):
            raise _bad("'stream_options' must be an object", "stream_options", "invalid_type")

    def build_params(body: dict, n_prompt: int, chat: bool) -> SamplingParams:
        d = defaults
        room = engine.ctx - n_prompt
        if room < 1:
            raise _bad(f"prompt is {n_prompt} tokens; the context holds {engine.ctx} (no room to generate)",
                       "messages" if chat else "prompt", "context_length_exceeded")
        mt = _num(body, "max_completion_tokens", integer=True) if chat else None
        if mt is None:
            mt = _num(body, "max_tokens", integer=True)
        param = "max_tokens"
        if mt is None:
            mt = min(d.max_tokens, room) if d.max_tokens > 0 else room
        if mt <= 0:
            raise _bad(f"'{param}' must be >= 1, got {mt}", param)
        if mt > room:
            raise _bad(f"prompt ({n_prompt} tokens) + max_tokens ({mt}) exceeds the context size "
                       f"{engine.ctx}", param, "context_length_exceeded")

        def pick(name: str, default, **kw):
            v = _num(body, name, **kw)
            return default if v is None else v

        try:
            return SamplingParams(
                temperature=pick("temperature", d.temperature, lo=0, hi=2),
                top_p=pick("top_p", d.top_p, lo=0, hi=1, lo_open=True),
                top_k=pick("top_k", d.top_k, lo=0, integer=True),
                min_p=pick("min_p", d.min_p, lo=0, hi=1),
                presence_penalty=pick("presence_penalty", d.presence_penalty, lo=-2, hi=2),
                frequency_penalty=pick("frequency_penalty", d.frequency_penalty, lo=-2, hi=2),
                repeat_penalty=pick("repeat_penalty", d.repeat_penalty, lo=0, lo_open=True),
                repeat_last_n=d.repeat_last_n,
                seed=pick("seed", d.seed, integer=True, lo=-(2**63), hi=2**64 - 1),
                max_tokens=mt,
                stop=_stop(body) if "stop" in body else list(d.stop),
                ignore_eos=_flag(body, "ignore_eos") or d.ignore_eos,
            )
        except ValueError as e:
            raise _bad(str(e)) from None

    def tokenize(body: dict, chat: bool) -> list[int]:
        if engine.tokenizer is None:
            if chat:
                raise _bad("this model has no tokenizer; chat is unavailable", "messages",
                           "unsupported_value")
            p = parse_prompt(body, vocab)
            if isinstance(p, str):
                raise _bad("this model has no tokenizer; send token ids", "prompt", "unsupported_value")
            return p
        param = "messages" if chat else "prompt"
        try:
            if chat:
                text = engine.tokenizer.render_chat(parse_messages(body))
            else:
                p = parse_prompt(body, vocab)
                if isinstance(p, list):
                    return p
                text = p
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:
                raise _bad("the text is not valid Unicode (lone surrogate escape)", param) from None
            return engine.tokenizer.encode(text, add_special=not chat)
        except TurboSpecError as e:
            raise _bad(str(e), param) from None

    async def handle(request: Request, chat: bool):
        t_arrival = time.perf_counter()
        body = await read_json(request)
        check_common(body)
        stream = _flag(body, "stream")
        so = body.get("stream_options") or {}
        include_usage = bool(so.get("include_usage")) if stream else True
        tokens = await run_in_threadpool(tokenize, body, chat)  # big prompts must not stall the event loop
        if not tokens:
            raise _bad("the prompt is empty after tokenization", "messages" if chat else "prompt")
        params = build_params(body, len(tokens), chat)
        loop = asyncio.get_running_loop()
        job = Job(tokens, params, loop, asyncio.Queue(), deadline=t_arrival + cfg.timeout)
        state["worker"].submit(job)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        now = int(time.time())
        if stream:
            gen = sse_stream(request, job, rid, now, chat, include_usage, t_arrival)
            return StreamingResponse(gen, media_type="text/event-stream", headers=SSE_HEADERS)
        return await complete(request, job, rid, now, chat, t_arrival)

    async def next_item(request: Request, job: Job) -> tuple:
        """The worker's next event; polls for a client disconnect while waiting."""
        while True:
            try:
                return await asyncio.wait_for(job.out.get(), timeout=0.5)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    job.cancelled.set()
                    raise ClientGone from None

    def finish(job: Job, stats, reason: str | None, t_arrival: float, t_first: float | None) -> str:
        reason = reason or (stats.finish_reason if stats is not None else "stop") or "stop"
        metrics.record(stats, t_arrival, t_first, reason)
        return reason

    def engine_error(e: Exception) -> APIError:
        if isinstance(e, APIError):
            return e
        if isinstance(e, (TurboSpecError, ValueError)):
            return APIError(400, str(e), "invalid_request_error", None, None)
        return APIError(500, f"generation failed: {type(e).__name__}: {e}", "server_error", None, None)

    async def complete(request: Request, job: Job, rid: str, now: int, chat: bool, t_arrival: float):
        text: list[str] = []
        n_gen = 0
        t_first = None
        try:
            while True:
                item = await next_item(request, job)
                if item[0] == "chunk":
                    if t_first is None:
                        t_first = time.perf_counter()
                    n_gen += len(item[1])
                    text.append(item[2])
                elif item[0] == "error":
                    raise engine_error(item[1])
                else:
                    stats, reason = item[1], item[2]
                    break
        except ClientGone:
            metrics.success.labels("abort").inc()
            return Response(status_code=499)  # nobody is listening; the status is for the logs
        finally:
            job.cancelled.set()  # no-op once done; stops generation if this handler is cancelled
        reason = finish(job, stats, reason, t_arrival, t_first)
        out = "".join(text)
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": out}, "logprobs": None,
                      "finish_reason": reason}
        else:
            choice = {"index": 0, "text": out, "logprobs": None, "finish_reason": reason}
        return JSONResponse({
            "id": rid, "object": "chat.completion" if chat else "text_completion", "created": now,
            "model": cfg.model_name, "choices": [choice], "usage": usage(stats, len(job.tokens), n_gen),
            "timings": timings(stats),
        })

    async def sse_stream(request: Request, job: Job, rid: str, now: int, chat: bool, include_usage: bool,
                         t_arrival: float) -> AsyncIterator[bytes]:
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(delta: str | None, reason: str | None = None, role: bool = False, **extra) -> bytes:
            if chat:
                d: dict = {}
                if role:
                    d["role"] = "assistant"
                if delta is not None:
                    d["content"] = delta
                choice = {"index": 0, "delta": d, "logprobs": None, "finish_reason": reason}
            else:
                choice = {"index": 0, "text": delta or "", "logprobs": None, "finish_reason": reason}
            msg = {"id": rid, "object": obj, "created": now, "model": cfg.model_name, "choices": [choice]}
            msg.update(extra)
            return b"data: " + json.dumps(msg).encode() + b"\n\n"

        t_first = None
        n_gen = 0
        finished = False
        try:
            if chat:
                yield chunk("", role=True)
            while True:
                item = await next_item(request, job)
                if item[0] == "chunk":
                    if t_first is None:
                        t_first = time.perf_counter()
                    n_gen += len(item[1])
                    if item[2]:
                        yield chunk(item[2])
                elif item[0] == "error":
                    e = engine_error(item[1])
                    metrics.errors.labels(e.type).inc()
                    finished = True
                    yield b"data: " + json.dumps(e.body()).encode() + b"\n\n"
                    yield b"data: [DONE]\n\n"
                    return
                else:
                    stats, reason = item[1], item[2]
                    reason = finish(job, stats, reason, t_arrival, t_first)
                    u = usage(stats, len(job.tokens), n_gen)
                    yield chunk(None if chat else "", reason, timings=timings(stats))
                    if include_usage:
                        msg = {"id": rid, "object": obj, "created": now, "model": cfg.model_name,
                               "choices": [], "usage": u}
                        yield b"data: " + json.dumps(msg).encode() + b"\n\n"
                    finished = True
                    yield b"data: [DONE]\n\n"
                    return
        except ClientGone:
            return
        finally:
            if not finished:
                metrics.success.labels("abort").inc()
            job.cancelled.set()  # client went away (or we are done): stop generating, free the worker

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, chat=True)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": cfg.model_name, "object": "model", "created": created, "owned_by": "turbospec",
            "meta": {"n_ctx": engine.ctx, "n_vocab": vocab, "speculative": engine.drafter is not None},
        }]}

    @app.get("/health")
    async def health():
        w = state.get("worker")
        return {"status": "ok", "waiting": w.waiting if w else 0, "running": w.running if w else 0}

    @app.get("/metrics")
    async def prom():
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return PlainTextResponse(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


def _endpoint(path: str) -> str:
    known = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")
    return path if path in known else "other"


# ---- CLI ---------------------------------------------------------------------------------------------------
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
    import os

    import uvicorn

    from turbospec.cli import load_engine, sampling_params

    if a.max_body_bytes <= 0 or a.max_queue <= 0 or not (a.timeout > 0):
        raise TurboSpecError("--max-body-bytes, --max-queue and --timeout must be positive")
    if not (0 < a.port < 65536):
        raise TurboSpecError("--port must be in 1..65535")
    defaults = sampling_params(a)
    engine, path = load_engine(a)
    name = a.alias or Path(path).name
    key = a.api_key or os.environ.get("TURBOSPEC_API_KEY") or None
    cfg = ServerConfig(model_name=name, api_key=key, max_body_bytes=a.max_body_bytes, max_queue=a.max_queue,
                       timeout=a.timeout, defaults=defaults)
    app = create_app(engine, cfg)
    print(f"turbospec serve: model '{name}' on http://{a.host}:{a.port} (ctx {engine.ctx}, "
          f"queue {a.max_queue}{', api key required' if key else ''})", flush=True)
    uvicorn.run(app, host=a.host, port=a.port, log_level=a.log_level,
                limit_concurrency=max(64, 4 * a.max_queue), timeout_keep_alive=30, access_log=False,
                timeout_graceful_shutdown=10)
    return 0
