"""Safe by default: API keys (several, from a file; empty ones refused), and without a key the checks that keep
web pages from driving a local server (Content-Type: application/json, a loopback Host), plus the warning when
binding beyond loopback without a key. In-process (FastAPI TestClient) with a tiny random model."""

import json

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")

from turbospec.cli.main import main  # noqa: E402 -- after the skips
from turbospec.errors import TurboSpecError  # noqa: E402
from turbospec.server import security  # noqa: E402

SHAPE = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
         "num_key_value_heads": 1, "head_dim": 16, "vocab_size": 300}
REQ = {"prompt": "hi", "max_tokens": 1}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from turbospec.demo import make_demo_model

    return make_demo_model(tmp_path_factory.mktemp("sec") / "tiny", **SHAPE)


@pytest.fixture(scope="module")
def engine(tiny_model):
    from turbospec.config import EngineConfig
    from turbospec.engine import Engine
    from turbospec.model import load_model
    from turbospec.tokenizer import Tokenizer

    return Engine(load_model(str(tiny_model), "float32"), Tokenizer(tiny_model), EngineConfig(ctx=128))


def _client(engine, **kw):
    from fastapi.testclient import TestClient

    from turbospec.server import ServerConfig, create_app

    return TestClient(create_app(engine, ServerConfig(model_name="tiny", **kw)), base_url="http://127.0.0.1:8080")


def _error(r, status: int, code: str) -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == code, err


# ---- pure checks -------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("header", "name"), [
    ("localhost", "localhost"), ("LocalHost:8080", "localhost"), ("127.0.0.1:80", "127.0.0.1"),
    ("[::1]:8080", "::1"), ("[::1]", "::1"), ("example.com.", "example.com"),
    ("[::1", None), ("[nothost]:80", None), ("a:b", None), ("", None), (":80", None), ("a b", None),
    ("user@evil.com", None),
])
def test_host_name(header, name):
    assert security.host_name(header) == name


@pytest.mark.parametrize(("host", "loopback"), [
    ("localhost", True), ("127.0.0.1", True), ("127.45.1.2", True), ("::1", True), ("[::1]", True),
    ("0.0.0.0", False), ("::", False), ("10.0.0.1", False), ("example.com", False), ("localhost.evil.com", False),
    ("", False),
])
def test_loopback_bind_addresses(host, loopback):
    assert security.binds_beyond_loopback(host) is not loopback


def test_match_key_checks_every_key():
    keys = (b"alpha", b"beta")
    assert security.match_key("beta", keys) == 1
    assert security.match_key("alpha", keys) == 0
    assert security.match_key("alph", keys) is None and security.match_key("", keys) is None


# ---- a keyless server --------------------------------------------------------------------------------------
def test_keyless_server_serves_json_from_loopback_hosts(engine):
    with _client(engine) as c:
        for host in ("127.0.0.1:8080", "localhost:8080", "LOCALHOST", "[::1]:8080", "127.9.8.7"):
            r = c.post("/v1/completions", json=REQ, headers={"Host": host})
            assert r.status_code == 200, (host, r.text)
        for ctype in ("application/json; charset=utf-8", "Application/JSON"):
            r = c.post("/v1/completions", content=json.dumps(REQ), headers={"Content-Type": ctype})
            assert r.status_code == 200, (ctype, r.text)
        assert c.get("/v1/models").status_code == 200


@pytest.mark.parametrize("ctype", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data",
                                   None, "application/jsonx", "text/plain; application/json"])
def test_keyless_server_refuses_bodies_not_declared_json(engine, ctype):
    headers = {"Content-Type": ctype} if ctype else {}
    with _client(engine) as c:
        r = c.post("/v1/completions", content=json.dumps(REQ), headers=headers)
        _error(r, 415, "unsupported_media_type")
        assert r.json()["error"]["type"] == "invalid_request_error"
        _error(c.post("/v1/chat/completions", content=b"{}", headers=headers), 415, "unsupported_media_type")
        assert 'turbospec:http_requests_total{code="415"' in c.get("/metrics").text


def test_keyless_server_refuses_a_form_post(engine):
    with _client(engine) as c:
        _error(c.post("/v1/completions", data={"prompt": "hi"}), 415, "unsupported_media_type")


@pytest.mark.parametrize("host", ["evil.example", "evil.example:8080", "127.0.0.1.evil.example",
                                  "localhost.evil.example:8080", "10.0.0.5:8080", "[::2]:8080", "", "[::1"])
def test_keyless_server_refuses_other_hosts(engine, host):
    with _client(engine) as c:
        _error(c.post("/v1/completions", json=REQ, headers={"Host": host}), 403, "host_not_allowed")
        _error(c.get("/v1/models", headers={"Host": host}), 403, "host_not_allowed")
        _error(c.get("/metrics", headers={"Host": host}), 403, "host_not_allowed")
        assert c.get("/health", headers={"Host": host}).status_code == 200  # health stays open


def test_keyless_server_accepts_its_bind_address_as_host(engine):
    with _client(engine, host="10.1.2.3") as c:
        assert c.post("/v1/completions", json=REQ, headers={"Host": "10.1.2.3:8080"}).status_code == 200
        _error(c.post("/v1/completions", json=REQ, headers={"Host": "10.1.2.4:8080"}), 403, "host_not_allowed")
    with _client(engine, host="::1") as c:
        assert c.get("/v1/models", headers={"Host": "[::1]:8080"}).status_code == 200


# ---- a keyed server ----------------------------------------------------------------------------------------
def test_every_configured_key_is_accepted_and_keyed_clients_skip_the_keyless_checks(engine):
    with _client(engine, api_keys=("k-one", "k-two")) as c:
        for key in ("k-one", "k-two"):
            assert c.get("/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code == 200
        for headers in ({}, {"Authorization": "Bearer k-three"}, {"Authorization": "Bearer k-one-two"},
                        {"Authorization": "Basic k-one"}):
            _error(c.post("/v1/completions", json=REQ, headers=headers), 401, "invalid_api_key")
        trusted = {"Authorization": "Bearer k-two", "Host": "my-server.lan:8080", "Content-Type": "text/plain"}
        assert c.post("/v1/completions", content=json.dumps(REQ), headers=trusted).status_code == 200
        assert c.get("/health", headers={"Host": "evil.example"}).status_code == 200


def test_key_of_names_the_key_without_revealing_it(engine):
    from starlette.requests import Request

    from turbospec.server.app import Server, ServerConfig

    server = Server(engine, ServerConfig(model_name="tiny", api_keys=("secret-a", "secret-b")))

    def req(auth: str | None) -> Request:
        headers = [(b"authorization", auth.encode())] if auth else []
        return Request({"type": "http", "method": "GET", "path": "/v1/models", "headers": headers})

    assert server.key_of(req("Bearer secret-a")) == "key0"
    assert server.key_of(req("bearer  secret-b ")) == "key1"
    assert server.key_of(req("Bearer secret-c")) is None and server.key_of(req(None)) is None
    keyless = Server(engine, ServerConfig(model_name="tiny"))
    assert keyless.key_of(req("Bearer secret-a")) is None


@pytest.mark.parametrize("keys", [("",), ("ok", ""), "a-string"])
def test_server_config_refuses_empty_keys(engine, keys):
    from turbospec.server.app import Server, ServerConfig

    with pytest.raises(TurboSpecError):
        Server(engine, ServerConfig(model_name="tiny", api_keys=keys))


# ---- the command line --------------------------------------------------------------------------------------
@pytest.fixture()
def served(monkeypatch):
    """Stands in for serving: records the app and the uvicorn settings instead of starting them."""
    from turbospec.cli import serve

    calls: list[dict] = []

    def record(http, worker, banner) -> int:
        calls.append({"app": http.config.app, "host": http.config.host, "port": http.config.port})
        worker.start()  # generation in a thread, for the TestClient (stopped by the app's lifespan)
        return 0

    monkeypatch.setattr(serve, "serve_on_main_thread", record)
    monkeypatch.delenv("TURBOSPEC_API_KEY", raising=False)
    return calls


def _serve(tiny_model, *args: str) -> int:
    return main(["serve", "-m", str(tiny_model), "-t", "1", "-c", "128", *args])


def _one_line_error(capsys, needle: str) -> None:
    err = capsys.readouterr().err
    lines = [x for x in err.strip().splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and needle in lines[0], err


@pytest.mark.parametrize(("args", "env", "needle"), [
    (["--api-key", ""], None, "--api-key"),
    (["--api-key", "   "], None, "--api-key"),
    ([], "", "TURBOSPEC_API_KEY"),
    (["--api-key", "has space"], None, "printable ASCII"),
    (["--api-key-file", "{missing}"], None, "cannot read"),
    (["--api-key-file", "{dir}"], None, "cannot read"),
    (["--api-key-file", "{blank}"], None, "holds no keys"),
    (["--api-key-file", "{binary}"], None, "cannot read"),
])
def test_empty_or_unreadable_keys_are_one_line_errors(tiny_model, served, monkeypatch, tmp_path, capsys, args,
                                                      env, needle):
    (tmp_path / "blank").write_text("\n   \n\t\n")
    (tmp_path / "binary").write_bytes(b"\xff\xfe\x00")
    paths = {"missing": tmp_path / "nope", "dir": tmp_path, "blank": tmp_path / "blank",
             "binary": tmp_path / "binary"}
    if env is not None:
        monkeypatch.setenv("TURBOSPEC_API_KEY", env)
    assert _serve(tiny_model, *[a.format(**paths) for a in args]) == 1
    _one_line_error(capsys, needle)
    assert not served  # refused before serving anything


def test_key_file_and_key_flag_are_all_accepted(tiny_model, served, monkeypatch, tmp_path, capsys):
    from fastapi.testclient import TestClient

    keys = tmp_path / "keys"
    keys.write_text("  first-key \n\nsecond-key\n")
    monkeypatch.setenv("TURBOSPEC_API_KEY", "ignored-when-a-flag-is-given")
    assert _serve(tiny_model, "--api-key-file", str(keys), "--api-key", "third-key") == 0
    assert "first-key" not in capsys.readouterr().out  # keys are never printed
    with TestClient(served[0]["app"], base_url="http://127.0.0.1:8080") as c:
        for key in ("first-key", "second-key", "third-key"):
            assert c.get("/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code == 200, key
        for key in ("ignored-when-a-flag-is-given", "first-key second-key", ""):
            assert c.get("/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code == 401, key


def test_env_key_and_an_empty_env_beside_a_flag(tiny_model, served, monkeypatch):
    from fastapi.testclient import TestClient

    monkeypatch.setenv("TURBOSPEC_API_KEY", "env-key")
    assert _serve(tiny_model) == 0
    monkeypatch.setenv("TURBOSPEC_API_KEY", "")  # set but empty: fine when a flag gives the key
    assert _serve(tiny_model, "--api-key", "flag-key") == 0
    for call, key in zip(served, ("env-key", "flag-key"), strict=True):
        with TestClient(call["app"], base_url="http://127.0.0.1:8080") as c:
            assert c.get("/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code == 200
            assert c.get("/v1/models").status_code == 401


@pytest.mark.parametrize(("args", "warned"), [
    (["--host", "0.0.0.0"], True), (["--host", "::"], True), (["--host", "192.168.1.9"], True),
    (["--host", "0.0.0.0", "--api-key", "k"], False), (["--host", "localhost"], False), ([], False),
])
def test_warning_when_serving_beyond_loopback_without_a_key(tiny_model, served, capsys, args, warned):
    assert _serve(tiny_model, *args) == 0
    err = capsys.readouterr().err
    assert ("warning:" in err and "no API key" in err) is warned, err
    assert served[0]["host"] == (args[1] if args else "127.0.0.1")


def test_keyless_cli_server_checks_hosts_against_its_bind_address(tiny_model, served):
    from fastapi.testclient import TestClient

    assert _serve(tiny_model, "--host", "192.168.1.9") == 0
    with TestClient(served[0]["app"], base_url="http://192.168.1.9:8080") as c:
        assert c.post("/v1/completions", json=REQ).status_code == 200
        _error(c.post("/v1/completions", json=REQ, headers={"Host": "rebound.example"}), 403, "host_not_allowed")
