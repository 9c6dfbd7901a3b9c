"""The web page's server side (turbospec.server.web) through FastAPI's TestClient: the page and its assets, /props,
the reports listing (files and history), one report with its plots as SVG, compare, access with an API key, and
`--no-webui`. The page itself is driven in Chromium by tests/test_web_browser.py."""

import json

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("matplotlib")


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from turbospec.config import EngineConfig
    from turbospec.demo import make_demo_model
    from turbospec.engine import build_engine

    path = make_demo_model(tmp_path_factory.mktemp("web") / "m", hidden_size=32, intermediate_size=64,
                           num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                           vocab_size=300)
    return build_engine(EngineConfig(model=str(path), ctx=256, cache_type_k="q8_0", cache_type_v="q4_0"))


def bench_report(commit: str = "abc1234", tps: float = 10.0) -> dict:
    rows = []
    for ctk in ("f16", "q8_0"):
        for depth in (0, 512):
            t = tps * (1.0 if ctk == "f16" else 1.1) * (1.0 if depth == 0 else 0.8)
            rows.append({"config": f"ctk={ctk}", "ctk": ctk, "depth": depth, "category": "random", "n_prompt": 8,
                         "n_gen": 4, "prefill_tps": 50.0, "prefill_tps_min": 49.0, "prefill_tps_max": 51.0,
                         "decode_tps": t, "decode_tps_min": t * 0.98, "decode_tps_max": t * 1.02,
                         "ttft_ms": 20.0, "ttft_ms_min": 19.0, "ttft_ms_max": 21.0})
    return {"env": {"turbospec": "0.1.0", "git_commit": commit, "cpu": "test cpu", "cores": 2},
            "settings": {"model": "m", "sweep": ["ctk=f16,q8_0"], "depth": "0,512"}, "rows": rows}


def client(engine, **cfg):
    from fastapi.testclient import TestClient

    from turbospec.server import ServerConfig, create_app

    return TestClient(create_app(engine, ServerConfig(model_name="tiny", host="testserver", **cfg)))


def test_page_assets_and_props(engine):
    c = client(engine)
    r = c.get("/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    csp = r.headers["content-security-policy"]
    assert "default-src 'self'" in csp and "frame-ancestors 'none'" in csp
    assert r.headers["x-content-type-options"] == "nosniff"
    assert '<script src="/web/app.js">' in r.text and 'id="messages"' in r.text
    js = c.get("/web/app.js")
    assert js.status_code == 200 and "javascript" in js.headers["content-type"]
    assert "/v1/chat/completions" in js.text and "http://" not in js.text and "https://" not in js.text
    assert c.get("/web/style.css").headers["content-type"].startswith("text/css")
    assert c.get("/web/../app.py").status_code == 404 and c.get("/web/index.htm").status_code == 404
    p = c.get("/props").json()
    assert p["model"] == "tiny" and p["n_ctx"] == 256
    assert (p["cache_type_k"], p["cache_type_v"]) == ("q8_0", "q4_0") and p["spec_types"] == []
    assert c.get("/lab/reports").json() == {"reports": []}  # nothing configured


def test_reports_listing_report_and_plots(engine, tmp_path):
    (tmp_path / "bench-1").mkdir()
    (tmp_path / "bench-1" / "report.json").write_text(json.dumps(bench_report()))
    (tmp_path / "notes.json").write_text("[1, 2]")  # not a report: left out
    (tmp_path / "broken.json").write_text("{not json")  # unreadable: left out
    c = client(engine, reports=(str(tmp_path),))
    listing = c.get("/lab/reports").json()["reports"]
    assert [(r["kind"], r["title"], r["rows"]) for r in listing] == [("bench", "bench-1", 4)]
    rid = listing[0]["id"]
    body = c.get(f"/lab/reports/{rid}").json()
    assert body["kind"] == "bench" and len(body["report"]["rows"]) == 4
    assert "tps_vs_depth" in body["plots"]
    svg = c.get(f"/lab/plots/{rid}/tps_vs_depth.svg")
    assert svg.status_code == 200 and svg.headers["content-type"] == "image/svg+xml"
    assert svg.text.lstrip().startswith("<?xml") and "<svg" in svg.text
    assert c.get(f"/lab/plots/{rid}/nope.svg").status_code == 404
    assert c.get("/lab/reports/f000000000000").status_code == 404
    assert c.get("/lab/reports/..%2Fetc").status_code == 404
    assert c.get("/lab/compare?a=1&b=2").status_code == 501  # no --db


def test_only_lab_reports_are_served(engine, tmp_path):
    """A reports folder may hold other JSON: it is neither listed nor served, even to a client that computes its
    id (a hash of the path)."""
    import hashlib

    (tmp_path / "config.json").write_text(json.dumps({"password": "x"}))
    c = client(engine, reports=(str(tmp_path),))
    assert c.get("/lab/reports").json() == {"reports": []}
    rid = "f" + hashlib.sha1(str((tmp_path / "config.json").resolve()).encode()).hexdigest()[:12]
    assert c.get(f"/lab/reports/{rid}").status_code == 404


def test_reports_folder_lists_its_newest(engine, tmp_path, monkeypatch):
    import os

    from turbospec.server import web

    monkeypatch.setattr(web, "MAX_REPORTS", 1)
    for i, name in enumerate(("bench-a", "bench-b")):  # bench-b is the newer one (and sorts last)
        (tmp_path / name).mkdir()
        (tmp_path / name / "report.json").write_text(json.dumps(bench_report()))
        os.utime(tmp_path / name / "report.json", (1e9 + i, 1e9 + i))
    listing = client(engine, reports=(str(tmp_path),)).get("/lab/reports").json()["reports"]
    assert [r["title"] for r in listing] == ["bench-b"]


def test_odd_history_ids_are_not_found(engine, tmp_path):
    from turbospec.lab import history

    db = tmp_path / "h.sqlite"
    history.record(db, bench_report())
    c = client(engine, history_db=str(db))
    for rid in ("r\u00b2", "r\u0661", "r" + "9" * 30, "r" + "9" * 5000):  # not ASCII digits; beyond SQLite's integers
        assert c.get(f"/lab/reports/{rid}").status_code == 404
        assert c.get(f"/lab/plots/{rid}/tps_vs_depth.svg").status_code == 404
    assert c.get("/lab/compare?a=r" + "9" * 30 + "&b=r1").status_code == 400


def test_keyless_page_keeps_the_host_check(engine):
    """Without an API key the page and its routes answer only loopback Host names, as the API does."""
    from fastapi.testclient import TestClient

    from turbospec.server import ServerConfig, create_app

    c = TestClient(create_app(engine, ServerConfig(model_name="tiny", host="127.0.0.1")))
    for path in ("/", "/web/app.js", "/props", "/lab/reports", "/lab/reports/r1"):
        assert c.get(path, headers={"Host": "evil.example"}).status_code == 403
    assert c.get("/", headers={"Host": "localhost:8080"}).status_code == 200


def test_history_runs_listed_and_compared(engine, tmp_path):
    from turbospec.lab import history

    db = tmp_path / "h.sqlite"
    a = history.record(db, bench_report("aaaa111", 10.0))
    b = history.record(db, bench_report("bbbb222", 5.0))  # half the speed: slower beyond the spreads
    c = client(engine, history_db=str(db))
    listing = c.get("/lab/reports").json()["reports"]
    assert [r["id"] for r in listing] == [f"r{b}", f"r{a}"] and all(r["source"] == "history" for r in listing)
    assert c.get(f"/lab/reports/r{a}").json()["report"]["env"]["git_commit"] == "aaaa111"
    rows = c.get(f"/lab/compare?a=r{a}&b=r{b}").json()["rows"]
    decode = [r for r in rows if r["metric"] == "decode_tps"]
    assert len(decode) == 4 and {r["verdict"] for r in decode} == {"slower"}
    # git revisions and commit prefixes stay on the command line (no `git rev-parse` for web clients)
    for refs in ("a=bbbb&b=aaaa", "a=HEAD&b=r1", f"a={a}&b={b}"):
        assert c.get("/lab/compare?" + refs).status_code == 400
    bad = c.get("/lab/compare?a=r999&b=r1")
    assert bad.status_code == 400 and "999" in bad.json()["error"]["message"]
    assert c.get("/lab/compare?a=r1").status_code == 400


def test_api_key_leaves_the_page_open_and_guards_the_data(engine, tmp_path):
    c = client(engine, api_keys=("sekret",), reports=(str(tmp_path),))
    assert c.get("/").status_code == 200 and c.get("/web/app.js").status_code == 200
    assert c.get("/lab/reports").status_code == 401 and c.get("/props").status_code == 401
    assert c.get("/lab/reports", headers={"Authorization": "Bearer sekret"}).status_code == 200


def test_no_webui(engine):
    c = client(engine, web_ui=False)
    assert c.get("/").status_code == 404 and c.get("/props").status_code == 404
    assert c.get("/v1/models").status_code == 200


def test_serve_flags_reach_the_config():
    from turbospec.cli.main import build_parser

    a = build_parser().parse_args(["serve", "-m", "x", "--reports", "r1", "--reports", "r2", "--db", "h.sqlite"])
    assert (a.reports, a.db, a.webui) == (["r1", "r2"], "h.sqlite", True)
    assert build_parser().parse_args(["serve", "-m", "x", "--no-webui"]).webui is False


def test_serve_checks_reports_and_db_before_loading(tmp_path, capsys):
    from turbospec.cli.main import main

    assert main(["serve", "-m", str(tmp_path / "no-model"), "--reports", str(tmp_path / "nope")]) == 1
    assert "--reports" in capsys.readouterr().err
    (tmp_path / "x.sqlite").write_text("not a database")
    assert main(["serve", "-m", str(tmp_path / "no-model"), "--db", str(tmp_path / "x.sqlite")]) == 1
    assert "is not a turbospec history database" in capsys.readouterr().err


def test_listing_reads_a_report_again_only_when_it_changes(engine, tmp_path, monkeypatch):
    from turbospec.server import web

    (tmp_path / "b").mkdir()
    path = tmp_path / "b" / "report.json"
    path.write_text(json.dumps(bench_report()))
    reads = []
    real = web._read
    monkeypatch.setattr(web, "_read", lambda p: reads.append(p) or real(p))
    c = client(engine, reports=(str(tmp_path),))
    for _ in range(3):
        assert [r["rows"] for r in c.get("/lab/reports").json()["reports"]] == [4]
    assert len(reads) == 1
    report = bench_report()
    report["rows"] = report["rows"][:2]
    path.write_text(json.dumps(report) + " ")  # another size: changed
    assert [r["rows"] for r in c.get("/lab/reports").json()["reports"]] == [2]
    assert len(reads) == 2
