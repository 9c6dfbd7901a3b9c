"""logprobs / top_logprobs, logit_bias, echo with prompt logprobs: the engine's values against a direct
log_softmax of the model's logits (plain decoding and with drafters whose drafts get accepted), and the
OpenAI wire format through the server (FastAPI TestClient)."""

from __future__ import annotations

import json

import pytest
import torch

from tests.test_spec import SHAPE, peaked_target
from turbospec.config import EngineConfig, SpecConfig
from turbospec.engine import Engine
from turbospec.errors import TurboSpecError
from turbospec.kv.plan import AttentionPlan
from turbospec.model import load_model
from turbospec.sampling import SamplingParams, apply_penalties
from turbospec.speculative import make_drafter

VOCAB = SHAPE["vocab_size"]
# repetitive prompts: the n-gram drafter fires on them, and the peaked random target repeats itself
PROMPTS = [[(7 * i + j) % VOCAB for j in range(10)] * 3 for i in range(3)] + [
    [(i * i + 3 * j) % VOCAB for j in range(17)] for i in range(2)]
SPECS = [None, "ngram", "draft-mtp", "draft-model:self"]


@pytest.fixture(scope="module")
def target_path(tmp_path_factory):
    return peaked_target(tmp_path_factory.mktemp("lp") / "target")


@pytest.fixture(scope="module")
def target(target_path):
    return load_model(target_path, "float32")


def make_engine(target, target_path, spec: str | None, **cfg) -> Engine:
    if spec is None:
        return Engine(target, None, EngineConfig(ctx=256, ubatch=8, **cfg))
    sc = SpecConfig.parse(spec.split(":")[0], n_max=4, draft_model=str(target_path))
    return Engine(target, None, EngineConfig(ctx=256, ubatch=8, spec=SpecConfig(n_max=4), **cfg),
                  drafter=make_drafter(sc, target, 260))


def direct_logits(model, tokens: list[int]) -> torch.Tensor:
    """float32 logits [len(tokens), V] from one causal forward over `tokens` in a fresh cache."""
    cache = model.new_cache(len(tokens) + 1)
    hidden = model.forward(torch.tensor(tokens, dtype=torch.int64), AttentionPlan.causal(0, len(tokens)), cache)
    return model.logits(hidden)


def expected_logprobs(model, prompt: list[int], out: list[int], params: SamplingParams) -> torch.Tensor:
    """log_softmax of the logits each output token was drawn from: bias, then the penalties of the window."""
    logits = direct_logits(model, prompt + out[:-1])[len(prompt) - 1:]
    rows = []
    for i, row in enumerate(logits):
        row = row.clone()
        for t, b in params.logit_bias.items():
            row[t] += b
        row = apply_penalties(row, torch.tensor(prompt + out[:i]), params)
        rows.append(torch.log_softmax(row, -1))
    return torch.stack(rows)


def run(engine: Engine, prompt, params: SamplingParams):
    toks, lps = [], []
    for ch in engine.stream(prompt, params):
        toks += ch.tokens
        if ch.tokens:
            assert ch.logprobs is not None and len(ch.logprobs) == len(ch.tokens)
            lps += ch.logprobs
    return toks, lps


def check(model, prompt, toks, lps, params, k):
    want = expected_logprobs(model, prompt, toks, params)
    assert [e.token for e in lps] == toks
    for i, e in enumerate(lps):
        assert e.logprob == pytest.approx(float(want[i, toks[i]]), abs=1e-4), (i, toks)
        assert len(e.top) == k
        top_ids = [t for t, _ in e.top]
        vals = torch.tensor([v for _, v in e.top])
        assert torch.allclose(vals, want[i, top_ids], atol=1e-4)
        assert torch.allclose(vals, want[i].topk(k).values, atol=1e-4)  # the k largest, in order


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_logprobs_equal_direct_log_softmax(target, target_path, spec, temperature):
    eng = make_engine(target, target_path, spec)
    k = 4
    params = SamplingParams(temperature=temperature, max_tokens=24, ignore_eos=True, logprobs=k, seed=5,
                            logit_bias={3: 2.5, 10: -1.0}, presence_penalty=0.2, frequency_penalty=0.1,
                            repeat_last_n=16)
    accepted = 0
    for prompt in PROMPTS:
        toks, lps = run(eng, prompt, params)
        assert len(toks) == 24
        check(target, prompt, toks, lps, params, k)
        if spec is not None:
            accepted += eng.last_stats.spec.accepted
    if spec in ("ngram", "draft-model:self"):
        assert accepted > 0  # the values above include tokens accepted from drafts


def test_logprobs_zero_gives_only_the_chosen_token(target, target_path):
    eng = make_engine(target, target_path, None)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=0)
    toks, lps = run(eng, PROMPTS[0], params)
    check(target, PROMPTS[0], toks, lps, params, 0)
    off = list(eng.stream(PROMPTS[0], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)))
    assert all(ch.logprobs is None for ch in off)


@pytest.mark.parametrize("spec", SPECS)
def test_logit_bias_steers_greedy_output_and_speculation_stays_lossless(target, target_path, spec):
    plain = make_engine(target, target_path, None)
    eng = make_engine(target, target_path, spec)
    base = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    for prompt in PROMPTS:
        free = plain.generate([prompt], base)[0]["tokens"]
        banned = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logit_bias={free[0]: -100.0})
        out = plain.generate([prompt], banned)[0]["tokens"]
        assert out[0] != free[0] and free[0] not in out
        forced = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logit_bias={17: 100.0})
        assert plain.generate([prompt], forced)[0]["tokens"] == [17] * 20
        for p in (banned, forced):
            assert eng.generate([prompt], p)[0]["tokens"] == plain.generate([prompt], p)[0]["tokens"], spec


def test_bad_logit_bias_and_logprobs_are_rejected(target, target_path):
    with pytest.raises(ValueError, match="logit_bias keys"):
        SamplingParams(logit_bias={-1: 1.0})
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={1: float("nan")})
    for k in (-1, 21, 1.5, True):
        with pytest.raises(ValueError, match="logprobs"):
            SamplingParams(logprobs=k)
    eng = make_engine(target, target_path, None)
    with pytest.raises(TurboSpecError, match="outside the vocabulary"):
        next(eng.stream(PROMPTS[0], SamplingParams(logit_bias={VOCAB: 1.0})))


@pytest.mark.parametrize("spec", [None, "draft-mtp"])
def test_prompt_logprobs_cover_every_prompt_row(target, target_path, spec):
    eng = make_engine(target, target_path, spec)  # prefix cache on: the rows must still all be computed
    prompt = PROMPTS[0] + [(5 * j + 1) % VOCAB for j in range(120)]  # rows in several slices of logits
    k = 3
    for max_tokens in (0, 0, 6):  # the second run would reuse the whole cached prefix
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, prompt_logprobs=k)
        chunks = list(eng.stream(prompt, params))
        first = chunks[0]
        assert first.tokens == [] and first.prompt_logprobs is not None
        plp = first.prompt_logprobs
        assert len(plp) == len(prompt) and plp[0] is None
        want = torch.log_softmax(direct_logits(target, prompt), -1)
        for i, e in enumerate(plp[1:]):
            assert e.token == prompt[i + 1]
            assert e.logprob == pytest.approx(float(want[i, prompt[i + 1]]), abs=1e-4)
            assert [t for t, _ in e.top] == want[i].topk(k).indices.tolist()
        gen = [t for ch in chunks for t in ch.tokens]
        assert len(gen) == max_tokens and eng.last_stats.gen_tokens == max_tokens
        assert eng.last_stats.finish_reason == "length"
    # generation after a prompt-logprobs prefill is the same as without it
    assert gen == eng.generate([prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0]["tokens"]


def test_verify_records_logprobs_on_the_rows_tokens_are_chosen_at():
    """Rejection sampling against draft distributions q (the lossless path): each emitted token, accepted or
    resampled, gets the log_softmax of its row with the bias applied."""
    from turbospec.sampling import Sampler
    from turbospec.speculative.tree import DraftTree
    from turbospec.speculative.verify import verify

    g = torch.Generator().manual_seed(0)
    vocab, n = 12, 3
    seen_reject = seen_accept = False
    for seed in range(40):
        logits = torch.randn(n + 1, vocab, generator=g)
        q = [torch.softmax(torch.randn(vocab, generator=g), -1) for _ in range(n)]
        draft = [int(torch.multinomial(qi, 1, generator=g)) for qi in q]
        params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, repeat_last_n=0, seed=seed,
                                logprobs=2, logit_bias={1: 3.0})
        sampler = Sampler(params)
        path, nxt = verify(DraftTree.chain(draft, list(q)), logits, sampler)
        got = sampler.take_logprobs()
        emitted = [draft[i] for i in path] + [nxt]
        assert [e.token for e in got] == emitted
        biased = logits.clone()
        biased[:, 1] += 3.0
        want = torch.log_softmax(biased, -1)
        for row, e in enumerate(got):  # a chain: the j-th emitted token comes from row j
            assert e.logprob == pytest.approx(float(want[row, e.token]), abs=1e-5)
            assert [t for t, _ in e.top] == want[row].topk(2).indices.tolist()
        seen_accept |= len(path) > 0
        seen_reject |= len(path) < n
    assert seen_accept and seen_reject


# ---- through the server (FastAPI TestClient) --------------------------------------------------------------
CHAT_SHAPE = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
              "num_key_value_heads": 1, "head_dim": 16, "vocab_size": 300}


def client(engine):
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from turbospec.server import ServerConfig, create_app

    # host: TestClient's Host header, as if bound there (the keyless Host check)
    return TestClient(create_app(engine, ServerConfig(model_name="tiny", host="testserver")))


@pytest.fixture(scope="module")
def spec_server(target, target_path):
    """Completions with token-id prompts on the peaked target (vocab 64), n-gram drafts accepted."""
    from turbospec.speculative.ngram import PromptLookup
    from turbospec.tokenizer import Tokenizer

    eng = Engine(target, Tokenizer(target_path), EngineConfig(ctx=256, ubatch=8, spec=SpecConfig(n_max=4)),
                 drafter=PromptLookup(1, 4))
    with client(eng) as c:
        yield c, eng


@pytest.fixture(scope="module")
def chat_server(tmp_path_factory):
    from turbospec.demo import make_demo_model
    from turbospec.tokenizer import Tokenizer

    path = make_demo_model(tmp_path_factory.mktemp("lpchat") / "tiny", **CHAT_SHAPE)
    eng = Engine(load_model(str(path), "float32"), Tokenizer(path), EngineConfig(ctx=256))
    with client(eng) as c:
        yield c, eng


def sse_events(r) -> list[dict]:
    assert r.status_code == 200, r.text
    return [json.loads(ln[6:]) for ln in r.text.splitlines() if ln.startswith("data: {")]


def test_completions_logprobs_over_http_equal_the_engine_values(spec_server, target):
    c, eng = spec_server
    prompt = PROMPTS[0]
    body = {"prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True, "logprobs": 3}
    r = c.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    res = r.json()
    assert res["timings"]["draft_n_accepted"] > 0  # the values below include accepted drafts
    lp = res["choices"][0]["logprobs"]
    out = eng.generate([prompt], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0]["tokens"]
    want = expected_logprobs(target, prompt, out, SamplingParams(temperature=0))
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 16
    assert lp["tokens"] == [eng.tokenizer.decode([t], False) for t in out]
    assert lp["token_logprobs"] == pytest.approx([float(want[i, t]) for i, t in enumerate(out)], abs=1e-4)
    for i, top in enumerate(lp["top_logprobs"]):
        assert 1 <= len(top) <= 4  # the 3 most probable and the chosen token (texts may coincide)
        assert max(top.values()) == pytest.approx(float(want[i].max()), abs=1e-4)
    texts = lp["tokens"]
    assert lp["text_offset"] == [sum(len(t) for t in texts[:i]) for i in range(len(texts))]
    # streamed: the chunks' logprobs concatenate to the same
    events = sse_events(c.post("/v1/completions", json={**body, "stream": True}))
    got = [e["choices"][0]["logprobs"] for e in events if e["choices"] and e["choices"][0]["logprobs"]]
    assert sum((g["tokens"] for g in got), []) == lp["tokens"]
    assert sum((g["token_logprobs"] for g in got), []) == pytest.approx(lp["token_logprobs"], abs=1e-4)
    assert sum((g["text_offset"] for g in got), []) == lp["text_offset"]


def test_echo_with_prompt_logprobs_and_max_tokens_zero(spec_server, target):
    """What lm-eval-harness sends for log-likelihoods: echo, logprobs, max_tokens 0."""
    c, eng = spec_server
    prompt = PROMPTS[1]
    for _ in range(2):  # the second request's prompt is all in the prefix cache: the rows are recomputed
        r = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 2})
        assert r.status_code == 200, r.text
        res = r.json()
        ch = res["choices"][0]
        assert ch["text"] == eng.tokenizer.decode(prompt) and ch["finish_reason"] == "length"
        assert res["usage"]["completion_tokens"] == 0
        lp = ch["logprobs"]
        assert lp["tokens"] == [eng.tokenizer.decode([t], False) for t in prompt]
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        want = torch.log_softmax(direct_logits(target, prompt), -1)
        assert lp["token_logprobs"][1:] == pytest.approx(
            [float(want[i, t]) for i, t in enumerate(prompt[1:])], abs=1e-4)
    # echo with generation: the prompt's entries come first, then the output's, offsets running on
    body = {"prompt": prompt, "max_tokens": 5, "echo": True, "logprobs": 1, "temperature": 0, "ignore_eos": True}
    res = c.post("/v1/completions", json=body).json()
    lp = res["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(prompt) + 5 and lp["token_logprobs"][0] is None
    assert res["choices"][0]["text"].startswith(eng.tokenizer.decode(prompt))
    events = sse_events(c.post("/v1/completions", json={**body, "stream": True}))
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == res["choices"][0]["text"]
    got = [e["choices"][0]["logprobs"] for e in events if e["choices"] and e["choices"][0]["logprobs"]]
    assert sum((g["text_offset"] for g in got), []) == lp["text_offset"]
    # echo without logprobs
    res = c.post("/v1/completions", json={**body, "logprobs": None}).json()
    assert res["choices"][0]["text"].startswith(eng.tokenizer.decode(prompt))
    assert res["choices"][0]["logprobs"] is None
    # max_tokens 0 is for echo only
    r = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 0, "logprobs": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def test_chat_logprobs_over_http(chat_server):
    c, eng = chat_server
    msgs = [{"role": "user", "content": "hello"}]
    body = {"messages": msgs, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "logprobs": True,
            "top_logprobs": 2}
    res = c.post("/v1/chat/completions", json=body).json()
    content = res["choices"][0]["logprobs"]["content"]
    assert len(content) == res["usage"]["completion_tokens"] == 8
    prompt = eng.tokenizer.encode(eng.tokenizer.render_chat(msgs), add_special=False)
    out = eng.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]["tokens"]
    want = expected_logprobs(eng.model, prompt, out, SamplingParams(temperature=0))
    for i, e in enumerate(content):
        assert e["token"] == eng.tokenizer.decode([out[i]], False)
        assert e["bytes"] == list(e["token"].encode())
        assert e["logprob"] == pytest.approx(float(want[i, out[i]]), abs=1e-4)
        assert [t["logprob"] for t in e["top_logprobs"]] == pytest.approx(want[i].topk(2).values.tolist(),
                                                                        abs=1e-4)
    events = sse_events(c.post("/v1/chat/completions", json={**body, "stream": True}))
    got = [e["choices"][0]["logprobs"] for e in events if e["choices"] and e["choices"][0]["logprobs"]]
    streamed = sum((g["content"] for g in got), [])
    assert [e["token"] for e in streamed] == [e["token"] for e in content]
    assert [e["logprob"] for e in streamed] == pytest.approx([e["logprob"] for e in content], abs=1e-4)
    assert [len(e["top_logprobs"]) for e in streamed] == [2] * 8
    # logprobs: true alone -> no alternatives
    res = c.post("/v1/chat/completions", json={**body, "top_logprobs": None}).json()
    assert all(e["top_logprobs"] == [] for e in res["choices"][0]["logprobs"]["content"])
    res = c.post("/v1/chat/completions", json={**body, "logprobs": False, "top_logprobs": None}).json()
    assert res["choices"][0]["logprobs"] is None


def test_logit_bias_over_http(chat_server):
    c, eng = chat_server
    tok = eng.tokenizer.encode("Z", add_special=False)[0]
    body = {"prompt": "hello", "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "logit_bias": {str(tok): 100}}
    assert c.post("/v1/completions", json=body).json()["choices"][0]["text"] == "Z" * 6
    msgs = [{"role": "user", "content": "hi"}]
    res = c.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 4, "temperature": 0,
                                              "ignore_eos": True, "logit_bias": {str(tok): 100.0}}).json()
    assert res["choices"][0]["message"]["content"] == "ZZZZ"


BAD = [
    ("/v1/completions", {"logit_bias": {"-1": 1}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": {"abc": 1}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": {"300": 1}}, "logit_bias"),  # vocab 300
    ("/v1/completions", {"logit_bias": {"5": 101}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": {"5": "x"}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": [1, 2]}, "logit_bias"),
    ("/v1/completions", {"logprobs": -1}, "logprobs"),
    ("/v1/completions", {"logprobs": 21}, "logprobs"),
    ("/v1/completions", {"logprobs": True}, "logprobs"),
    ("/v1/completions", {"echo": "yes"}, "echo"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),  # needs logprobs: true
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": 3}, "logprobs"),
    ("/v1/chat/completions", {"logit_bias": {"1.5": 2}}, "logit_bias"),
]


@pytest.mark.parametrize(("path", "fields", "param"), BAD)
def test_bad_logprobs_logit_bias_echo_are_400(chat_server, path, fields, param):
    c, _ = chat_server
    base = {"messages": [{"role": "user", "content": "x"}]} if "chat" in path else {"prompt": "x"}
    r = c.post(path, json={**base, "max_tokens": 2, **fields})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err
