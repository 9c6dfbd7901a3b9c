"""Run history (turbospec.lab.history): recording bench reports in SQLite, finding runs by id or git revision,
comparing two runs, and the `turbospec bench --db / history / compare` command line."""

import json
import sqlite3
import subprocess

import pytest

from turbospec.cli.main import build_parser, main
from turbospec.errors import TurboSpecError
from turbospec.lab import history


def row(config="default", depth=0, category="random", **metrics):
    """A bench row: each metric given as (median, min, max)."""
    r = {"config": config, "depth": depth, "category": category, "n_prompt": 8, "n_gen": 4}
    for key, v in metrics.items():
        if isinstance(v, tuple):
            r[key], r[f"{key}_min"], r[f"{key}_max"] = v
            r[f"{key}_sd"] = (v[2] - v[1]) / 2
        else:
            r[key] = v
    return r


def report(commit="abc1234", rows=(), model="tiny"):
    env = {"cpu": "Test CPU", "cores": 2, "turbospec": "9.9.9", "git_commit": commit, "model": model,
           "torch": "2.x", "python": "3.11"}
    settings = {"model": model, "sweep": ["spec-type=none,ngram"], "depth": "0,8", "n_prompt": 8, "n_gen": 4,
                "repetitions": 3, "out": "o"}
    return {"env": env, "settings": settings, "rows": list(rows)}


A_ROWS = [
    row(prefill_tps=(100.0, 90.0, 110.0), decode_tps=(50.0, 48.0, 52.0), ttft_ms=(10.0, 9.0, 11.0), acc_rate=0.5,
        per_pos=[0.7, 0.3], peak_rss_mib=12.5),
    row(depth=8, prefill_tps=(80.0, 75.0, 85.0), decode_tps=(40.0, 39.0, 41.0), ttft_ms=(12.0, 11.0, 13.0)),
]
B_ROWS = [
    row(prefill_tps=(80.0, 70.0, 85.0), decode_tps=(60.0, 55.0, 65.0), ttft_ms=(10.5, 9.5, 12.0), acc_rate=0.4,
        per_pos=[0.6, 0.2], peak_rss_mib=13.0),
    row(config="spec-type=ngram", prefill_tps=(80.0, 75.0, 85.0), decode_tps=(40.0, 39.0, 41.0),
        ttft_ms=(12.0, 11.0, 13.0)),
]


@pytest.fixture
def db(tmp_path):
    path = tmp_path / "h.sqlite"
    history.record(path, report("abc1234", A_ROWS))
    history.record(path, report("def5678", B_ROWS), note="after the change")
    return path


def test_record_keeps_every_field(db):
    run = history.load_run(db, 1)
    assert run["rows"] == A_ROWS and run["env"]["cpu"] == "Test CPU"
    assert run["settings"]["sweep"] == ["spec-type=none,ngram"]
    assert run["id"] == 1 and run["kind"] == "bench" and run["git_commit"] == "abc1234"
    assert run["version"] == "9.9.9" and run["machine"] == "Test CPU, 2 cores"
    assert history.load_run(db, 2)["note"] == "after the change"
    with pytest.raises(TurboSpecError, match="no run 7"):
        history.load_run(db, 7)


def test_list_runs_newest_first(db):
    runs = history.list_runs(db)
    assert [r["id"] for r in runs] == [2, 1]
    r = runs[1]
    assert (r["kind"], r["version"], r["git_commit"], r["n_rows"]) == ("bench", "9.9.9", "abc1234", 2)
    assert r["settings"]["model"] == "tiny" and r["settings"]["sweep"] == ["spec-type=none,ngram"]
    assert "--sweep spec-type=none,ngram" in r["settings"]["text"] and "-d 0,8" in r["settings"]["text"]
    assert r["created"][:2] == "20" and "T" in r["created"]


def test_compare_verdicts(db):
    lines = history.compare(db, "1", "2")
    by = {(x["config"], x["depth"], x["metric"]): x for x in lines}
    prefill = by[("default", 0, "prefill_tps")]
    assert prefill["verdict"] == "slower" and prefill["change_pct"] == pytest.approx(-20.0)
    assert (prefill["a_median"], prefill["a_min"], prefill["a_max"]) == (100.0, 90.0, 110.0)
    assert (prefill["b_median"], prefill["b_min"], prefill["b_max"], prefill["band"]) == (80.0, 70.0, 85.0,
                                                                                         "min-max")
    assert by[("default", 0, "decode_tps")]["verdict"] == "faster"
    assert by[("default", 0, "ttft_ms")]["verdict"] == "same (within noise)"
    assert by[("default", 0, "acc_rate")]["verdict"] == "lower"  # no spread recorded: medians
    assert by[("default", 8, None)]["verdict"] == "only in A"
    assert by[("spec-type=ngram", 0, None)]["verdict"] == "only in B"
    assert history.summary(lines) == "1 slower, 1 faster, 1 same, 1 lower acceptance, 1 only in A, 1 only in B"
    # the reverse comparison: B is the baseline
    back = {(x["config"], x["depth"], x["metric"]): x["verdict"] for x in history.compare(db, "2", "1")}
    assert back[("default", 0, "prefill_tps")] == "faster" and back[("default", 0, "acc_rate")] == "higher"


def test_ttft_lower_is_better(tmp_path):
    path = tmp_path / "t.sqlite"
    history.record(path, report(rows=[row(ttft_ms=(10.0, 9.0, 11.0))]))
    history.record(path, report(rows=[row(ttft_ms=(20.0, 18.0, 25.0))]))
    history.record(path, report(rows=[row(ttft_ms=(5.0, 4.0, 6.0))]))
    assert [x["verdict"] for x in history.compare(path, "1", "2")] == ["slower"]
    assert [x["verdict"] for x in history.compare(path, "1", "3")] == ["faster"]


def test_server_rows_match_by_engine_and_use_sd(tmp_path):
    """Server rows (turbospec.lab.client) have an engine and no min/max: median +- sd is the range."""
    def server(url, ttft, sd, tps):
        return {"engine": url, "config": "server", "depth": 0, "category": "code", "ttft_ms": ttft,
                "ttft_ms_sd": sd, "ttft_ms_p99": ttft + sd, "decode_tps": tps, "itl_p99_ms": 3.0}

    path = tmp_path / "s.sqlite"
    history.record(path, report(rows=[server("http://a/v1", 100.0, 5.0, 40.0), server("http://b/v1", 50.0, 1.0, 9.0)]))
    history.record(path, report(rows=[server("http://a/v1", 140.0, 5.0, 40.0), server("http://b/v1", 51.0, 1.0, 8.0)]))
    got = {(x["engine"], x["metric"]): x for x in history.compare(path, 1, 2)}
    assert got[("http://a/v1", "ttft_ms")]["verdict"] == "slower" and got[("http://a/v1", "ttft_ms")]["band"] == "sd"
    assert got[("http://b/v1", "ttft_ms")]["verdict"] == "same (within noise)"
    assert got[("http://a/v1", "decode_tps")]["verdict"] == "same (within noise)"  # equal medians, no spread
    assert got[("http://b/v1", "decode_tps")]["verdict"] == "no spread recorded"
    assert got[("http://b/v1", "decode_tps")]["band"] is None
    assert ("http://a/v1", "prefill_tps") not in got  # not measured by either


def test_resolve_by_id_and_commit(db, tmp_path):
    assert history.resolve(db, "1") == 1 and history.resolve(db, "#2") == 2 and history.resolve(db, 2) == 2
    assert history.resolve(db, "abc1") == 1 and history.resolve(db, "DEF5678") == 2
    history.record(db, report("abc1234", A_ROWS))  # the newest run of a commit wins
    assert history.resolve(db, "abc12") == 3
    assert history.resolve(db, "abc1234" + "0" * 33) == 3  # a full hash finds its recorded short hash
    history.record(db, report("abc1999", A_ROWS))
    with pytest.raises(TurboSpecError, match="'abc1' is ambiguous.*abc1234, abc1999"):
        history.resolve(db, "abc1")
    assert history.resolve(db, "abc19") == 4
    with pytest.raises(TurboSpecError, match="unknown run 'abc'"):
        history.resolve(db, "abc")  # too short for a hash prefix
    with pytest.raises(TurboSpecError, match="unknown run 'nope'.*runs 1-4"):
        history.resolve(db, "nope")
    with pytest.raises(TurboSpecError, match="no run #9"):
        history.resolve(db, "#9")
    with pytest.raises(TurboSpecError, match="unknown run '99'"):
        history.resolve(db, "99")
    # numbers SQLite cannot hold, and other scripts' digits: not run ids (an error, not OverflowError)
    for ref in ("9" * 30, "#" + "9" * 30, "\u0661", "#\u0661"):
        with pytest.raises(TurboSpecError):
            history.resolve(db, ref)


def test_resolve_git_revision(tmp_path, monkeypatch):
    repo = tmp_path / "repo"
    repo.mkdir()

    def git(*args):
        return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo, check=True,
                              capture_output=True, text=True).stdout.strip()

    git("init", "-q")
    git("commit", "-q", "--allow-empty", "-m", "one")
    first = git("rev-parse", "--short", "HEAD")
    git("commit", "-q", "--allow-empty", "-m", "two")
    second = git("rev-parse", "--short", "HEAD")
    git("tag", "v1", first)
    git("commit", "-q", "--allow-empty", "-m", "three")  # no run recorded at this one
    path = tmp_path / "g.sqlite"
    history.record(path, report(first, A_ROWS))
    history.record(path, report(second, B_ROWS))
    monkeypatch.chdir(repo)
    assert history.resolve(path, "HEAD~2") == 1 and history.resolve(path, "v1") == 1
    assert history.resolve(path, "HEAD~1") == 2
    with pytest.raises(TurboSpecError, match="is commit .* but no run"):
        history.resolve(path, "HEAD")
    assert {x["verdict"] for x in history.compare(path, "v1", "HEAD~1")} >= {"slower", "faster"}


def test_missing_and_foreign_files(tmp_path):
    missing = tmp_path / "none.sqlite"
    for call in (lambda: history.list_runs(missing), lambda: history.load_run(missing, 1),
                 lambda: history.resolve(missing, "1"), lambda: history.compare(missing, "1", "2")):
        with pytest.raises(TurboSpecError, match="no history database"):
            call()
    assert not missing.exists()  # reading never creates the file

    junk = tmp_path / "junk.sqlite"
    junk.write_text("not a database at all, " * 100)
    for call in (lambda: history.list_runs(junk), lambda: history.record(junk, report(rows=A_ROWS))):
        with pytest.raises(TurboSpecError, match="junk.sqlite is not a turbospec history database"):
            call()
    assert junk.read_text().startswith("not a database")

    other = tmp_path / "other.sqlite"
    with sqlite3.connect(other) as con:
        con.execute("CREATE TABLE t (x)")
    con.close()
    for call in (lambda: history.list_runs(other), lambda: history.record(other, report(rows=A_ROWS))):
        with pytest.raises(TurboSpecError, match="is not a turbospec history database"):
            call()

    empty = tmp_path / "empty.sqlite"
    empty.touch()
    with pytest.raises(TurboSpecError, match="is not a turbospec history database"):
        history.list_runs(empty)
    assert history.record(empty, report(rows=A_ROWS)) == 1  # an empty file is a new history


def test_schema_is_versioned(db):
    with sqlite3.connect(db) as con:
        assert con.execute("PRAGMA user_version").fetchone()[0] == history.SCHEMA_VERSION
        assert con.execute("PRAGMA application_id").fetchone()[0] == history.APPLICATION_ID
        con.execute(f"PRAGMA user_version = {history.SCHEMA_VERSION + 1}")
    con.close()
    with pytest.raises(TurboSpecError, match="newer than this turbospec reads"):
        history.list_runs(db)


def test_schema_migrates_on_open(db, monkeypatch):
    """An older file is upgraded by MIGRATIONS when opened (here: a fake version 0 -> 1 step)."""
    with sqlite3.connect(db) as con:
        con.execute("PRAGMA user_version = 0")
    con.close()
    steps = []
    monkeypatch.setitem(history.MIGRATIONS, 0, lambda con: steps.append(con.execute("SELECT 1").fetchone()))
    assert len(history.list_runs(db)) == 2 and steps == [(1,)]
    with sqlite3.connect(db) as con:
        assert con.execute("PRAGMA user_version").fetchone()[0] == history.SCHEMA_VERSION
    con.close()


def test_bench_parser_keeps_measuring_invocations():
    ap = build_parser()
    a = ap.parse_args(["bench", "-m", "x", "-p", "8", "--db", "h.sqlite"])
    assert a.func.__name__ == "run" and a.db == "h.sqlite"
    c = ap.parse_args(["bench", "compare", "HEAD~1", "7", "--db", "h.sqlite"])
    assert (c.func.__name__, c.a, c.b, c.db) == ("show_compare", "HEAD~1", "7", "h.sqlite")
    assert ap.parse_args(["bench", "history", "--db", "h"]).func.__name__ == "show_history"


def test_cli_compare_and_history(db, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "220")
    assert main(["bench", "compare", "abc1234", "2", "--db", str(db)]) == 0
    out = capsys.readouterr().out
    assert "1 slower, 1 faster, 1 same, 1 lower acceptance, 1 only in A, 1 only in B" in out
    assert "90.00-110.0" in out and "-20.0%" in out and "slower" in out and "only in B" in out
    assert main(["bench", "history", "--db", str(db)]) == 0
    out = capsys.readouterr().out
    assert "abc1234" in out and "def5678" in out and "after the change" in out and "2 runs" in out
    assert main(["bench", "compare", "1", "nope", "--db", str(db)]) == 1
    assert "error: unknown run 'nope'" in capsys.readouterr().err
    assert main(["bench", "history", "--db", str(db.parent / "missing.sqlite")]) == 1
    assert "error: no history database" in capsys.readouterr().err


def test_bench_run_is_recorded(tmp_path, capsys):
    from turbospec.demo import make_demo_model

    tiny = make_demo_model(tmp_path / "m", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=300)
    path = tmp_path / "runs" / "h.sqlite"
    rc = main(["bench", "-m", str(tiny), "-p", "8", "-n", "4", "-r", "1", "--warmup", "0", "-t", "1",
               "--out", str(tmp_path / "o"), "--db", str(path), "--note", "first", "-q"])
    assert rc == 0
    assert f"recorded run 1 in {path}" in capsys.readouterr().err
    (run,) = history.list_runs(path)
    assert run["note"] == "first" and run["n_rows"] == 1 and run["settings"]["model"] == str(tiny)
    loaded = history.load_run(path, 1)
    written = json.loads((tmp_path / "o" / "report.json").read_text())
    assert loaded["rows"] == written["rows"] and loaded["env"] == written["env"]
    assert loaded["env"]["cpu"] in run["machine"] and loaded["version"] == loaded["env"]["turbospec"]


def test_threshold_calls_small_shifts_same(tmp_path):
    """Tight ranges that do not overlap but a 2% change: `slower` with no threshold, `same` under the default 3%."""
    path = tmp_path / "t.sqlite"
    history.record(path, report("a", [row(decode_tps=(100.0, 99.9, 100.1))]))
    history.record(path, report("b", [row(decode_tps=(98.0, 97.9, 98.1))]))
    verdicts = {t: [x["verdict"] for x in history.compare(path, "1", "2", threshold_pct=t)
                    if x["metric"] == "decode_tps"] for t in (0.0, history.DEFAULT_THRESHOLD_PCT, 1.5)}
    assert verdicts == {0.0: ["slower"], 3.0: ["same (within noise)"], 1.5: ["slower"]}
    assert [x["verdict"] for x in history.compare(path, "1", "2") if x["metric"] == "decode_tps"] == \
        ["same (within noise)"]
