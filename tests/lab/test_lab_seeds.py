"""`turbospec lab seeds`: the table built from bench / client / quality rows, the command end to end on a tiny
model, a server through --url, and one-line errors for bad input."""

import contextlib
import json
import socket
import threading
import time

import pytest

from turbospec.cli.main import main
from turbospec.demo import make_demo_model
from turbospec.lab.seeds import cost_tables, seeds_rows


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_demo_model(tmp_path_factory.mktemp("s") / "m", hidden_size=32, intermediate_size=64,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                           vocab_size=300)


def _row(depth, cat, tps, ttft=10.0, peak=None, acc=None):
    r = {"depth": depth, "category": cat, "decode_tps": tps, "ttft_ms": ttft}
    if peak is not None:
        r["peak_rss_mib"] = peak
    if acc is not None:
        r["acc_rate"] = acc
    return r


def test_rows_split_code_and_prose_and_put_kld_beside_their_row():
    plain = [_row(0, "code", 100.0, 5, 300), _row(0, "code_cpp", 120.0, 7, 310), _row(0, "explain", 80.0, 9, 320),
             _row(1000, "code", 50.0, peak=400), _row(1000, "code_cpp", 90.0, peak=410),
             _row(1000, "explain", 60.0, peak=420)]
    spec = [_row(0, "code", 200.0, acc=0.8, peak=500), _row(0, "explain", 90.0, acc=0.4, peak=500),
            _row(1000, "code", 100.0, acc=0.7, peak=600), _row(1000, "explain", 90.0, acc=0.3, peak=600)]
    server = [_row(0, "code", 40.0, 30), _row(0, "explain", 30.0, 50)]
    runs = [{"engine": "turbospec", "config": "f16", "label": "turbospec f16", "kv": "f16/f16", "rows": plain},
            {"engine": "turbospec", "config": "mtp", "label": "turbospec mtp", "kv": "q8_0/q8_0", "rows": spec},
            {"engine": "srv", "config": "server", "kv": None, "rows": server}]
    kld = {"f16/f16": 0.0, "q8_0/q8_0": 0.004, "q4_0/q4_0": 0.2}
    a, b, c = seeds_rows(runs, kld, ("code", "code_cpp"), ("explain",))
    assert (a["code_tps"], a["prose_tps"]) == (110.0, 80.0)  # median over the code categories at depth 0
    assert a["ttft_ms"] == 7 and a["peak_mib"] == 420 and (a["depth_min"], a["depth_max"]) == (0, 1000)
    assert a["loss_pct"] == pytest.approx(25.0)  # per category 50%, 25%, 25%: median 25%
    assert a["acc_rate"] is None and a["kld_mean"] == 0.0
    assert (b["code_tps"], b["prose_tps"]) == (200.0, 90.0)
    assert b["acc_rate"] == pytest.approx(0.6) and (b["code_acc"], b["prose_acc"]) == (0.8, 0.4)
    assert b["kld_mean"] == 0.004 and b["loss_pct"] == pytest.approx(25.0)
    # a server: one depth, no memory reported, no K/V given
    assert (c["code_tps"], c["prose_tps"], c["ttft_ms"]) == (40.0, 30.0, 40.0)
    assert c["loss_pct"] is None and c["peak_mib"] is None and c["kld_mean"] is None and c["acc_rate"] is None
    assert c["label"] == "srv"
    cost = cost_tables([a, b, c])
    assert [e["tps"] for e in cost["engines"]] == [95.0, 145.0, 35.0]  # mean of code and prose t/s
    assert len(cost["cells"]) == len(cost["tokens"]) and len(cost["head"]) == 1 + len(cost["apis"]) + 3
    slow, fast = cost["engines"][2], cost["engines"][1]
    assert slow["capacity_tokens_per_month"] < fast["capacity_tokens_per_month"]
    assert slow["rows"][-1]["units"] >= fast["rows"][-1]["units"]


def test_tables_print_labels_as_given(capsys, monkeypatch):
    """A label with [brackets] (--config or --url-name) is printed as it is, not read as rich markup (where
    `[fast]` vanished and `[/]` raised after the whole run)."""
    pytest.importorskip("rich")
    from turbospec.lab.seeds import print_tables

    monkeypatch.setenv("COLUMNS", "240")
    for label in ("srv [fast]", "srv [/]"):
        runs = [{"engine": label, "config": "server", "label": label, "kv": None,
                 "rows": [_row(0, "code", 40.0), _row(0, "explain", 30.0)]}]
        rows = seeds_rows(runs, {}, ("code",), ("explain",))
        print_tables({"rows": rows, "settings": {}, "cost": cost_tables(rows)})
        out = capsys.readouterr().out
        assert f"{label} @ 35.0 t/s" in out and f"{label}: break-even" in out and f"│ {label} " in out


def test_seeds_end_to_end(tiny, tmp_path):
    out = tmp_path / "rep"
    rc = main(["lab", "seeds", "-m", str(tiny), "--config", "plain: -ctk f16 -ctv f16",
               "--config", "spec: -ctk q8_0 -ctv q8_0 --spec-type ngram", "--code", "code", "--prose", "explain,creative",
               "-d", "0,16", "-n", "4", "-r", "1", "--warmup", "0", "--kld-ctx", "64", "--kld-chunks", "1",
               "--out", str(out), "-q", "-t", "1", "--plot-format", "png,svg"])
    assert rc == 0
    rep = json.loads((out / "report.json").read_text())
    rows = {r["config"]: r for r in rep["rows"]}
    assert list(rows) == ["plain", "spec"]
    assert {p.name for p in out.iterdir() if p.suffix in (".png", ".svg")} == {
        f"{n}.{f}" for n in ("code_prose_tps", "kld_vs_bits") for f in ("png", "svg")}
    for r in rows.values():
        for key in ("code_tps", "prose_tps", "ttft_ms", "peak_mib"):
            assert r[key] > 0
        assert r["depth_max"] == 16 and r["loss_pct"] is not None
    assert rows["plain"]["kv"] == "f16/f16" and rows["spec"]["kv"] == "q8_0/q8_0"
    assert rows["plain"]["acc_rate"] is None and rows["spec"]["acc_rate"] is not None
    assert rows["plain"]["kld_mean"] == 0.0 and rows["spec"]["kld_mean"] > 0
    assert {r["kv"] for r in rep["kld"]} == {"f16/f16", "q8_0/q8_0"}
    cats = [(r["depth"], r["category"]) for r in rep["runs"][0]["rows"]]
    assert cats == [(0, "code"), (0, "explain"), (0, "creative"), (16, "code"), (16, "explain"), (16, "creative")]
    assert len(rep["cost"]["engines"]) == 2 and rep["cost"]["preset"] == "seeds"
    md = (out / "report.md").read_text()
    assert "## The seeds' table" in md and "## Cost" in md and "turbospec spec" in md


def test_sweep_applies_to_every_config_and_kld_can_be_skipped(tiny, tmp_path):
    out = tmp_path / "rep"
    rc = main(["lab", "seeds", "-m", str(tiny), "--sweep", "ctk=f16,q4_0", "--code", "code", "--prose", "explain",
               "-d", "0", "-n", "2", "-r", "1", "--warmup", "0", "--no-kld", "--out", str(out), "-q", "-t", "1"])
    assert rc == 0
    rows = json.loads((out / "report.json").read_text())["rows"]
    assert [r["config"] for r in rows] == ["ctk=f16", "ctk=q4_0"]
    assert all(r["kld_mean"] is None and r["loss_pct"] is None for r in rows)


@pytest.mark.parametrize("args, message", [
    (["--sweep", "bogus=1"], "unknown sweep key"),
    (["--config", "x: --no-such-flag"], "--config"),
    (["--code", "nope"], "unknown prompt category"),
    (["--code", "code", "--prose", "code"], "both --code and --prose"),
    (["--url", "http://127.0.0.1:9/v1"], "cannot reach"),
    (["--url", "localhost:8080"], "expected an http(s) base URL"),
    (["--url-kv", "q8_0/q8_0"], "--url-kv given 1 times for 0 --url"),
    (["--no-local"], "nothing to measure"),
])
def test_bad_input_is_a_one_line_error(tiny, tmp_path, capsys, args, message):
    rc = main(["lab", "seeds", "-m", str(tiny), "-q", "--out", str(tmp_path / "x"), *args])
    err = capsys.readouterr().err
    assert rc == 1 and message in err and err.count("\n") == 1
    assert not (tmp_path / "x").exists()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _server(model):
    uvicorn = pytest.importorskip("uvicorn")
    from turbospec.config import EngineConfig
    from turbospec.engine import build_engine
    from turbospec.server import ServerConfig, create_app

    app = create_app(build_engine(EngineConfig(model=str(model), threads=1)), ServerConfig(model_name="tiny"))
    port = _free_port()
    http = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    t = threading.Thread(target=http.run, daemon=True)
    t.start()
    for _ in range(500):
        if http.started:
            break
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        http.should_exit = True
        t.join(10)


def test_a_server_row_through_url(tiny, tmp_path):
    out = tmp_path / "rep"
    with _server(tiny) as url:
        rc = main(["lab", "seeds", "-m", str(tiny), "--no-local", "--url", url, "--url-name", "srv",
                   "--url-kv", "q8_0/q8_0", "--code", "code", "--prose", "explain", "-d", "0,8", "-n", "3", "-r", "1",
                   "--warmup", "0", "--kld-ctx", "64", "--kld-chunks", "1", "--out", str(out), "-q", "-t", "1"])
    assert rc == 0
    rep = json.loads((out / "report.json").read_text())
    (row,) = rep["rows"]
    assert row["label"] == "srv" and row["config"] == "server" and row["kv"] == "q8_0/q8_0"
    assert row["code_tps"] > 0 and row["prose_tps"] > 0 and row["ttft_ms"] > 0
    assert row["peak_mib"] is None and row["kld_mean"] > 0 and row["depth_max"] == 8
    assert {r["depth"] for r in rep["runs"][0]["rows"]} == {0, 8}


def test_server_depth_is_a_shared_filler_and_each_repetition_a_new_prompt():
    """`run_remote` at a depth: the same filler words before every request (a prefix cache may keep them), then a
    line new to each repetition, so the prompt itself is not answered from the cache."""
    from tests.fake_openai import fake_completions
    from turbospec.lab.client import run_remote
    from turbospec.lab.workload import BenchOptions

    with fake_completions(("a", "b", "c")) as (root, prompts):
        rep = run_remote([root], BenchOptions(n_gen=3, repetitions=2, warmup=1, depths=(0, 50), categories="code",
                                              quiet=True))
    assert [r["depth"] for r in rep["rows"]] == [0, 50]
    shallow, deep = prompts[:3], prompts[3:]
    assert len(set(shallow)) == 3 and len(set(deep)) == 3  # each repetition differs
    filler = deep[0].split("\n\n")[0]
    assert len(filler.split()) == 50 and all(p.startswith(filler + "\n\n") for p in deep)
    assert all(p.endswith(shallow[0].split("\n", 1)[1]) for p in prompts)  # then the category's prompt
