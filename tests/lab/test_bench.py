import json

import pytest

from turbospec.cli.main import main
from turbospec.demo import make_demo_model
from turbospec.errors import TurboSpecError
from turbospec.lab.bench import parse_sweeps


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_demo_model(tmp_path_factory.mktemp("b") / "m", hidden_size=32, intermediate_size=64,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                           vocab_size=300)


def test_sweep_is_cartesian():
    cfgs = parse_sweeps(["spec-type=none,ngram", "ub=8,16,32"])
    assert len(cfgs) == 6 and {"spec-type": "ngram", "ub": "16"} in cfgs
    with pytest.raises(TurboSpecError):
        parse_sweeps(["bogus=1"])


def test_bench_writes_all_reports(tiny, tmp_path):
    out = tmp_path / "rep"
    rc = main(["bench", "-m", str(tiny), "-p", "12", "-n", "6", "-r", "2", "--warmup", "1", "--depth", "0,24",
               "--sweep", "spec-type=none,ngram", "--out", str(out), "-q", "-t", "1"])
    assert rc == 0
    rep = json.loads((out / "report.json").read_text())
    assert len(rep["rows"]) == 4
    for key in ("cpu", "python", "torch", "turbospec", "model", "model_sha256_16"):
        assert key in rep["env"]
    assert rep["settings"]["n_prompt"] == 12 and rep["settings"]["repetitions"] == 2
    row = rep["rows"][0]
    for key in ("prefill_tps", "decode_tps", "decode_tps_min", "decode_tps_max", "decode_tps_sd", "ttft_ms",
                "peak_rss_mib"):
        assert row[key] >= 0
    assert any("acc_rate" in r for r in rep["rows"])
    assert all("decode_loss_vs_d0_pct" in r for r in rep["rows"])
    assert (out / "report.csv").read_text().count("\n") == 5
    assert "## Environment" in (out / "report.md").read_text()
    assert (out / "tps_vs_depth.png").stat().st_size > 1000


def test_bench_categories(tiny, tmp_path):
    rc = main(["bench", "-m", str(tiny), "-n", "4", "-r", "1", "--warmup", "0", "--categories", "code,math",
               "--out", str(tmp_path / "c"), "-q", "-t", "1"])
    assert rc == 0
    rows = json.loads((tmp_path / "c" / "report.json").read_text())["rows"]
    assert [r["category"] for r in rows] == ["code", "math"]


def test_prometheus_spec_counters_are_read():
    """For servers without llama-server timings (vLLM), acceptance comes from the Prometheus counters."""
    import http.server
    import threading

    from turbospec.lab.client import scrape_spec_counters

    body = (b"# HELP vllm:spec_decode_num_draft_tokens_total x\n"
            b'vllm:spec_decode_num_draft_tokens_total{model_name="m"} 120.0\n'
            b'vllm:spec_decode_num_accepted_tokens_total{model_name="m"} 90.0\n'
            b'vllm:spec_decode_num_accepted_tokens_per_pos_total{position="0"} 50.0\n'
            b"vllm:spec_decode_num_drafts_total 40.0\n")

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/metrics" else 404)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    srv = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        got = scrape_spec_counters(f"http://127.0.0.1:{srv.server_port}/v1", None)
    finally:
        srv.shutdown()
    assert got == {"draft": 120.0, "accepted": 90.0}


def test_sweep_values_take_the_option_type():
    from turbospec.config import EngineConfig, SpecConfig
    from turbospec.lab.bench import apply_sweep

    a = EngineConfig(spec=SpecConfig(draft_vocab=0, p_min=0.0, n_max=3))
    b = apply_sweep(a, {"draft-vocab": "2048", "p-min": "0.25", "spec-type": "ngram-mod+draft-mtp"})
    assert b.spec.draft_vocab == 2048 and b.spec.p_min == 0.25
    assert b.spec.types == ("ngram-mod", "draft-mtp") and a.spec.draft_vocab == 0


def test_env_records_kernel_switches(monkeypatch):
    from turbospec.lab.report import env_info

    monkeypatch.setenv("TURBOSPEC_NO_FUSED", "1")
    monkeypatch.setenv("UNRELATED_VAR", "x")
    env = env_info()["turbospec_env"]
    assert env.get("TURBOSPEC_NO_FUSED") == "1" and "UNRELATED_VAR" not in env


def test_bench_fills_a_depth_once_on_a_hybrid(tmp_path, monkeypatch):
    """At a depth every repetition, the warm-up included, resumes where the filler ends: the filler is computed
    once, on a hybrid model too (its recurrent states kept at a checkpoint there)."""
    from pathlib import Path

    from turbospec.engine.engine import Engine

    calls = []
    prefill = Engine.prefill

    def counting(self, tokens, *args, **kwargs):
        out = prefill(self, tokens, *args, **kwargs)
        calls.append((len(tokens), self.reused_tokens))
        return out

    monkeypatch.setattr(Engine, "prefill", counting)
    model = Path(__file__).resolve().parents[2] / "models" / "turbospec-tiny-hybrid"
    rc = main(["bench", "-m", str(model), "-p", "8", "-n", "2", "-r", "2", "--warmup", "1", "--depth", "600",
               "--out", str(tmp_path / "h"), "-q", "-t", "1"])
    assert rc == 0
    assert calls[0] == (601, 0)  # the fill (up to the first prompt token), untimed
    assert calls[1:] == [(608, 600)] * 3  # warm-up and two repetitions: only the prompt is computed


@pytest.mark.parametrize("kv", ["f16", "tbq4_0"])
def test_bench_random_depth_fill_reads_no_filler(tmp_path, monkeypatch, kv):
    """--depth-fill random: the depth's KV is written (no filler token goes through the model) and every
    repetition resumes there and computes the prompt alone, on a hybrid too (its states kept at a checkpoint)."""
    from pathlib import Path

    from turbospec.engine.engine import Engine

    calls = []
    prefill = Engine.prefill

    def counting(self, tokens, *args, **kwargs):
        out = prefill(self, tokens, *args, **kwargs)
        calls.append((len(tokens), self.reused_tokens, self.cache.length))
        return out

    monkeypatch.setattr(Engine, "prefill", counting)
    model = Path(__file__).resolve().parents[2] / "models" / "turbospec-tiny-hybrid"
    rc = main(["bench", "-m", str(model), "-p", "8", "-n", "2", "-r", "2", "--warmup", "1", "--depth", "0,600",
               "-ctk", kv, "-ctv", kv, "--depth-fill", "random", "--out", str(tmp_path / "h"), "-q", "-t", "1"])
    assert rc == 0
    assert [c[:2] for c in calls[:3]] == [(8, 0)] * 3  # depth 0: warm-up and two repetitions from empty
    assert calls[3:] == [(608, 600, 608)] * 3  # at 600: only the prompt, after 600 random positions
    rows = json.loads((tmp_path / "h" / "report.json").read_text())["rows"]
    assert [r["depth"] for r in rows] == [0, 600] and all(r["decode_tps"] > 0 for r in rows)


def test_bench_random_depth_fill_refuses_drafters(tiny, tmp_path, capsys):
    rc = main(["bench", "-m", str(tiny), "-p", "8", "-n", "2", "-r", "1", "--depth", "16", "--depth-fill", "random",
               "--spec-type", "ngram", "--out", str(tmp_path / "x"), "-q"])
    assert rc != 0 and "plain decoding" in capsys.readouterr().err and not (tmp_path / "x").exists()


def test_interleave_runs_points_back_to_back_on_one_copy_of_the_weights(tiny, tmp_path, monkeypatch, capsys):
    """--interleave: every point's engine first, on one model; each repetition runs every point, in alternating
    order; the rows carry the paired ratios to the first point (1.0 for the first point itself)."""
    from turbospec.engine.engine import Engine

    order, models = [], set()
    stream = Engine.stream

    def recording(self, tokens, params, *args, **kwargs):
        order.append(self.config.cache_type_k)
        models.add(id(self.model))
        return stream(self, tokens, params, *args, **kwargs)

    monkeypatch.setattr(Engine, "stream", recording)
    out = tmp_path / "i"
    rc = main(["bench", "-m", str(tiny), "-p", "8", "-n", "4", "-r", "3", "--warmup", "1", "--depth", "0,16",
               "--interleave", "--sweep", "kv=f32,q8_0,tbq4_0", "--out", str(out), "-q", "-t", "1"])
    assert rc == 0
    abc = ["f32", "q8_0", "tbq4_0"]
    assert order == (abc + abc[::-1] + abc + abc[::-1]) * 2  # warm-up + 3 repetitions, at each depth
    assert len(models) == 1
    rows = json.loads((out / "report.json").read_text())["rows"]
    assert [(r["config"], r["depth"]) for r in rows] == [(f"kv={t}", d) for d in (0, 16) for t in abc]
    assert "decode_ratio" in (out / "report.md").read_text()
    for r in rows:
        assert r["decode_ratio_min"] <= r["decode_ratio"] <= r["decode_ratio_max"]
        if r["kv"] == "f32":
            assert r["decode_ratio"] == r["prefill_ratio"] == 1.0
    from turbospec.config import EngineConfig
    from turbospec.lab.bench import apply_sweep

    assert apply_sweep(EngineConfig(), {"kv": "q4_0"}).cache_type_v == "q4_0"
    capsys.readouterr()  # a thread sweep cannot share one process's thread count: a one-line error
    assert main(["bench", "-m", str(tiny), "-p", "8", "-n", "2", "-r", "1", "--interleave", "--sweep", "threads=1,2",
                 "--out", str(tmp_path / "t"), "-q"]) == 1
    assert "--interleave" in capsys.readouterr().err


def test_interleaved_mtp_engines_on_one_model_draft_as_alone(tmp_path):
    """Two MTP engines sharing one hybrid model, run back to back, accept exactly what each accepts alone."""
    from pathlib import Path

    model = Path(__file__).resolve().parents[2] / "models" / "turbospec-tiny-hybrid"
    acc = []
    for mode in ([], ["--interleave"]):
        out = tmp_path / f"m{len(mode)}"
        assert main(["bench", "-m", str(model), "-p", "8", "-n", "12", "-r", "2", "--warmup", "0", "--categories",
                     "code", "--sweep", "kv=f32,q8_0", "--sweep", "spec-type=draft-mtp", *mode, "--out", str(out),
                     "-q", "-t", "1"]) == 0
        rows = json.loads((out / "report.json").read_text())["rows"]
        acc.append([(r["config"], r["acc_rate"], r["mean_acc_len"]) for r in rows])
    assert acc[0] == acc[1] and all(a is not None for _, a, _ in acc[0])
