"""Request validation at the edges (issue #24): inputs that used to reach a 500 are 400s, numbers whose effect
overflows float32 sample sanely, stop strings are capped, `-n` caps max_tokens, and every request field is
either one the endpoint implements (or accepts by design) or a 400 naming it. In-process (FastAPI TestClient)
with a tiny random model, plus a property test throwing arbitrary JSON at every field."""

import json
import math

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("httpx")
hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from turbospec.sampling import SamplingParams, apply_penalties, probs_from_logits, sample  # noqa: E402

SHAPE = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
         "num_key_value_heads": 1, "head_dim": 16, "vocab_size": 300}
CTX = 256
BASE = "http://localhost"  # a loopback Host: the keyless server's Host check lets it through
CHAT_MSGS = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from turbospec.config import EngineConfig
    from turbospec.demo import make_demo_model
    from turbospec.engine import Engine
    from turbospec.model import load_model
    from turbospec.tokenizer import Tokenizer

    path = make_demo_model(tmp_path_factory.mktemp("val") / "tiny", **SHAPE)
    return Engine(load_model(str(path), "float32"), Tokenizer(path), EngineConfig(ctx=CTX))


def _client(engine, n_predict: int = 8):
    """A TestClient on a keyless app whose -n (the default and cap of max_tokens) is `n_predict`."""
    from fastapi.testclient import TestClient

    from turbospec.server import ServerConfig, create_app

    cfg = ServerConfig(model_name="tiny", defaults=SamplingParams(max_tokens=n_predict))
    return TestClient(create_app(engine, cfg), base_url=BASE, raise_server_exceptions=False)


@pytest.fixture(scope="module")
def client(engine):
    with _client(engine) as c:
        yield c


def _post(c, path: str, body):
    if isinstance(body, bytes):
        return c.post(path, content=body, headers={"Content-Type": "application/json"})
    return c.post(path, json=body)


def _error(r) -> dict:
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    return err


def _events(r) -> list[dict]:
    return [json.loads(ln[6:]) for ln in r.text.splitlines() if ln.startswith("data: {")]


# ---- edge inputs that reached a 500 (or a bogus 400 from the sampler) -------------------------------------
EDGE = [
    # (description, path, raw body or json, expected param, expected code or None)
    ("5000-digit integer", "/v1/completions", b'{"prompt": "x", "seed": ' + b"9" * 5000 + b"}", None,
     "invalid_json"),
    ("5000-digit integer deep inside", "/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": "x"}], "metadata": {"a": [' + b"1" * 5000 + b"]}}", None,
     "invalid_json"),
    ("NaN literal", "/v1/completions", b'{"prompt": "x", "metadata": {"a": NaN}}', None, "invalid_json"),
    ("Infinity literal", "/v1/completions", b'{"prompt": "x", "seed": -Infinity}', None, "invalid_json"),
    ("lone surrogate in model", "/v1/completions", b'{"model": "\\ud800", "prompt": "x"}', "model", None),
    ("lone surrogate in chat model", "/v1/chat/completions",
     b'{"model": "a\\udfffb", "messages": [{"role": "user", "content": "x"}]}', "model", None),
    ("lone surrogate in stop", "/v1/completions", b'{"prompt": "x", "stop": ["\\udc00"]}', "stop", None),
    ("lone surrogate in a message role", "/v1/chat/completions",
     b'{"messages": [{"role": "\\ud800", "content": "x"}]}', "messages", None),
    ("lone surrogate in a field name", "/v1/completions", b'{"prompt": "x", "\\ud800": 1}', None, None),
    ("lone surrogate in user", "/v1/completions", b'{"prompt": "x", "user": "\\ud800"}', "user", None),
    ("huge integer repeat_penalty", "/v1/completions", {"prompt": "x", "repeat_penalty": 10**400},
     "repeat_penalty", None),
    ("huge integer temperature", "/v1/completions", {"prompt": "x", "temperature": 10**400}, "temperature", None),
    ("huge integer presence_penalty", "/v1/completions", {"prompt": "x", "presence_penalty": -(10**400)},
     "presence_penalty", None),
    ("repeat_penalty beyond float32", "/v1/completions", {"prompt": "x", "repeat_penalty": 1e300},
     "repeat_penalty", None),
    ("presence_penalty above 2", "/v1/completions", {"prompt": "x", "presence_penalty": 2.0000001},
     "presence_penalty", None),
    ("frequency_penalty below -2", "/v1/completions", {"prompt": "x", "frequency_penalty": -3},
     "frequency_penalty", None),
    ("seed above uint64", "/v1/completions", {"prompt": "x", "seed": 2**64}, "seed", None),
    ("seed below int64", "/v1/completions", {"prompt": "x", "seed": -(2**63) - 1}, "seed", None),
    ("max_completion_tokens zero names itself", "/v1/chat/completions",
     {"messages": CHAT_MSGS, "max_completion_tokens": 0}, "max_completion_tokens", None),
    ("stop string too long", "/v1/completions", {"prompt": "x", "stop": ["a" * 257]}, "stop", None),
    ("one long stop string", "/v1/completions", {"prompt": "x", "stop": "b" * 60000}, "stop", None),
    ("too many stop strings", "/v1/completions", {"prompt": "x", "stop": [str(i) for i in range(17)]}, "stop",
     None),
]


@pytest.mark.parametrize("desc,path,body,param,code", EDGE, ids=[e[0] for e in EDGE])
def test_edge_inputs_are_400(client, desc, path, body, param, code):
    r = _post(client, path, body)
    assert r.status_code == 400, (desc, r.status_code, r.text[:300])
    err = _error(r)
    assert err["type"] == "invalid_request_error"
    assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    assert len(err["message"]) < 500, err  # a huge number is not echoed in full


LIMITS = [
    # (the last value accepted, the first refused)
    ({"seed": 2**64 - 1}, {"seed": 2**64}),
    ({"seed": -(2**63)}, {"seed": -(2**63) - 1}),
    ({"presence_penalty": 2, "frequency_penalty": -2}, {"presence_penalty": 2.001}),
    ({"stop": ["a" * 256] * 16}, {"stop": ["a" * 257]}),
    ({"stop": ["a"] * 16}, {"stop": ["a"] * 17}),
    ({"repeat_penalty": 3.4e38}, {"repeat_penalty": 3.5e38}),
    ({"repeat_penalty": 5e-324}, {"repeat_penalty": 0}),
    ({"temperature": 2}, {"temperature": 2.0000001}),
    ({"top_p": 1e-300}, {"top_p": 0}),
    ({"min_p": 1}, {"min_p": 1.01}),
    ({"top_k": 10**30}, {"top_k": -1}),
    ({"repeat_last_n": -1}, {"repeat_last_n": -2}),
]


def test_limits(client):
    """At each documented limit the last accepted value generates and the first beyond it is a 400 naming it."""
    for ok, refused in LIMITS:
        r = _post(client, "/v1/completions", {"prompt": "x x x", "max_tokens": 3, **ok})
        assert r.status_code == 200, (ok, r.text[:300])
        r = _post(client, "/v1/completions", {"prompt": "x x x", "max_tokens": 3, **refused})
        assert r.status_code == 400, (refused, r.text[:300])
        assert _error(r)["param"] in refused, (refused, r.text[:300])


def test_tiny_temperature_is_greedy_not_an_overflow(client):
    """temperature 1e-40 divides the logits past float32's range; it now samples the argmax (as temperature 0
    does) instead of failing with an all-NaN distribution, streamed or not."""
    base = {"prompt": "the cat sat on", "max_tokens": 8, "ignore_eos": True, "top_k": 0, "top_p": 1.0,
            "min_p": 0.0}
    greedy = _post(client, "/v1/completions", {**base, "temperature": 0})
    assert greedy.status_code == 200, greedy.text
    for t in (1e-40, 1e-300, 5e-324):
        r = _post(client, "/v1/completions", {**base, "temperature": t, "seed": 7})
        assert r.status_code == 200, (t, r.text)
        assert r.json()["choices"][0]["text"] == greedy.json()["choices"][0]["text"], t
    r = _post(client, "/v1/completions", {**base, "temperature": 1e-40, "stream": True})
    events = _events(r)
    assert r.status_code == 200 and not any("error" in e for e in events), r.text[:500]
    assert "".join(e["choices"][0]["text"] for e in events if e.get("choices")) == \
        greedy.json()["choices"][0]["text"]


def test_extreme_repeat_penalty_samples(client):
    """repeat_penalty 1e-300 rounds to 0 in float32 (a division by zero); the penalised logits stay finite, so
    sampling works and the repeated tokens are (by far) the most likely."""
    for p in (1e-300, 1e-45, 3.4e38):
        for temp in (0.8, 0):
            r = _post(client, "/v1/completions", {"prompt": "ab ab ab ab", "max_tokens": 6, "ignore_eos": True,
                                                  "temperature": temp, "repeat_penalty": p, "seed": 1})
            assert r.status_code == 200, (p, temp, r.text)
            assert r.json()["usage"]["completion_tokens"] == 6


# ---- the sampler itself ---------------------------------------------------------------------------------
def test_sampler_tiny_temperature_is_the_argmax():
    logits = torch.tensor([1.0, 3.0, -2.0, 2.999, -math.inf])
    for t in (1e-10, 1e-40, 1e-50, 5e-324):
        params = SamplingParams(temperature=t, top_k=0, top_p=1.0, min_p=0.0)
        probs = probs_from_logits(logits, params)
        assert torch.equal(probs, torch.tensor([0.0, 1.0, 0.0, 0.0, 0.0])), (t, probs)
        assert sample(logits, params, torch.Generator().manual_seed(0)) == 1
    tied = probs_from_logits(torch.tensor([3.0, 1.0, 3.0]), SamplingParams(temperature=1e-40, top_k=0,
                                                                             top_p=1.0, min_p=0.0))
    assert torch.equal(tied, torch.tensor([0.5, 0.0, 0.5]))  # the max logits share the probability
    # ordinary temperatures are unchanged
    p = probs_from_logits(torch.log(torch.tensor([0.5, 0.25, 0.25])), SamplingParams(temperature=0.5, top_k=0,
                                                                                     top_p=1.0, min_p=0.0))
    torch.testing.assert_close(p, torch.tensor([2 / 3, 1 / 6, 1 / 6]))


def test_sampler_extreme_penalties_stay_finite():
    logits = torch.tensor([2.0, -1.0, 0.0, 1.0, -math.inf])
    recent = torch.tensor([0, 1, 2])
    for rp in (1e-300, 1e-45, 3.4e38):
        out = apply_penalties(logits, recent, SamplingParams(repeat_penalty=rp))
        assert not torch.isnan(out).any() and not torch.isposinf(out).any(), (rp, out)
        assert out[4] == -math.inf  # a banned token stays banned
        probs = probs_from_logits(out, SamplingParams(temperature=0.8))
        assert torch.isfinite(probs).all() and abs(float(probs.sum()) - 1) < 1e-5, (rp, probs)
    for name in ("repeat_penalty", "presence_penalty", "frequency_penalty", "temperature"):
        with pytest.raises(ValueError, match=name):
            SamplingParams(**{name: 1e300})


# ---- -n / --n-predict caps max_tokens ---------------------------------------------------------------------
def test_n_predict_caps_max_tokens(engine):
    comp = {"prompt": "hello there", "temperature": 0, "ignore_eos": True}
    chat = {"messages": CHAT_MSGS, "temperature": 0, "ignore_eos": True}
    with _client(engine, n_predict=5) as c:
        for body, path in ((comp, "/v1/completions"), (chat, "/v1/chat/completions")):
            for extra, want in (({"max_tokens": 50}, 5), ({}, 5), ({"max_tokens": 3}, 3),
                                ({"max_tokens": 10**30}, 5), ({"n_predict": 40}, 5), ({"n_predict": -1}, 5)):
                r = _post(c, path, {**body, **extra})
                assert r.status_code == 200, (path, extra, r.text)
                j = r.json()
                assert j["usage"]["completion_tokens"] == want, (path, extra, j["usage"])
                assert j["choices"][0]["finish_reason"] == "length"
        r = _post(c, "/v1/chat/completions", {**chat, "max_completion_tokens": 99, "max_tokens": 2})
        assert r.json()["usage"]["completion_tokens"] == 5  # max_completion_tokens wins, then the cap
        r = _post(c, "/v1/completions", {**comp, "max_tokens": 50, "stream": True,
                                         "stream_options": {"include_usage": True}})
        assert _events(r)[-1]["usage"]["completion_tokens"] == 5
        assert c.get("/v1/models").json()["data"][0]["meta"]["max_tokens"] == 5
    with _client(engine, n_predict=0) as c:  # -n 0 / -1: no cap beyond the context
        r = _post(c, "/v1/completions", {**comp, "max_tokens": 50})
        assert r.json()["usage"]["completion_tokens"] == 50
        r = _post(c, "/v1/completions", {**comp, "max_tokens": 10**30})
        assert r.status_code == 400 and _error(r)["code"] == "context_length_exceeded"
        r = _post(c, "/v1/completions", {"prompt": [1, 2, 3], "temperature": 0, "ignore_eos": True})
        assert r.json()["usage"]["completion_tokens"] == CTX - 3  # the room left in the context
        assert c.get("/v1/models").json()["data"][0]["meta"]["max_tokens"] is None


def test_serve_n_minus_one_means_no_cap(monkeypatch):
    """`turbospec serve -n -1` (llama.cpp's "no limit") starts, with no cap beyond the context."""
    import turbospec.cli.serve as serve
    import turbospec.server.app as app_mod
    from turbospec.cli.main import main

    seen = {}

    class _Engine:
        model_path = "/models/tiny"
        ctx = 256

    monkeypatch.delenv("TURBOSPEC_API_KEY", raising=False)
    monkeypatch.setattr(serve, "build_engine", lambda cfg, progress=None: _Engine())
    def create_app(engine, cfg, **kw):
        seen.update(cfg=cfg)
        app = app_mod.FastAPI()
        app.state.worker = None
        return app

    monkeypatch.setattr(app_mod, "create_app", create_app)
    monkeypatch.setattr(serve, "serve_on_main_thread", lambda http, worker, banner: 0)
    assert main(["serve", "-m", "/models/tiny", "-n", "-1"]) == 0
    assert seen["cfg"].defaults.max_tokens == 0
    assert main(["serve", "-m", "/models/tiny", "-n", "7"]) == 0
    assert seen["cfg"].defaults.max_tokens == 7


# ---- honour or reject every field -------------------------------------------------------------------------
REJECTED = [
    # (path, extra fields, param, code)
    ("/v1/completions", {"foo": 1}, "foo", "unknown_parameter"),
    ("/v1/completions", {"messages": CHAT_MSGS}, "messages", "unknown_parameter"),
    ("/v1/completions", {"max_completion_tokens": 3}, "max_completion_tokens", "unknown_parameter"),
    ("/v1/completions", {"response_format": {"type": "text"}}, "response_format", "unknown_parameter"),
    ("/v1/completions", {"tools": []}, "tools", "unknown_parameter"),
    ("/v1/chat/completions", {"prompt": "x"}, "prompt", "unknown_parameter"),
    ("/v1/chat/completions", {"echo": True}, "echo", "unknown_parameter"),
    ("/v1/chat/completions", {"suffix": ""}, "suffix", "unknown_parameter"),
    ("/v1/chat/completions", {"functions": []}, "functions", "unknown_parameter"),
    ("/v1/chat/completions", {"audio": {}}, "audio", "unknown_parameter"),
    ("/v1/chat/completions", {"reasoning_effort": "low"}, "reasoning_effort", "unknown_parameter"),
    ("/v1/chat/completions", {"response_format": {"type": "json_object"}}, "response_format",
     "unsupported_value"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {}}}, "response_format",
     "unsupported_value"),
    ("/v1/chat/completions", {"response_format": {"type": "text", "x": 1}}, "response_format",
     "unsupported_value"),
    ("/v1/chat/completions", {"response_format": "text"}, "response_format", "invalid_type"),
    ("/v1/completions", {"suffix": "tail"}, "suffix", "unsupported_value"),
    ("/v1/completions", {"suffix": 3}, "suffix", "invalid_type"),
    ("/v1/completions", {"store": True}, "store", "unsupported_value"),
    ("/v1/completions", {"store": "no"}, "store", "invalid_type"),
    ("/v1/completions", {"user": 5}, "user", "invalid_type"),
    ("/v1/completions", {"metadata": [1]}, "metadata", "invalid_type"),
    ("/v1/completions", {"metadata": {"a": 1}}, "metadata", "invalid_type"),
    ("/v1/completions", {"stream": True, "stream_options": {"include_usage": True, "extra": 1}},
     "stream_options.extra", "unknown_parameter"),
    ("/v1/completions", {"stream_options": {"include_usage": "yes"}}, "stream_options.include_usage",
     "invalid_type"),
    ("/v1/completions", {"n_predict": 0}, "n_predict", None),
    ("/v1/completions", {"n_predict": "5"}, "n_predict", "invalid_type"),
    ("/v1/completions", {"repeat_last_n": -2}, "repeat_last_n", None),
    ("/v1/completions", {"ignore_eos": 1}, "ignore_eos", "invalid_type"),
]


@pytest.mark.parametrize("path,extra,param,code", REJECTED, ids=[f"{r[0][4:]}-{r[2]}" for r in REJECTED])
def test_unimplemented_fields_are_rejected(client, path, extra, param, code):
    base = {"messages": CHAT_MSGS} if "chat" in path else {"prompt": "x"}
    r = _post(client, path, {**base, "max_tokens": 2, **extra})
    assert r.status_code == 400, (extra, r.status_code, r.text[:300])
    err = _error(r)
    assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err


def test_accepted_fields(client):
    """The fields accepted by design (they do not change the output) and the llama.cpp extensions are a 200;
    the same body with one unknown field more is a 400 naming it."""
    for path, base in (("/v1/completions", {"prompt": "x"}), ("/v1/chat/completions", {"messages": CHAT_MSGS})):
        for extra in ({"user": "u-1"}, {"user": None}, {"metadata": {"k": "v"}}, {"metadata": None},
                      {"store": False}, {"store": None}, {"stream_options": {"include_usage": False}},
                      {"stream_options": None}, {"n": 1, "best_of": 1}, {"top_k": 5, "min_p": 0.1},
                      {"repeat_penalty": 1.1, "repeat_last_n": 8}, {"repeat_last_n": -1},
                      {"repeat_last_n": 10**9}, {"ignore_eos": False}, {"seed": 3}, {"model": "tiny"},
                      {"n_predict": 2}):
            r = _post(client, path, {**base, "max_tokens": 2, **extra})
            assert r.status_code == 200, (path, extra, r.text[:300])
            r = _post(client, path, {**base, "max_tokens": 2, **extra, "x_extra": 1})
            assert r.status_code == 400 and _error(r)["param"] == "x_extra", (path, extra, r.text[:300])
    r = _post(client, "/v1/chat/completions", {"messages": CHAT_MSGS, "max_completion_tokens": 2,
                                               "response_format": {"type": "text"}})
    assert r.status_code == 200, r.text
    for suffix in (None, ""):
        r = _post(client, "/v1/completions", {"prompt": "x", "max_tokens": 2, "suffix": suffix})
        assert r.status_code == 200, r.text


def test_fields_other_parts_implement_are_known(client):
    """logprobs, echo, logit_bias and the tool fields are implemented elsewhere: never an unknown parameter."""
    for path, names in (("/v1/completions", ("logprobs", "echo", "logit_bias", "best_of")),
                        ("/v1/chat/completions", ("logprobs", "top_logprobs", "logit_bias", "tools",
                                                  "tool_choice", "parallel_tool_calls"))):
        base = {"messages": CHAT_MSGS} if "chat" in path else {"prompt": "x"}
        for name in names:
            r = _post(client, path, {**base, "max_tokens": 1, name: {"not": "valid"}})
            assert r.status_code < 500, (path, name, r.text[:300])
            if r.status_code >= 400:
                assert _error(r)["code"] != "unknown_parameter", (path, name)
        r = _post(client, path, {**base, "max_tokens": 1, "logprobz": {"not": "valid"}})
        assert r.status_code == 400 and _error(r)["code"] == "unknown_parameter", r.text[:300]


def test_repeat_last_n_is_honoured(client):
    """repeat_last_n (llama.cpp) reaches the sampler: with a penalty window of 0 a huge repeat_penalty does
    nothing, with the whole context it changes the greedy output."""
    base = {"prompt": "ab ab ab ab ab ab", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    plain = _post(client, "/v1/completions", base).json()["choices"][0]["text"]
    off = _post(client, "/v1/completions", {**base, "repeat_penalty": 1e30, "repeat_last_n": 0})
    assert off.json()["choices"][0]["text"] == plain
    on = _post(client, "/v1/completions", {**base, "repeat_penalty": 1e30, "repeat_last_n": -1})
    assert on.json()["choices"][0]["text"] != plain


# ---- arbitrary JSON in any field is never a 5xx ---------------------------------------------------------
FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "n_predict", "temperature",
          "top_p", "top_k", "min_p", "seed", "stop", "stream", "stream_options", "presence_penalty",
          "frequency_penalty", "repeat_penalty", "repeat_last_n", "ignore_eos", "n", "best_of", "user",
          "metadata", "store", "response_format", "suffix", "logprobs", "top_logprobs", "echo", "logit_bias",
          "tools", "tool_choice", "parallel_tool_calls", "unknown_field"]
NASTY = [None, True, 0, -1, 2**64, -(2**63) - 1, 10**400, -(10**400), 0.5, 1e-40, 5e-324, 1e300,
         float("nan"), float("inf"), "", "\ud800", "a" * 300, [], [None], ["\udfff"], {}, {"\ud800": 1},
         {"type": "text"}, [[1, 2]], [{"role": "user"}]]


def test_nasty_values_in_every_field(client):
    """Every field of both endpoints, each with each of a list of edge values: a 2xx or an OpenAI-style 4xx."""
    for path, base in (("/v1/completions", {"prompt": "x"}), ("/v1/chat/completions", {"messages": CHAT_MSGS})):
        for name in FIELDS:
            for value in NASTY:
                body = json.dumps({**base, "max_tokens": 2, name: value}).encode()
                r = _post(client, path, body)
                assert r.status_code < 500, (path, name, value, r.status_code, r.text[:300])
                if r.status_code >= 400:
                    _error(r)


_scalars = (st.none() | st.booleans() | st.integers() | st.integers(min_value=-(2**70), max_value=2**70)
            | st.floats() | st.sampled_from([0, 1, -1, 2, 1e-40, 1e-300, 5e-324, 1e300, 2**63, 2**64, 10**400])
            | st.text(max_size=8) | st.sampled_from(["\ud800", "a\udfffb", "tiny", "text", "auto", "none"]))
_json = st.recursive(_scalars, lambda kids: st.lists(kids, max_size=4)
                     | st.dictionaries(st.text(max_size=6) | st.sampled_from(["type", "text", "role", "content",
                                                                                "include_usage", "\ud800"]),
                                       kids, max_size=4), max_leaves=8)


@settings(max_examples=500, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(chat=st.booleans(),
       fields=st.dictionaries(st.sampled_from(FIELDS), st.sampled_from(NASTY) | _json, min_size=1, max_size=3))
def test_any_json_in_any_field_is_never_a_5xx(client, chat, fields):
    base = {"messages": CHAT_MSGS} if chat else {"prompt": "x"}
    body = json.dumps({**base, "max_tokens": 2, **fields}).encode()  # NaN / Infinity / \ud800 kept as written
    r = _post(client, "/v1/chat/completions" if chat else "/v1/completions", body)
    assert r.status_code < 500, (fields, r.status_code, r.text[:500])
    if r.status_code >= 400:
        _error(r)
    elif r.headers["content-type"].startswith("text/event-stream"):
        errors = [e for e in _events(r) if "error" in e]
        assert not errors, (fields, errors)
