"""turbospec.lab.plots (figures of every report kind, PNG/SVG files), the writers' --plot-format, bench --url
forms, and the progress bars' terminal rule (issue #30, item 4)."""

from __future__ import annotations

import io
import json
import threading

import pytest

from turbospec.cli.main import build_parser, main
from turbospec.kv.formats import get_format
from turbospec.lab import plots
from turbospec.lab.progress import Progress, interactive, progress

pytest.importorskip("matplotlib")


def bench_report() -> dict:
    rows = []
    for ctk, tps in (("f16", 20.0), ("q8_0", 18.0)):
        for depth in (0, 1024):
            rows.append({"config": f"ctk={ctk}", "ctk": ctk, "depth": depth, "category": "random",
                         "decode_tps": tps - depth / 512, "decode_tps_min": tps - 1 - depth / 512,
                         "decode_tps_max": tps + 1 - depth / 512, "prefill_tps": 100.0, "acc_rate": 0.6,
                         "per_pos": [0.8, 0.6, 0.4]})
    return {"env": {"cpu": "x"}, "settings": {}, "rows": rows}


def server_report() -> dict:
    rows = [{"engine": f"http://127.0.0.1:{p}/v1", "config": "server", "depth": 0, "category": "code",
             "decode_tps": 30.0 + p % 7, "ttft_ms": 50.0} for p in (8080, 8000)]
    rows[0]["acc_rate"] = 0.7
    return {"env": {}, "settings": {}, "rows": rows}


def quality_report() -> dict:
    pairs = ["f16/f16", "q8_0/q8_0", "q4_0/q4_0", "turbo3/turbo3", "q8_0/turbo3"]
    ppl = [{"kv": p, "ctx": 512, "ppl": 10.0 + i, "kld_mean": 0.01 * i, "kld_median": 0.005 * i,
            "kld_p99": 0.1 * i, "kld_max": 0.5 * i} for i, p in enumerate(pairs)]
    ret = [{"kv": p, "kind": "passkey", "length": n, "depth": 0.5, "cases": 2, "accuracy": 1.0 - 0.1 * i}
           for i, p in enumerate(pairs[:2]) for n in (1024, 2048)]
    return {"env": {"model": "m"}, "settings": {}, "perplexity": ppl, "retrieval": ret}


def pair_bits(pair: str) -> float:
    k, v = pair.split("/")
    return (get_format(k).bits_per_value + get_format(v).bits_per_value) / 2


def fit_report(capsys, *extra: str) -> dict:
    assert main(["fit", "--preset", "qwen3.6-27b", "--mem", "24GiB", "--backend", "cuda", "-ctk", "f16,q8_0", "--json",
                 *extra]) == 0
    return json.loads(capsys.readouterr().out)


def names(figs) -> list[str]:
    return [n for n, _ in figs]


def legend_labels(fig) -> list[str]:
    return [t.get_text() for t in fig.axes[0].get_legend().get_texts()]


def test_bench_figures():
    figs = dict(plots.figures(bench_report()))
    assert plots.report_kind(bench_report()) == "bench"
    assert set(figs) == {"tps_vs_depth", "acceptance", "acceptance_per_position"}
    assert legend_labels(figs["tps_vs_depth"]) == ["ctk=f16", "ctk=q8_0"]  # one line per KV type
    ax = figs["acceptance_per_position"].axes[0]
    assert len(ax.get_lines()) == 4 and list(ax.get_lines()[0].get_xdata()) == [1, 2, 3]
    assert names(plots.figures(bench_report(), only=["acceptance", "nope"])) == ["acceptance"]  # the web page's


def test_server_figures_are_per_engine():
    figs = dict(plots.figures(server_report()))
    assert set(figs) == {"decode_tps", "acceptance"}  # one depth: bars, not a depth line
    labels = [t.get_text() for t in figs["decode_tps"].axes[0].get_xticklabels()]
    assert labels == ["http://127.0.0.1:8080/v1", "http://127.0.0.1:8000/v1"]


def test_quality_kld_against_bits_per_value():
    rep = quality_report()
    assert plots.report_kind(rep) == "quality"
    figs = dict(plots.figures(rep))
    assert set(figs) == {"kld", "kld_vs_bits", "retrieval"}
    ax = figs["kld_vs_bits"].axes[0]
    mean, p99 = ax.get_lines()[:2]
    want = sorted(pair_bits(r["kv"]) for r in rep["perplexity"])
    assert list(mean.get_xdata()) == want == list(p99.get_xdata())
    assert want[-1] == 16.0 and pair_bits("q8_0/turbo3") == (8.5 + 3.125) / 2
    assert {t.get_text() for t in ax.texts} == {r["kv"] for r in rep["perplexity"]}  # a labelled point per pair
    assert "bits per value" in ax.get_xlabel()


def test_fit_memory_figure(capsys):
    info = fit_report(capsys, "-c", "8192")
    assert plots.report_kind(info) == "fit"
    figs = dict(plots.figures(info))
    assert set(figs) == {"memory", "memory_at_ctx"}
    ax = figs["memory"].axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()][0].startswith("f16 base")
    assert "weights" in legend_labels(figs["memory"]) and "budget" in legend_labels(figs["memory"])


def test_fit_plot_flag(capsys, tmp_path):
    fit_report(capsys, "-c", "4096", "--plot", str(tmp_path / "mem.svg"))
    assert (tmp_path / "mem.svg").read_text().lstrip().startswith("<?xml")
    assert (tmp_path / "mem_at_ctx.svg").exists()


def test_tco_figure_from_json(capsys):
    assert main(["tco", "--format", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert plots.report_kind(doc) == "tco"
    assert names(plots.figures(doc)) == ["cost"]


@pytest.mark.parametrize("report", [{}, None, [], "x", {"rows": []}, {"env": {}, "settings": {}, "rows": []},
                                    {"perplexity": []}, {"rows": [{"config": "x"}], "env": {}},
                                    {"perplexity": [{"kv": "nope/nope", "kld_mean": "bad"}]}])
def test_empty_or_unknown_reports_have_no_figures(report):
    assert plots.figures(report) == []


def test_figures_drawn_in_threads_are_all_there():
    """The web page asks for a report's plots at once, drawn in the server's threads: matplotlib's mathtext parser
    (the symlog axis's tick labels of kld_vs_bits) failed when used by two threads, and the figure went missing."""
    from matplotlib.mathtext import MathTextParser

    report = {**quality_report(), "retrieval": []}
    want = names(plots.figures(report))
    got: list[list[str]] = []
    for _ in range(10):
        MathTextParser._parse_cached.cache_clear()  # tick labels parsed afresh, by every thread at once
        start = threading.Barrier(4)

        def draw(start: threading.Barrier = start) -> None:
            start.wait()
            figs = plots.figures(report)
            got.append(names(figs))
            for _, fig in figs:
                plots.svg(fig)

        threads = [threading.Thread(target=draw) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert got == [want] * 40


def test_save_png_and_svg(tmp_path):
    fig = plots.figures(bench_report())[0][1]
    png = plots.save(fig, tmp_path / "a" / "f.png")
    svg_file = plots.save(fig, tmp_path / "f.svg")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "<svg" in svg_file.read_text()
    text = plots.svg(fig)
    assert text.startswith("<?xml") and "<svg" in text and "<dc:date>" not in text


def test_parse_formats():
    assert plots.parse_formats("png,svg") == ("png", "svg")
    assert plots.parse_formats(" SVG ,.png,svg") == ("svg", "png")
    assert plots.parse_formats(None) == plots.parse_formats("") == ("png",)
    with pytest.raises(Exception, match="jpg"):
        plots.parse_formats("png,jpg")
    ap = build_parser()
    assert ap.parse_args(["bench", "--plot-format", "png,svg"]).plot_format == ("png", "svg")
    assert ap.parse_args(["quality"]).plot_format == ("png",)
    with pytest.raises(SystemExit):
        ap.parse_args(["bench", "--plot-format", "gif"])


def test_bench_writer_honours_plot_formats(tmp_path):
    from turbospec.lab.bench import write_reports

    files = write_reports(bench_report(), tmp_path / "b", ("png", "svg"))
    for name in ("tps_vs_depth", "acceptance", "acceptance_per_position"):
        assert (tmp_path / "b" / f"{name}.png").exists() and (tmp_path / "b" / f"{name}.svg").exists()
    assert tmp_path / "b" / "tps_vs_depth.svg" in files
    write_reports(bench_report(), tmp_path / "d")  # default: PNG only
    assert (tmp_path / "d" / "tps_vs_depth.png").exists() and not list((tmp_path / "d").glob("*.svg"))


def test_quality_writer_honours_plot_formats(tmp_path):
    from turbospec.lab.quality import QualityOptions, write_reports

    write_reports(quality_report(), tmp_path, QualityOptions(), ("svg",))
    assert (tmp_path / "kld.svg").exists() and (tmp_path / "kld_vs_bits.svg").exists()
    assert not (tmp_path / "kld.png").exists()


def test_tco_plot_formats(tmp_path, capsys):
    assert main(["tco", "--plot", str(tmp_path / "c.png"), "--plot-format", "png,svg"]) == 0
    assert (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG" and "<svg" in (tmp_path / "c.svg").read_text()
    assert main(["tco", "--plot-format", "svg"]) == 1  # needs --plot
    assert main(["tco", "--plot", str(tmp_path / "d.svg")]) == 0  # the suffix chooses
    assert "<svg" in (tmp_path / "d.svg").read_text()


# ---- bench --url: with or without /v1 ------------------------------------------------------------------------
def test_api_base_accepts_both_forms():
    from turbospec.lab.client import api_base, server_root

    for url in ("http://h:8080", "http://h:8080/", "http://h:8080/v1", "http://h:8080/v1/",
                "http://h:8080/v1/completions", " http://h:8080/v1/chat/completions/ "):
        assert api_base(url) == "http://h:8080/v1", url
        assert server_root(url) == "http://h:8080"
    assert api_base("http://h/openai/v1") == "http://h/openai/v1"


def test_run_remote_with_or_without_v1():
    from tests.fake_openai import fake_completions
    from turbospec.lab.client import run_remote
    from turbospec.lab.workload import BenchOptions

    with fake_completions() as (root, _):  # answers /v1/completions only, as turbospec serve
        rep = run_remote([root, root + "/", root + "/v1", root + "/v1/"],
                         BenchOptions(n_prompt=4, n_gen=2, repetitions=1, warmup=0, quiet=True))
    assert [r["engine"] for r in rep["rows"]] == [root + "/v1"] * 4
    assert all(r["out_tps"] > 0 for r in rep["rows"])


# ---- progress bars -----------------------------------------------------------------------------------------
class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_only_on_a_terminal(monkeypatch):
    monkeypatch.setattr("sys.stderr", io.StringIO())
    assert not interactive() and progress(10, "x").disable
    monkeypatch.setattr("sys.stderr", Tty())
    assert interactive()
    bar = progress(10, "x")
    assert not bar.disable
    bar.close()
    assert progress(10, "x", quiet=True).disable


def test_progress_callback(monkeypatch):
    monkeypatch.setattr("sys.stderr", io.StringIO())
    cb = Progress("load")
    cb(1, 4)
    assert cb.bar is None  # not a terminal: nothing drawn
    tty = Tty()
    monkeypatch.setattr("sys.stderr", tty)
    small = Progress("prefill", min_total=4096)
    small(512, 1000)
    assert small.bar is None  # a short prompt: no bar
    with Progress("prefill", min_total=4096) as cb:
        cb(2048, 8192)
        assert cb.bar is not None and cb.bar.n == 2048
        cb(8192, 8192)
        assert cb.bar is None  # closed when done
    assert "prefill" in tty.getvalue()


def test_load_and_prefill_report_progress(tmp_path):
    """The engine reports through callbacks (no bars of its own): tensors while loading, positions while
    prefilling."""
    from turbospec.config import EngineConfig
    from turbospec.demo import make_demo_model
    from turbospec.engine import build_engine

    path = make_demo_model(tmp_path / "m", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=300)
    loads: list[tuple[int, int]] = []
    engine = build_engine(EngineConfig(model=str(path), ctx=64, ubatch=8), lambda d, t: loads.append((d, t)))
    assert loads[-1][0] == loads[-1][1] > 2 and [d for d, _ in loads] == sorted(d for d, _ in loads)
    seen: list[tuple[int, int]] = []
    engine.prefill(list(range(3, 23)), progress=lambda d, n: seen.append((d, n)))
    assert seen == [(8, 20), (16, 20), (20, 20)]


def test_seeds_report_figures():
    """A `lab seeds` report (the stored run) is its own kind: code/prose bars and KLD against bits per value."""
    import json
    from pathlib import Path

    report = json.loads((Path(__file__).resolve().parents[1] / "docs/results/lab_seeds_tiny/report.json").read_text())
    assert plots.report_kind(report) == "seeds"
    figs = dict(plots.figures(report))
    assert set(figs) == {"code_prose_tps", "kld_vs_bits"}
    bars = figs["code_prose_tps"].axes[0].patches
    assert len(bars) == 2 * len(report["rows"])
    assert sorted(round(b.get_height(), 3) for b in bars) == sorted(
        round(r[k], 3) for r in report["rows"] for k in ("code_tps", "prose_tps"))


def test_plot_depth_reads_results_and_logs(tmp_path):
    """benchmarks/plot_depth.py: kv_bench_cli results files and its per-round log (medians), a later file's rows
    replacing an earlier one's, one line per configuration at evenly spaced depths, llama.cpp's dashed."""
    from benchmarks.plot_depth import figure, read

    log = tmp_path / "r.log"
    log.write_text("# header\ndepth 0 round 0: f16 100.0, llama.cpp:f16 80.0\ndepth 0 round 1: f16 120.0, "
                   "llama.cpp:f16 90.0\ndepth 0 round 2: f16 110.0, llama.cpp:f16 70.0\n")
    res = tmp_path / "r.json"
    res.write_text(json.dumps({"rows": [{"type": "f16", "depth": 8192, "decode_tps": 50.0},
                                        {"type": "llama.cpp:f16", "depth": 0, "decode_tps": 99.0},
                                        {"type": "tbq4_0", "depth": 8192, "decode_tps": None}]}))
    points = read(log)
    assert points == {("f16", 0): 110.0, ("llama.cpp:f16", 0): 80.0}
    points.update(read(res))
    assert points == {("f16", 0): 110.0, ("llama.cpp:f16", 0): 99.0, ("f16", 8192): 50.0}
    ax = figure(points, "t").axes[0]
    lines = {ln.get_label(): ln for ln in ax.get_lines()}
    assert list(lines["f16"].get_xdata()) == [0, 1] and list(lines["f16"].get_ydata()) == [110.0, 50.0]
    assert lines["llama.cpp:f16"].get_linestyle() == "--" and lines["f16"].get_linestyle() == "-"
    assert [t.get_text() for t in ax.get_xticklabels()] == ["0", "8K"]
