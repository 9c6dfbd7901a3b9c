"""What one client can learn of another's traffic: `turbospec serve` generates on the main thread (the speed fix,
checked here through its real serving function), and the prefix cache can be switched off."""

import threading
import time

import pytest

from tests.test_server_cancel import PacedEngine, _free_port

httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")


class ThreadRecordingEngine(PacedEngine):
    def __init__(self):
        super().__init__(step_s=0.0)
        self.threads: list[bool] = []

    def stream(self, tokens, params, abort=None):
        self.threads.append(threading.current_thread() is threading.main_thread())
        yield from super().stream(tokens, params, abort)


def test_serve_generates_on_the_main_thread():
    """`turbospec serve`'s serving function runs the worker on the calling (main) thread and HTTP on another;
    PyTorch's OpenMP decodes 2.5x slower on a second torch thread (see turbospec.server.worker.Worker)."""
    from turbospec.cli.serve import serve_on_main_thread
    from turbospec.server import ServerConfig, create_app

    assert threading.current_thread() is threading.main_thread()
    eng = ThreadRecordingEngine()
    app = create_app(eng, ServerConfig(model_name="m"), worker_thread=False)
    port = _free_port()
    http = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    answers = []

    def client():
        try:
            while not http.started:
                time.sleep(0.01)
            r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": [1, 2], "max_tokens": 3},
                           timeout=30)
            answers.append(r.json()["usage"]["completion_tokens"])
        finally:
            app.state.worker.stop_soon()  # what SIGINT does

    threading.Thread(target=client, daemon=True).start()
    assert serve_on_main_thread(http, app.state.worker, "test") == 0
    assert answers == [3] and eng.threads == [True]


def test_no_prefix_cache_flag_recomputes_every_prompt(tmp_path):
    from turbospec.cli.args import engine_config
    from turbospec.cli.main import build_parser
    from turbospec.demo import make_demo_model
    from turbospec.engine import build_engine
    from turbospec.sampling import SamplingParams

    model = make_demo_model(tmp_path / "m", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=2, num_key_value_heads=1, head_dim=16, vocab_size=300)
    prompt, params = list(range(3, 40)), SamplingParams(temperature=0, max_tokens=2)
    for flags, reused in (([], True), (["--no-prefix-cache"], False)):
        a = build_parser().parse_args(["serve", "-m", str(model), "-c", "128", *flags])
        eng = build_engine(engine_config(a))
        for _ in range(2):
            list(eng.stream(prompt, params))
        assert (eng.last_stats.cached_tokens > 0) == reused
