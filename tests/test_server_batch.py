"""The server with --parallel N: concurrent requests are generated together and give the answers they get one at a
time; a client that leaves is aborted at the next step; a model the scheduler cannot run is refused at start-up."""

import threading
import time
from pathlib import Path

import pytest
import torch

httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from tests.test_server_cancel import live, live_app, settle  # noqa: E402
from turbospec.config import EngineConfig  # noqa: E402
from turbospec.engine.engine import Engine  # noqa: E402
from turbospec.errors import TurboSpecError  # noqa: E402
from turbospec.model.registry import load_model  # noqa: E402
from turbospec.tokenizer import Tokenizer  # noqa: E402

TINY = Path(__file__).resolve().parents[1] / "models" / "turbospec-tiny"
pytestmark = pytest.mark.skipif(not (TINY / "config.json").exists(), reason="no bundled model")


@pytest.fixture(scope="module")
def engine():
    return Engine(load_model(str(TINY), torch.float32), Tokenizer(str(TINY)), EngineConfig(ctx=4096))


def _ask(base, prompts, out, stream=False):
    def one(i, p):
        r = httpx.post(base + "/v1/completions", json={"prompt": p, "max_tokens": 24, "temperature": 0},
                       timeout=120)
        out[i] = r.json()

    ts = [threading.Thread(target=one, args=(i, p)) for i, p in enumerate(prompts)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()


def _answers(engine, prompts, **cfg) -> dict[int, dict]:
    """Every prompt's completion from a live server over `engine`, all sent at once."""
    out: dict[int, dict] = {}
    with live(engine, **cfg) as base:
        _ask(base, prompts, out)
    return out


@pytest.fixture(scope="module")
def hybrid_engine():
    path = TINY.parent / "turbospec-tiny-hybrid"
    return Engine(load_model(str(path), torch.float32), Tokenizer(str(path)), EngineConfig(ctx=4096))


@pytest.mark.parametrize("which", ["engine", "hybrid_engine"])
def test_concurrent_requests_equal_one_at_a_time(which, request):
    engine = request.getfixturevalue(which)
    prompts = ["Once upon a time", "def add(a, b):", "The quick brown fox", "1, 2, 3, 4,", "Hello"]
    alone: dict[int, dict] = {}
    together: dict[int, dict] = {}
    with live(engine) as base:
        _ask(base, prompts, alone)
    with live(engine, parallel=3) as base:
        _ask(base, prompts, together)
        assert settle(base) == {"status": "ok", "running": 0, "waiting": 0}
        m = httpx.get(base + "/metrics").text
        assert 'turbospec:request_success_total{finished_reason="length"} 5.0' in m
        assert "turbospec:kv_cache_usage_perc 0.0" in m and "turbospec:num_preemptions_total 0.0" in m
        assert "turbospec:prefix_cache_queries_total" in m and "turbospec:prefix_cache_hits_total" in m
    for i in range(len(prompts)):
        assert together[i]["choices"][0]["text"] == alone[i]["choices"][0]["text"]
        assert together[i]["usage"] == alone[i]["usage"]


def test_client_that_leaves_is_aborted_and_nothing_more_is_computed(engine):
    with live_app(engine, parallel=2) as (base, app):
        with httpx.Client(timeout=30) as h, h.stream("POST", base + "/v1/completions",
                                                      json={"prompt": [1, 2, 3], "max_tokens": 3000,
                                                            "stream": True, "ignore_eos": True}) as r:
            lines = r.iter_lines()
            next(lines)  # generating
        assert settle(base) == {"status": "ok", "running": 0, "waiting": 0}
        worker_sched = app.state.worker.scheduler
        steps = worker_sched.steps
        assert 0 < steps < 3000  # stopped long before the 3000 tokens
        time.sleep(0.2)
        assert worker_sched.steps == steps and not worker_sched.has_work
        assert worker_sched.pool.num_free == worker_sched.pool.num_blocks
        r = httpx.post(base + "/v1/completions", json={"prompt": "Hi", "max_tokens": 3}, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


def test_parallel_refuses_what_it_cannot_batch(engine):
    from turbospec.config import SpecConfig
    from turbospec.server import ServerConfig, create_app

    class WithMedusa:
        model, tokenizer, drafter, model_path = engine.model, engine.tokenizer, object(), None
        config = engine.config.replace(spec=SpecConfig.parse("medusa"))

        def eos_ids(self):
            return set()

        def new_scheduler(self, parallel):
            from turbospec.engine.scheduler import Scheduler

            return Scheduler.for_engine(self, parallel)

    with pytest.raises(TurboSpecError, match="medusa is not batched yet"):
        create_app(WithMedusa(), ServerConfig(model_name="m", parallel=2))


def test_speculation_in_the_batch_through_the_server():
    """-np 3 with MTP drafting on the hybrid: the answers of -np 1 without drafting, and the drafts show in the
    responses' timings."""
    from turbospec.config import SpecConfig

    path = TINY.parent / "turbospec-tiny-hybrid"
    model, tok = load_model(str(path), torch.float32), Tokenizer(str(path))
    plain = Engine(model, tok, EngineConfig(ctx=4096))
    spec = Engine(model, tok, EngineConfig(ctx=4096, spec=SpecConfig.parse("draft-mtp")), model_path=str(path))
    prompts = ["Once upon a time", "def add(a, b):", "The quick brown fox", "1, 2, 3, 4,"]
    alone, together = _answers(plain, prompts), _answers(spec, prompts, parallel=3)
    for i in range(len(prompts)):
        assert together[i]["choices"][0]["text"] == alone[i]["choices"][0]["text"]
    assert sum(together[i]["timings"]["draft_n_accepted"] for i in together) > 0
