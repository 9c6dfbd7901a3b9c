"""Bounded work over real HTTP: a full queue is refused before the body is read, a body that does not arrive in time
gets 408, one API key cannot hold more than its share, and the in-flight limit answers in OpenAI JSON."""

import json
import socket

import pytest

from tests.test_server_cancel import PacedEngine, body, live, settle

httpx = pytest.importorskip("httpx")


def raw_request(base: str, head_only_len: int | None = None, payload: bytes = b"", timeout: float = 60) -> tuple:
    """Send a POST by hand: the headers (declaring `head_only_len` bytes when given) and `payload`; return the
    status, headers and JSON body of the answer."""
    port = int(base.rsplit(":", 1)[1])
    length = len(payload) if head_only_len is None else head_only_len
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n" % length + payload)
        data = b""
        while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < _length(data):
            part = s.recv(65536)
            if not part:
                break
            data += part
    head, _, rest = data.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), {k.lower(): v for k, v in headers.items()}, json.loads(rest)


def _length(data: bytes) -> int:
    for line in data.split(b"\r\n\r\n", 1)[0].split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return int(line.split(b":")[1])
    return 1 << 30


def test_full_queue_is_refused_before_the_body_is_read():
    eng = PacedEngine()
    with live(eng, max_queue=1, body_timeout=3600) as base:
        with httpx.Client(timeout=30) as h, h.stream("POST", base + "/v1/completions", json=body(True)) as running:
            lines = running.iter_lines()
            next(lines)
            with h.stream("POST", base + "/v1/completions", json=body(True)) as queued:
                assert queued.status_code == 200
                # a third request declares a body it never sends: answered at once, not after the body timeout
                status, headers, err = raw_request(base, head_only_len=5000)
                assert status == 503 and err["error"]["code"] == "queue_full" and headers["retry-after"] == "1"
        assert settle(base)["running"] == 0


def test_body_not_received_in_time_is_408():
    with live(PacedEngine(), body_timeout=0.3) as base:
        status, _, err = raw_request(base, head_only_len=100, payload=b'{"prompt": [1,')
        assert status == 408 and err["error"]["code"] == "request_timeout"
        assert settle(base) == {"status": "ok", "running": 0, "waiting": 0}


def test_one_api_key_cannot_hold_more_than_its_limit():
    eng = PacedEngine()
    k1, k2 = {"Authorization": "Bearer one"}, {"Authorization": "Bearer two"}
    with live(eng, api_keys=("one", "two"), max_per_key=1) as base:
        with httpx.Client(timeout=30) as h, \
                h.stream("POST", base + "/v1/completions", json=body(True), headers=k1) as first:
            lines = first.iter_lines()
            next(lines)
            r = h.post(base + "/v1/completions", json=body(), headers=k1)
            assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error"
            with h.stream("POST", base + "/v1/completions", json=body(True), headers=k2) as other:
                assert other.status_code == 200  # another key is not limited by the first one's use
        assert settle(base)["running"] == 0
        r = httpx.post(base + "/v1/completions", json=body(n=2), headers=k1, timeout=30)
        assert r.status_code == 200  # the stream that ended gave its slot back
    with live(eng, api_keys=("one",), max_per_key=1) as base:  # the slot is free again once a reply is over
        for _ in range(3):
            r = httpx.post(base + "/v1/completions", json=body(n=2), headers=k1, timeout=30)
            assert r.status_code == 200


def test_past_the_connection_limit_the_answer_is_openai_json():
    eng = PacedEngine()
    with live(eng, max_connections=2) as base, httpx.Client(timeout=30) as h, \
            h.stream("POST", base + "/v1/completions", json=body(True)) as a:
        lines = a.iter_lines()
        next(lines)
        with h.stream("POST", base + "/v1/completions", json=body(True)) as b:
            assert b.status_code == 200
            r = httpx.post(base + "/v1/completions", json=body(n=2), timeout=30)
            assert r.status_code == 503 and r.json()["error"]["code"] == "too_many_connections"
            assert r.headers["content-type"] == "application/json"


def test_cache_prompt_false_prefills_everything(tmp_path):
    """llama-server's `cache_prompt`: a repeated prompt reuses the cached prefix (timings.cache_n) unless the
    request says false; prompt_n + cache_n is always the prompt's length."""
    from fastapi.testclient import TestClient

    from turbospec.config import EngineConfig
    from turbospec.demo import make_demo_model
    from turbospec.engine import Engine
    from turbospec.model import load_model
    from turbospec.server import ServerConfig, create_app

    path = make_demo_model(tmp_path / "m", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=2, num_key_value_heads=1, head_dim=16, vocab_size=300)
    eng = Engine(load_model(str(path), "float32"), None, EngineConfig(ctx=256))
    prompt = list(range(5, 60))
    with TestClient(create_app(eng, ServerConfig(model_name="m")), base_url="http://127.0.0.1") as c:
        seen = []
        for cache in (None, None, False, True):
            req = {"prompt": prompt, "max_tokens": 2, **({} if cache is None else {"cache_prompt": cache})}
            t = c.post("/v1/completions", json=req).json()["timings"]
            assert t["prompt_n"] + t["cache_n"] == len(prompt)
            seen.append(t["cache_n"])
        assert seen[0] == 0 and seen[1] > 0 and seen[2] == 0 and seen[3] > 0
        r = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2, "cache_prompt": "yes"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "cache_prompt"


def test_the_default_body_limit_fits_a_prompt_that_fills_the_context():
    """`serve`'s default --max-body-bytes grows with -c: a 262144-token prompt fits as token ids (the largest ids of
    a 152K vocabulary) and as escaped CJK text (about 1.4 characters a token); a small context keeps 1 MiB."""
    from turbospec.cli.main import build_parser
    from turbospec.server import DEFAULT_MAX_BODY, body_limit

    ctx = 262144
    ids = json.dumps({"prompt": [151935] * ctx, "max_tokens": 1}).encode()
    chat = json.dumps({"messages": [{"role": "user", "content": "中" * (ctx * 7 // 5)}]}).encode()
    assert len(ids) > DEFAULT_MAX_BODY and len(chat) > DEFAULT_MAX_BODY
    assert max(len(ids), len(chat)) <= body_limit(ctx)
    assert body_limit(4096) == DEFAULT_MAX_BODY
    assert build_parser().parse_args(["serve"]).max_body_bytes is None  # resolved from the engine's context
