"""The OpenAI-compatible server: a real server process driven by the official openai client, bad input,
auth, metrics and shutdown; plus in-process tests (FastAPI TestClient) for speculation metrics, engine
failures, the bounded queue and disconnects."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")

KEY = "test-key-123"
SHAPE = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
             "num_key_value_heads": 1, "head_dim": 16, "vocab_size": 300}
CTX = 1024
MAX_BODY = 32768


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from turbospec.demo import make_demo_model

    return make_demo_model(tmp_path_factory.mktemp("srv") / "tiny", **SHAPE)


@pytest.fixture(scope="module")
def server(tiny_model):
    port = _free_port()
    cmd = [sys.executable, "-m", "turbospec.cli", "serve", "-m", str(tiny_model), "--port", str(port),
           "-c", str(CTX), "-t", "1", "--spec-type", "ngram", "--api-key", KEY,
           "--max-body-bytes", str(MAX_BODY), "--max-queue", "8", "-n", "-1"]  # -n -1: no max_tokens cap
    env = dict(os.environ, TURBOSPEC_API_KEY="")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 60
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited early:\n{proc.stdout.read().decode(errors='replace')}")
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if time.time() > deadline:
            proc.kill()
            raise RuntimeError("server did not come up")
        time.sleep(0.2)
    yield base, proc
    if proc.poll() is None:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key=KEY, max_retries=0, timeout=30)


def _metric(text: str, name: str) -> float:
    line = next(ln for ln in text.splitlines() if ln.startswith((name + " ", name + "{")))
    return float(line.split()[-1])


def _auth():
    return {"Authorization": f"Bearer {KEY}"}


# ---- the real server with the openai client ---------------------------------------------------------------
def test_models_and_health(server, client):
    ids = [m.id for m in client.models.list().data]
    assert ids == ["tiny"]
    assert httpx.get(server[0] + "/health").json()["status"] == "ok"  # no key needed for /health


def test_completion_basic(client):
    r = client.completions.create(model="tiny", prompt="hello hello hello", max_tokens=12, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.object == "text_completion"
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 12 and r.usage.prompt_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + 12
    t = r.model_extra["timings"]
    for k in ("prompt_n", "prompt_ms", "prompt_per_second", "predicted_n", "predicted_ms",
              "predicted_per_second", "draft_n", "draft_n_accepted"):
        assert k in t
    assert t["predicted_n"] == 12 and t["prompt_n"] + t["cache_n"] == r.usage.prompt_tokens


def test_streaming_matches_non_streaming(client):
    kw = {"model": "tiny", "prompt": "abc abc abc", "max_tokens": 16, "temperature": 0,
          "extra_body": {"ignore_eos": True}}
    full = client.completions.create(**kw).choices[0].text
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 16
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_chat_and_chat_stream(client):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=8, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert r.usage.completion_tokens == 8
    stream = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=8, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == r.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 8


def test_stop_sequences(client):
    kw = {"model": "tiny", "prompt": "the cat sat on", "max_tokens": 24, "temperature": 0,
          "extra_body": {"ignore_eos": True}}
    full = client.completions.create(**kw).choices[0].text
    assert len(full) >= 6
    stop = full[4:6]
    r = client.completions.create(stop=[stop, "\x00never"], **kw)
    assert r.choices[0].text == full[:full.find(stop)]
    assert r.choices[0].finish_reason == "stop"
    r2 = client.completions.create(stop=stop, **kw)  # a single string works too
    assert r2.choices[0].text == r.choices[0].text


def test_seed_reproducible(client):
    kw = {"model": "tiny", "prompt": "random words:", "max_tokens": 20, "temperature": 1.0, "top_p": 1.0,
              "extra_body": {"ignore_eos": True, "top_k": 0, "min_p": 0.0}}
    a = client.completions.create(seed=1234, **kw).choices[0].text
    b = client.completions.create(seed=1234, **kw).choices[0].text
    assert a == b
    others = {client.completions.create(seed=s, **kw).choices[0].text for s in (1, 2, 3)}
    assert len(others | {a}) > 1


BAD_REQUESTS = [
    # (description, path, raw body or json, expected status, expected param or None)
    ("malformed json", "/v1/completions", b'{"prompt": "x",', 400, None),
    ("invalid utf-8", "/v1/completions", b'{"prompt": "\xff\xfe"}', 400, None),
    ("not an object", "/v1/completions", b'["prompt"]', 400, None),
    ("empty body", "/v1/completions", b"", 400, None),
    ("missing prompt", "/v1/completions", {"model": "tiny", "max_tokens": 3}, 400, "prompt"),
    ("missing messages", "/v1/chat/completions", {"model": "tiny"}, 400, "messages"),
    ("prompt wrong type", "/v1/completions", {"prompt": 42}, 400, "prompt"),
    ("messages wrong type", "/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
    ("message without role", "/v1/chat/completions", {"messages": [{"content": "hi"}]}, 400,
     "messages[0].role"),
    ("max_tokens zero", "/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("max_tokens negative", "/v1/completions", {"prompt": "x", "max_tokens": -5}, 400, "max_tokens"),
    ("max_tokens huge", "/v1/completions", {"prompt": "x", "max_tokens": 10**12}, 400, "max_tokens"),
    ("max_tokens string", "/v1/completions", {"prompt": "x", "max_tokens": "10"}, 400, "max_tokens"),
    ("temperature negative", "/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature"),
    ("temperature string", "/v1/completions", {"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ("top_p zero", "/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("top_p above one", "/v1/completions", {"prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ("top_k fractional", "/v1/completions", {"prompt": "x", "top_k": 2.5}, 400, "top_k"),
    ("stop wrong type", "/v1/completions", {"prompt": "x", "stop": [1, 2]}, 400, "stop"),
    ("stream wrong type", "/v1/completions", {"prompt": "x", "stream": "yes"}, 400, "stream"),
    ("seed wrong type", "/v1/completions", {"prompt": "x", "seed": "abc"}, 400, "seed"),
    ("n > 1", "/v1/completions", {"prompt": "x", "n": 2}, 400, "n"),
    ("unknown model", "/v1/completions", {"model": "gpt-99", "prompt": "x"}, 404, "model"),
    ("token id out of vocab", "/v1/completions", {"prompt": [5, 999999]}, 400, "prompt"),
    ("prompt longer than context", "/v1/completions", {"prompt": "a" * (CTX + 50)}, 400, "prompt"),
    ("prompt + max_tokens over context", "/v1/completions", {"prompt": "a" * (CTX - 10), "max_tokens": 100},
     400, "max_tokens"),
    ("oversize body", "/v1/completions", {"prompt": "a" * (MAX_BODY * 2)}, 413, None),
    ("several prompts", "/v1/completions", {"prompt": ["a", "b"]}, 400, "prompt"),
    ("unknown route", "/v1/nothing", {"prompt": "x"}, 404, None),
    ("lone surrogate escape", "/v1/completions", b'{"prompt": "\\ud800x"}', 400, "prompt"),
    ("deeply nested json", "/v1/completions", b"[" * 5000 + b"]" * 5000, 400, None),
    ("seed out of range", "/v1/completions", {"prompt": "x", "seed": 10**30}, 400, "seed"),
    ("max_tokens bool", "/v1/completions", {"prompt": "x", "max_tokens": True}, 400, "max_tokens"),
    ("image content", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "messages[0].content"),
    ("stream_options not an object", "/v1/completions", {"prompt": "x", "stream_options": 5}, 400,
     "stream_options"),
    ("unknown field", "/v1/completions", {"prompt": "x", "frobnicate": 1}, 400, "frobnicate"),
    ("lone surrogate in model", "/v1/completions", b'{"model": "\\ud800", "prompt": "x"}', 400, "model"),
    ("5000-digit number", "/v1/completions", b'{"prompt": "x", "seed": ' + b"7" * 5000 + b"}", 400, None),
]


def test_bad_requests_then_still_healthy(server, client):
    base = server[0]
    with httpx.Client(base_url=base, headers=_auth(), timeout=30) as h:
        for desc, path, body, status, param in BAD_REQUESTS:
            if isinstance(body, bytes):
                r = h.post(path, content=body, headers={"Content-Type": "application/json"})
            else:
                r = h.post(path, json=body)
            assert r.status_code == status, (desc, r.status_code, r.text)
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"}, desc
            assert isinstance(err["message"], str) and err["message"], desc
            if param is not None:
                assert err["param"] == param, (desc, err)
        r = h.get("/v1/completions")  # wrong method
        assert r.status_code == 405 and "error" in r.json()
    # a huge declared Content-Length is refused before the body is read
    host, port = base.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                  f"Content-Type: application/json\r\nContent-Length: {MAX_BODY * 100}\r\n\r\n{{}}".encode())
        head = s.recv(4096).decode(errors="replace")
    assert head.startswith("HTTP/1.1 413"), head[:200]
    assert len(BAD_REQUESTS) >= 20
    r = client.completions.create(model="tiny", prompt="still alive?", max_tokens=5, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 5
    assert server[1].poll() is None


def test_openai_client_raises_on_bad_request(client):
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt="x", max_tokens=-1)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x", max_tokens=2)


def test_api_key(server):
    base = server[0]
    wrong = ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}, {"Authorization": "Basic x"})
    for headers in wrong:
        r = httpx.post(base + "/v1/completions", json={"prompt": "x", "max_tokens": 1}, headers=headers)
        assert r.status_code == 401, headers
        assert r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(base + "/v1/models").status_code == 401
    assert httpx.get(base + "/metrics").status_code == 401
    bad = openai.OpenAI(base_url=base + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    assert httpx.get(base + "/v1/models", headers=_auth()).status_code == 200


def test_disconnect_frees_the_worker(server, client):
    base = server[0]
    body = {"prompt": "go", "max_tokens": CTX - 10, "temperature": 0, "stream": True, "ignore_eos": True}
    with httpx.Client(base_url=base, headers=_auth(), timeout=30) as h, \
            h.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                break  # got the first token; hang up
    t0 = time.time()
    r = client.completions.create(model="tiny", prompt="next", max_tokens=3, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 3
    assert time.time() - t0 < 20
    deadline = time.time() + 10
    while time.time() < deadline:
        m = httpx.get(base + "/metrics", headers=_auth()).text
        if 'turbospec:request_success_total{finished_reason="abort"}' in m:
            break
        time.sleep(0.2)
    assert 'finished_reason="abort"' in m
    assert httpx.get(base + "/health").json()["running"] == 0


def test_metrics(server, client):
    r = client.completions.create(model="tiny", prompt="ab ab ab ab ab ab", max_tokens=30, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.model_extra["timings"]["draft_n"] > 0  # the n-gram drafter proposes on repetitive text
    m = httpx.get(server[0] + "/metrics", headers=_auth()).text
    for name in ("turbospec:http_requests_total", "turbospec:prompt_tokens_total",
                 "turbospec:generation_tokens_total", "turbospec:time_to_first_token_seconds_bucket",
                 "turbospec:e2e_request_latency_seconds_bucket", "turbospec:spec_decode_num_drafts_total",
                 "turbospec:spec_decode_num_draft_tokens_total",
                 "turbospec:spec_decode_num_accepted_tokens_total",
                 "turbospec:request_errors_total", "turbospec:num_requests_waiting"):
        assert name in m, name
    assert _metric(m, "turbospec:generation_tokens_total") > 0
    assert _metric(m, "turbospec:spec_decode_num_draft_tokens_total") > 0
    assert 'turbospec:spec_decode_num_accepted_tokens_per_pos_total{position="0"}' in m


def test_bench_url_measures_the_live_server(server, tmp_path):
    """`turbospec bench --url` against this real server: client-side TTFT/TPOT/ITL/e2e and acceptance."""
    import json

    from turbospec.cli.main import main

    base = server[0] + "/v1"
    out = tmp_path / "rep"
    rc = main(["bench", "--url", base, "--url", base, "--api-key", KEY, "-n", "12", "-r", "2", "--warmup", "1",
               "--categories", "code", "--out", str(out), "-q"])
    assert rc == 0
    rows = json.loads((out / "report.json").read_text())["rows"]
    assert len(rows) == 2 and all(r["engine"] == base for r in rows)  # two engines side by side
    for r in rows:
        for key in ("ttft_ms", "ttft_ms_p99", "tpot_ms", "itl_median_ms", "itl_p99_ms", "e2e_ms", "e2e_ms_p99",
                    "out_tps"):
            assert r[key] > 0, key
        assert 0.0 <= r["acc_rate"] <= 1.0  # the server reports timings.draft_n (ngram drafter)
    assert "api_key" not in json.loads((out / "report.json").read_text())["settings"]


def test_zz_shutdown(server):
    proc = server[1]
    proc.send_signal(signal.SIGINT)
    try:
        out, _ = proc.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("server did not shut down on SIGINT")
    assert proc.returncode in (0, -signal.SIGINT, 130), out[-2000:]
    assert b"Traceback" not in out, out[-2000:]


# ---- in-process (FastAPI TestClient) ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def spec_engine(tiny_model):
    from turbospec.config import EngineConfig, SpecConfig
    from turbospec.engine import Engine
    from turbospec.model import load_model
    from turbospec.speculative.ngram import PromptLookup
    from turbospec.tokenizer import Tokenizer

    model = load_model(str(tiny_model), "float32")
    return Engine(model, Tokenizer(tiny_model), EngineConfig(ctx=512, spec=SpecConfig(n_max=3)),
                  drafter=PromptLookup(1, 3))


def _app(engine, **kw):
    from turbospec.server import ServerConfig, create_app

    kw.setdefault("host", "testserver")  # TestClient's Host header: as if bound there (keyless Host check)
    return create_app(engine, ServerConfig(model_name="tiny", **kw))


def test_spec_metrics_and_timings(spec_engine):
    from fastapi.testclient import TestClient

    with TestClient(_app(spec_engine)) as c:
        r = c.post("/v1/completions", json={"prompt": "ab ab ab ab ab ab", "max_tokens": 40, "temperature": 0,
                                            "ignore_eos": True})
        assert r.status_code == 200, r.text
        t = r.json()["timings"]
        assert t["predicted_n"] == 40
        assert t["draft_n"] > 0 and 0 <= t["draft_n_accepted"] <= t["draft_n"]
        m = c.get("/metrics").text
        assert _metric(m, "turbospec:spec_decode_num_draft_tokens_total") == t["draft_n"]
        assert _metric(m, "turbospec:spec_decode_num_accepted_tokens_total") == t["draft_n_accepted"]
        assert 'turbospec:spec_decode_num_accepted_tokens_per_pos_total{position="0"}' in m


def test_engine_failure_is_500_and_server_survives(spec_engine, monkeypatch):
    from fastapi.testclient import TestClient

    with TestClient(_app(spec_engine)) as c:
        real = spec_engine.stream

        def boom(*a, **k):
            raise RuntimeError("kaboom")
            yield  # pragma: no cover

        monkeypatch.setattr(spec_engine, "stream", boom)
        r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 3})
        assert r.status_code == 500
        assert r.json()["error"]["type"] == "server_error" and "kaboom" in r.json()["error"]["message"]
        msgs = [{"role": "user", "content": "x"}]
        r = c.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 3, "stream": True})
        assert r.status_code == 200
        events = [json.loads(ln[6:]) for ln in r.text.splitlines() if ln.startswith("data: {")]
        assert "error" in events[-1] and r.text.rstrip().endswith("data: [DONE]")
        monkeypatch.setattr(spec_engine, "stream", real)
        r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 3, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


class _SlowEngine:
    """A stand-in engine whose generation blocks until released."""

    def __init__(self):
        from turbospec.engine import GenStats

        self.release = threading.Event()
        self.last_stats = GenStats()
        self.stopped = threading.Event()

    def stream(self, tokens, params, abort=None):
        from turbospec.engine import Chunk, GenStats

        self.last_stats = GenStats(prompt_tokens=len(tokens), finish_reason="length")
        try:
            for _ in range(params.max_tokens):
                self.release.wait(5)
                self.last_stats.gen_tokens += 1
                yield Chunk([65], "A")
                time.sleep(0.01)
        finally:
            self.stopped.set()


def test_bounded_queue_rejects_when_full():
    import asyncio

    from turbospec.sampling import SamplingParams
    from turbospec.server import APIError, Job, Worker
    from turbospec.server.worker import Channel

    eng = _SlowEngine()
    w = Worker(eng, max_queue=2)
    loop = asyncio.new_event_loop()
    try:
        jobs = [Job([1, 2], SamplingParams(max_tokens=2), Channel(loop), time.perf_counter() + 60)
                for _ in range(4)]
        w.submit(jobs[0])
        deadline = time.time() + 5
        while w.running == 0 and time.time() < deadline:  # job 0 taken by the worker
            time.sleep(0.01)
        w.submit(jobs[1])
        w.submit(jobs[2])
        with pytest.raises(APIError) as e:
            w.submit(jobs[3])
        assert e.value.status == 503 and e.value.code == "queue_full"
        jobs[0].cancelled.set()  # a disconnect: the worker stops between tokens and moves on
        eng.release.set()
        assert eng.stopped.wait(5)
    finally:
        w.stop()
        loop.close()


def test_queue_timeout_and_generation_deadline():
    import asyncio

    from turbospec.sampling import SamplingParams
    from turbospec.server import APIError, Job, Worker
    from turbospec.server.worker import Channel

    eng = _SlowEngine()
    eng.release.set()
    w = Worker(eng, max_queue=4)
    loop = asyncio.new_event_loop()
    try:
        late = Job([1], SamplingParams(max_tokens=5), Channel(loop), time.perf_counter() - 1)
        w.submit(late)
        item = loop.run_until_complete(asyncio.wait_for(late.channel.take(), 10))[0]
        assert item[0] == "error" and isinstance(item[1], APIError) and item[1].code == "queue_timeout"
        # a generation that runs past its deadline is cut off with finish_reason "length"
        job = Job([1], SamplingParams(max_tokens=1000), Channel(loop), time.perf_counter() + 0.3)
        w.submit(job)
        items = []
        while not items or items[-1][0] != "done":
            items += loop.run_until_complete(asyncio.wait_for(job.channel.take(), 10))
        assert items[-1][2] == "length" and 1 <= len(items) - 1 < 1000
    finally:
        w.stop()
        loop.close()
