"""Cancellation over real HTTP (uvicorn on a loopback port, in a thread): a client that leaves -- streaming or not,
while its job waits in the queue, during prefill or while tokens flow -- stops its job, and nothing is left running.
A stand-in engine makes each prefill chunk and each token take a few milliseconds, so that a job left to run would
be seen running for seconds; the checks count the work done, not the time taken."""

import contextlib
import socket
import threading
import time
from types import SimpleNamespace

import pytest

httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")
pytest.importorskip("fastapi")

MAX_TOKENS = 2000  # ~20 s at the stand-in's 10 ms per token: far longer than any client here waits
PREFILL_CHUNKS = 500


class PacedEngine:
    """A stand-in engine: `PREFILL_CHUNKS` prefill chunks (asking `abort` between them, as Engine.prefill does)
    then one token every `step_s`; counts what it did."""

    def __init__(self, step_s: float = 0.01, prefill_chunks: int = 0):
        from turbospec.engine import GenStats

        self.step_s = step_s
        self.prefill_chunks = prefill_chunks
        self.model = SimpleNamespace(cfg=SimpleNamespace(vocab_size=300))
        self.tokenizer = None
        self.drafter = None
        self.ctx = 100_000
        self.last_stats = GenStats()
        self.tokens_made = 0
        self.chunks_done = 0
        self.streams = 0
        self.lock = threading.Lock()

    def stream(self, tokens, params, abort=None):
        from turbospec.engine import Chunk, GenStats

        with self.lock:
            self.streams += 1
        st = self.last_stats = GenStats(prompt_tokens=len(tokens))
        for _ in range(self.prefill_chunks):
            if abort is not None and abort():
                st.finish_reason = "abort"
                return
            time.sleep(self.step_s)
            self.chunks_done += 1
        for _ in range(params.max_tokens):
            time.sleep(self.step_s)
            self.tokens_made += 1
            st.gen_tokens += 1
            yield Chunk([65], "A")
        st.finish_reason = "length"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def live(engine, **cfg):
    with live_app(engine, **cfg) as (url, _):
        yield url


@contextlib.contextmanager
def live_app(engine, **cfg):
    """`live`, also yielding the app."""
    from turbospec.server import ServerConfig, create_app

    port = _free_port()
    app = create_app(engine, ServerConfig(model_name="m", **cfg))
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    t = threading.Thread(target=srv.run, daemon=True)
    t.start()
    deadline = time.time() + 30
    while not srv.started:
        assert time.time() < deadline, "server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}", app
    finally:
        srv.should_exit = True
        t.join(15)


def settle(base: str, timeout: float = 30.0) -> dict:
    """/health once nothing waits or runs (or the last answer when that does not happen in `timeout`)."""
    deadline = time.time() + timeout
    while True:
        h = httpx.get(base + "/health").json()
        if (h["running"], h["waiting"]) == (0, 0) or time.time() > deadline:
            return h
        time.sleep(0.02)


def body(stream: bool = False, n: int = MAX_TOKENS) -> dict:
    return {"prompt": [1, 2, 3], "max_tokens": n, "stream": stream}


def test_non_streaming_client_timeout_cancels_the_job():
    eng = PacedEngine()
    with live(eng) as base:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(base + "/v1/completions", json=body(), timeout=1.0)
        assert settle(base) == {"status": "ok", "running": 0, "waiting": 0}
        made = eng.tokens_made
        assert 0 < made < 300  # stopped soon after the client left (~100 tokens at 10 ms), not run to 2000
        time.sleep(0.2)
        assert eng.tokens_made == made  # and nothing keeps generating
        m = httpx.get(base + "/metrics").text
        assert 'turbospec:request_success_total{finished_reason="abort"} 1.0' in m


def test_queued_client_that_leaves_is_dropped_from_the_queue():
    eng = PacedEngine()
    with live(eng) as base:
        with httpx.Client(timeout=30) as h, h.stream("POST", base + "/v1/completions", json=body(True)) as r:
            lines = r.iter_lines()  # (kept: a dropped iterator closes the connection)
            next(lines)  # the worker is busy with this one
            with pytest.raises(httpx.ReadTimeout):  # waits in the queue, then leaves
                httpx.post(base + "/v1/completions", json=body(), timeout=0.5)
            deadline = time.time() + 30
            while httpx.get(base + "/health").json()["waiting"] and time.time() < deadline:
                time.sleep(0.02)
            assert httpx.get(base + "/health").json() == {"status": "ok", "running": 1, "waiting": 0}
        assert settle(base)["running"] == 0
        assert eng.streams == 1  # the queued job never started


def test_client_leaving_during_prefill_stops_it_between_chunks():
    eng = PacedEngine(prefill_chunks=PREFILL_CHUNKS)
    with live(eng) as base:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(base + "/v1/completions", json=body(), timeout=0.5)
        assert settle(base)["running"] == 0
        assert 0 < eng.chunks_done < PREFILL_CHUNKS // 2 and eng.tokens_made == 0


def test_fifty_abrupt_disconnects_leave_nothing_running():
    eng = PacedEngine(step_s=0.002)
    with live(eng, max_queue=64) as base:
        for i in range(50):
            with socket.create_connection(("127.0.0.1", int(base.rsplit(":", 1)[1]))) as s:
                payload = b'{"prompt": [1, 2], "max_tokens": 2000, "stream": %s}' % (b"true" if i % 2 else b"false")
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                          b"Content-Length: %d\r\n\r\n" % len(payload) + payload)
                if i % 3 == 0:
                    s.recv(1)  # some wait for the first byte, others hang up at once
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")  # RST
        assert settle(base) == {"status": "ok", "running": 0, "waiting": 0}
        assert eng.tokens_made < 50 * 2000 // 10
        r = httpx.post(base + "/v1/completions", json=body(n=3), timeout=30)  # and it still serves
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


@pytest.fixture(scope="module")
def tiny_engine_factory(tmp_path_factory):
    from turbospec.config import EngineConfig
    from turbospec.demo import make_demo_model
    from turbospec.engine import Engine
    from turbospec.model import load_model

    path = make_demo_model(tmp_path_factory.mktemp("cancel") / "tiny", hidden_size=32, intermediate_size=64,
                           num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                           vocab_size=300)

    def make(ubatch: int) -> Engine:
        return Engine(load_model(str(path), "float32"), None, EngineConfig(ctx=256, ubatch=ubatch))

    return make


def test_engine_abort_between_prefill_chunks_keeps_the_cache_consistent(tiny_engine_factory):
    """Engine.stream's `abort`: checked between ubatch chunks; an aborted prefill leaves a cache that the next
    request (which may reuse its prefix) decodes from exactly as a fresh engine does."""
    from turbospec.sampling import SamplingParams

    eng, fresh = tiny_engine_factory(ubatch=4), tiny_engine_factory(ubatch=4)
    prompt = list(range(5, 40))
    calls = []

    def abort() -> bool:
        calls.append(1)
        return len(calls) >= 3

    assert list(eng.stream(prompt, SamplingParams(temperature=0, max_tokens=8), abort=abort)) == []
    assert eng.last_stats.finish_reason == "abort" and len(calls) == 3
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    got = [t for c in eng.stream(prompt + [41, 42], params) for t in c.tokens]
    want = [t for c in fresh.stream(prompt + [41, 42], params) for t in c.tokens]
    assert got == want and eng.last_stats.cached_tokens > 0


def test_client_leaving_while_sending_its_body_is_no_server_error():
    eng = PacedEngine()
    with live(eng) as base:
        port = int(base.rsplit(":", 1)[1])
        for _ in range(3):
            with socket.create_connection(("127.0.0.1", port)) as s:
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                          b"Content-Length: 500\r\n\r\n" + b'{"prompt": [1, 2], "max')  # then hangs up
        assert settle(base) == {"status": "ok", "running": 0, "waiting": 0}
        m = httpx.get(base + "/metrics").text
        assert 'code="500"' not in m and 'code="499"' in m  # counted as the client's leaving, not an error
        assert eng.streams == 0


def test_shutdown_answers_queued_and_new_requests():
    """stop_soon (SIGINT / SIGTERM): the running job stops ("abort"), queued and later ones get a 503."""
    import asyncio

    from turbospec.sampling import SamplingParams
    from turbospec.server import APIError, Job, Worker
    from turbospec.server.worker import Channel

    eng = PacedEngine()
    w = Worker(eng, max_queue=4)
    loop = asyncio.new_event_loop()
    try:
        running, queued = (Job([1], SamplingParams(max_tokens=MAX_TOKENS), Channel(loop), time.perf_counter() + 60)
                           for _ in range(2))
        w.submit(running)
        while w.running == 0:
            time.sleep(0.01)
        w.submit(queued)
        w.stop()
        late = Job([1], SamplingParams(max_tokens=2), Channel(loop), time.perf_counter() + 60)
        with pytest.raises(APIError) as e:
            w.submit(late)
        assert e.value.status == 503 and e.value.code == "shutting_down"
        last = loop.run_until_complete(asyncio.wait_for(queued.channel.take(), 10))[-1]
        assert last[0] == "error" and last[1].code == "shutting_down"
        events = []
        while not events or events[-1][0] != "done":
            events += loop.run_until_complete(asyncio.wait_for(running.channel.take(), 10))
        assert events[-1][2] == "abort" and eng.tokens_made < MAX_TOKENS
    finally:
        loop.close()
