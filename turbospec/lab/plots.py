"""Every report figure, in one place: `figures(report)` draws the named figures of any lab report (bench, quality,
fit, tco), `save(fig, path)` writes one as PNG or SVG (by the suffix), `svg(fig)` gives the SVG text (the web UI's).

Figures use matplotlib's object API (`Figure` + `FigureCanvasAgg`, no pyplot: nothing is kept once a figure is
dropped), imported only when a figure is drawn. matplotlib still shares state between figures (its mathtext parser,
which lays out the log axes' tick labels, fails when two threads use it at once), so `figures`, `save` and `svg`
draw one at a time (`DRAWING`): a server may call them from several threads. Figure names are the report writers'
file names (`tps_vs_depth` -> tps_vs_depth.png):

* bench (`turbospec.lab.bench.run_local`, `turbospec.lab.client.run_remote`): `tps_vs_depth` (decode t/s vs
  context depth, a line per config or server; with more than one depth), `decode_tps` (a bar per config or
  server; one depth), `acceptance` (draft acceptance rate per row), `acceptance_per_position` (per-position
  acceptance, a line per row that has it);
* quality (`turbospec.lab.quality.run_quality`): `kld` (mean KLD per K/V pair), `kld_vs_bits` (mean and 99th
  percentile KLD against the bits per value of the K/V pair, one labelled point per pair), `retrieval` (accuracy
  vs context length per pair, when the grid ran);
* fit (`turbospec fit --json`): `memory` (the predicted memory parts at the largest context, a stacked bar per
  KV type and mode, the budget as a line), `memory_at_ctx` (the same at `-c`, when given);
* tco (`turbospec tco --format json`): `cost` (monthly cost curves and break-even points, `tco_figure`);
* seeds (`turbospec lab seeds`): `code_prose_tps` (code and prose t/s per engine), `kld_vs_bits` (its KLD rows).

An empty or unknown report has no figures (never an exception).
"""

from __future__ import annotations

import io
import json
import math
import threading
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from turbospec.errors import TurboSpecError

if TYPE_CHECKING:  # pragma: no cover
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from turbospec.lab.tco.pricing import ApiPricing, OnPrem

FORMATS = ("png", "svg")  # what `save` writes
DPI = 110
SIZE = (7.5, 4.4)  # inches
DRAWING = threading.RLock()  # held while a figure is built or written (see the module's doc)


# ---- files ---------------------------------------------------------------------------------------------------
def parse_formats(text: str | Sequence[str] | None) -> tuple[str, ...]:
    """`"png,svg"` (or a list) -> ("png", "svg"); None or empty -> ("png",). TurboSpecError on other names."""
    items = text.split(",") if isinstance(text, str) else list(text or ())
    out: list[str] = []
    for it in items:
        f = it.strip().lower().lstrip(".")
        if not f:
            continue
        if f not in FORMATS:
            raise TurboSpecError(f"plot format {it.strip()!r}: expected {' or '.join(FORMATS)} (a comma list)")
        if f not in out:
            out.append(f)
    return tuple(out) or ("png",)


def save(fig: Figure, path: str | Path) -> Path:
    """Write `fig` to `path`: SVG for a .svg suffix, else PNG (whatever the suffix); parent folders are made."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fmt = "svg" if path.suffix.lower() == ".svg" else "png"
    with DRAWING:
        _canvas(fig)
        fig.savefig(path, format=fmt, dpi=DPI, metadata=_metadata(fmt))
    return path


def svg(fig: Figure) -> str:
    """`fig` as SVG text."""
    buf = io.StringIO()
    with DRAWING:
        _canvas(fig)
        fig.savefig(buf, format="svg", metadata=_metadata("svg"))
    return buf.getvalue()


def write_figures(report: dict[str, Any], out: str | Path, formats: Iterable[str] = ("png",)) -> list[Path]:
    """Every figure of `report` into folder `out` as NAME.FORMAT for each of `formats`; the files written."""
    fmts = parse_formats(list(formats))
    return [save(fig, Path(out) / f"{name}.{f}") for name, fig in figures(report) for f in fmts]


def _metadata(fmt: str) -> dict[str, Any]:
    # no creation date: the same report draws the same bytes
    return {"Date": None} if fmt == "svg" else {}


def _canvas(fig: Figure) -> None:
    """A figure made elsewhere without a canvas gets Agg's (pyplot's backend is never consulted)."""
    from matplotlib.backend_bases import FigureCanvasBase
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    if type(fig.canvas) is FigureCanvasBase:
        FigureCanvasAgg(fig)


def _figure(size: tuple[float, float] = SIZE) -> tuple[Figure, Axes]:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=size, dpi=DPI)
    FigureCanvasAgg(fig)
    return fig, fig.add_subplot(1, 1, 1)


def _finish(fig: Figure, ax: Axes, xlabel: str, ylabel: str, title: str, legend: bool = True) -> Figure:
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if legend and ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def line_figure(series: dict[str, tuple[Sequence[float], Sequence[float]]], xlabel: str, ylabel: str,
                title: str) -> Figure:
    """One line with markers per named (xs, ys) series."""
    fig, ax = _figure()
    if len(series) > 10:  # more lines than the default cycle has colours
        from matplotlib import colormaps

        ax.set_prop_cycle(color=colormaps["tab20"].colors)
    for name, (xs, ys) in series.items():
        ax.plot(xs, ys, marker="o", label=name)
    return _finish(fig, ax, xlabel, ylabel, title)


def bar_figure(labels: Sequence[str], values: Sequence[float], ylabel: str, title: str) -> Figure:
    """One bar per label."""
    fig, ax = _figure()
    ax.bar(range(len(values)), values)
    ax.set_xticks(range(len(values)), labels, rotation=30, ha="right", fontsize=8)
    _finish(fig, ax, "", ylabel, title, legend=False)
    ax.grid(axis="x", visible=False)
    return fig


# ---- report kinds --------------------------------------------------------------------------------------------
def report_kind(report: Any) -> str:
    """'bench', 'quality', 'fit', 'tco', 'seeds' or 'unknown' (also for anything that is not a dict)."""
    if not isinstance(report, dict):
        return "unknown"
    if report.get("kind") == "seeds":
        return "seeds"
    rows = report.get("rows")
    if "perplexity" in report:
        return "quality"
    if "onprem" in report and "apis" in report:
        return "tco"
    if "mem_bytes" in report or (isinstance(rows, list) and rows and isinstance(rows[0], dict)
                                 and "breakdown" in rows[0]):
        return "fit"
    if isinstance(rows, list) and ("env" in report or "settings" in report
                                   or any(isinstance(r, dict) and "decode_tps" in r for r in rows)):
        return "bench"
    return "unknown"


def figures(report: Any, only: Iterable[str] | None = None) -> list[tuple[str, Figure]]:
    """The named figures of a report of any kind (see the module's doc), or only those named in `only`; [] for an
    empty or unknown one. A figure whose data is missing or malformed is left out rather than raising."""
    builders = {"bench": BENCH, "quality": QUALITY, "fit": FIT, "tco": TCO, "seeds": SEEDS}.get(report_kind(report), [])
    wanted = None if only is None else set(only)
    out: list[tuple[str, Figure]] = []
    for name, build in builders:
        if wanted is not None and name not in wanted:
            continue
        try:
            with DRAWING:
                fig = build(report)
        except (KeyError, TypeError, ValueError, AttributeError, ZeroDivisionError, IndexError):
            fig = None
        if fig is not None:
            out.append((name, fig))
    return out


# ---- bench ---------------------------------------------------------------------------------------------------
def _rows(report: dict[str, Any], key: str = "rows") -> list[dict[str, Any]]:
    rows = report.get(key) or []
    return [r for r in rows if isinstance(r, dict)]


def _num(v: Any) -> float | None:
    try:
        x = float(v)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


def _bench_label(r: dict[str, Any], rows: list[dict[str, Any]], depth: bool = False) -> str:
    """The row's config (a server report: its engine), its prompt category when the report has several, its
    depth when asked and the report has several."""
    name = str(r.get("engine") or r.get("config", "default"))
    if len({x.get("category") for x in rows}) > 1:
        name += f" [{r.get('category')}]"
    if depth and len({x.get("depth", 0) for x in rows}) > 1:
        name += f" d={r.get('depth', 0)}"
    return name


def bench_tps_vs_depth(report: dict[str, Any]) -> Figure | None:
    rows = [r for r in _rows(report) if _num(r.get("decode_tps")) is not None]
    if len({r.get("depth", 0) for r in rows}) < 2:
        return None
    fig, ax = _figure()
    series: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        series.setdefault(_bench_label(r, rows), []).append(r)
    for name, rs in series.items():
        rs = sorted(rs, key=lambda r: r.get("depth", 0))
        xs = [r.get("depth", 0) for r in rs]
        ys = [float(r["decode_tps"]) for r in rs]
        lo = [_num(r.get("decode_tps_min")) for r in rs]
        hi = [_num(r.get("decode_tps_max")) for r in rs]
        if all(v is not None for v in lo + hi):
            err = [[y - v for y, v in zip(ys, lo)], [v - y for y, v in zip(ys, hi)]]
            ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, label=name)
        else:
            ax.plot(xs, ys, marker="o", label=name)
    ax.set_ylim(bottom=0)
    return _finish(fig, ax, "context depth (tokens)", "decode t/s (median, min-max)", "decode speed vs depth")


def bench_decode_tps(report: dict[str, Any]) -> Figure | None:
    rows = [r for r in _rows(report) if _num(r.get("decode_tps")) is not None]
    if not rows or len({r.get("depth", 0) for r in rows}) > 1:  # several depths: tps_vs_depth
        return None
    return bar_figure([_bench_label(r, rows) for r in rows], [float(r["decode_tps"]) for r in rows],
                      "decode t/s (median)", "decode speed")


def bench_acceptance(report: dict[str, Any]) -> Figure | None:
    rows = _rows(report)
    acc = [r for r in rows if _num(r.get("acc_rate")) is not None]
    if not acc:
        return None
    return bar_figure([_bench_label(r, rows, depth=True) for r in acc], [float(r["acc_rate"]) for r in acc],
                      "acceptance rate", "draft acceptance")


def _per_pos(v: Any) -> list[float]:
    if isinstance(v, str):  # a row read back from report.csv
        try:
            v = json.loads(v)
        except ValueError:
            return []
    if not isinstance(v, (list, tuple)):
        return []
    vals = [_num(x) for x in v]
    return [x for x in vals if x is not None] if all(x is not None for x in vals) else []


def bench_acceptance_per_position(report: dict[str, Any]) -> Figure | None:
    rows = _rows(report)
    have = [(r, _per_pos(r.get("per_pos"))) for r in rows]
    have = [(r, p) for r, p in have if p]
    if not have:
        return None
    fig, ax = _figure()
    for r, p in have:
        ax.plot(range(1, len(p) + 1), p, marker="o", label=_bench_label(r, rows, depth=True))
    ax.set_ylim(0, 1.05)
    longest = max(len(p) for _, p in have)
    ax.set_xlim(0.5, longest + 0.5)
    if longest <= 24:
        ax.set_xticks(range(1, longest + 1))
    else:
        ax.xaxis.get_major_locator().set_params(integer=True)
    return _finish(fig, ax, "draft position", "acceptance rate", "acceptance per draft position")


BENCH: list[tuple[str, Callable[[dict[str, Any]], Figure | None]]] = [
    ("tps_vs_depth", bench_tps_vs_depth), ("decode_tps", bench_decode_tps), ("acceptance", bench_acceptance),
    ("acceptance_per_position", bench_acceptance_per_position),
]


# ---- quality -------------------------------------------------------------------------------------------------
def bits_per_value(kv: str) -> float | None:
    """Bits per stored value of a KV format (`turbospec.kv.formats`: q8_0 8.5, f16 16) or of a K/V pair `K/V`
    (the mean of the two: K and V hold as many values); None for an unknown name."""
    from turbospec.kv.formats import get_format

    names = str(kv).split("/")
    try:
        bits = [get_format(n.strip()).bits_per_value for n in names]
    except ValueError:
        return None
    return sum(bits) / len(bits)


def quality_kld(report: dict[str, Any]) -> Figure | None:
    rows = [r for r in _rows(report, "perplexity") if _num(r.get("kld_mean")) is not None]
    if not rows:
        return None
    return bar_figure([f"{r.get('kv')} @{r.get('ctx')}" for r in rows], [float(r["kld_mean"]) for r in rows],
                      "mean KLD vs baseline", "KLD per KV type")


def quality_kld_vs_bits(report: dict[str, Any]) -> Figure | None:
    rows = [(r, bits_per_value(r.get("kv", ""))) for r in _rows(report, "perplexity")
            if _num(r.get("kld_mean")) is not None]
    rows = [(r, b) for r, b in rows if b is not None]
    if not rows:
        return None
    fig, ax = _figure()
    ctxs = sorted({r.get("ctx") for r, _ in rows}, key=str)
    positive = [v for r, _ in rows for v in (_num(r.get("kld_mean")), _num(r.get("kld_p99"))) if v and v > 0]
    for i, ctx in enumerate(ctxs):
        pts = sorted(((b, r) for r, b in rows if r.get("ctx") == ctx), key=lambda p: p[0])
        color = f"C{i % 10}"
        suffix = f" @{ctx}" if len(ctxs) > 1 else ""
        xs = [b for b, _ in pts]
        ax.plot(xs, [float(r["kld_mean"]) for _, r in pts], ls="none", marker="o", color=color,
                label=f"mean KLD{suffix}")
        p99 = [(b, _num(r.get("kld_p99"))) for b, r in pts]
        p99 = [(b, v) for b, v in p99 if v is not None]
        if p99:
            ax.plot([b for b, _ in p99], [v for _, v in p99], ls="none", marker="^", mfc="none", color=color,
                    label=f"KLD 99th percentile{suffix}")
        for b, r in pts:
            ax.annotate(f"{r.get('kv')}{suffix}", (b, float(r["kld_mean"])), textcoords="offset points",
                        xytext=(5, 4), fontsize=7, color=color)
    if positive:  # KLD spans decades, and the baseline's is 0: linear near 0, logarithmic above
        ax.set_yscale("symlog", linthresh=min(positive))
    ax.set_xlim(left=0)
    return _finish(fig, ax, "bits per value (mean of K and V)", "KLD vs baseline (nats)",
                   "KLD vs KV bits per value")


def quality_retrieval(report: dict[str, Any]) -> Figure | None:
    rows = [r for r in _rows(report, "retrieval") if _num(r.get("accuracy")) is not None]
    if not rows:
        return None
    acc: dict[str, dict[int, list[float]]] = {}
    for r in rows:
        acc.setdefault(str(r.get("kv")), {}).setdefault(int(r.get("length", 0)), []).append(float(r["accuracy"]))
    series = {kv: (sorted(by), [sum(by[n]) / len(by[n]) for n in sorted(by)]) for kv, by in acc.items()}
    fig = line_figure(series, "context length (tokens)", "accuracy (mean over depths and kinds)",
                      "retrieval accuracy")
    fig.axes[0].set_ylim(-0.05, 1.05)
    return fig


QUALITY: list[tuple[str, Callable[[dict[str, Any]], Figure | None]]] = [
    ("kld", quality_kld), ("kld_vs_bits", quality_kld_vs_bits), ("retrieval", quality_retrieval),
]


# ---- fit -----------------------------------------------------------------------------------------------------
def _memory_figure(items: list[tuple[str, dict[str, Any]]], budget: float | None, title: str) -> Figure | None:
    from turbospec.lab.fit.render import COLUMNS

    parts = [(k, t) for k, t in COLUMNS if k not in ("experts_on_disk", "load_peak")
             and any(_num(b.get(k)) for _, b in items)]
    if not items or not parts:
        return None
    gib = 2.0 ** 30
    fig, ax = _figure((8.5, max(2.6, 1.0 + 0.42 * len(items))))
    ys = list(range(len(items)))
    left = [0.0] * len(items)
    for i, (key, label) in enumerate(parts):
        vals = [(_num(b.get(key)) or 0.0) / gib for _, b in items]
        ax.barh(ys, vals, left=left, label=label, color=f"C{i % 10}", hatch="//" if i >= 10 else None)
        left = [a + v for a, v in zip(left, vals)]
    peaks = [((_num(b.get("load_peak")) or 0.0) / gib, y) for (_, b), y in zip(items, ys)]
    peaks = [(p, y) for (p, y), base in zip(peaks, left) if p > base]
    if peaks:
        ax.plot([p for p, _ in peaks], [y for _, y in peaks], ls="none", marker="|", ms=14, color="black",
                label="load peak")
    if budget:
        ax.axvline(budget / gib, color="red", ls="--", lw=1.2, label="budget")
    ax.set_yticks(ys, [name for name, _ in items], fontsize=8)
    ax.invert_yaxis()
    _finish(fig, ax, "GiB", "", title, legend=False)
    ax.grid(axis="y", visible=False)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    return fig


def fit_memory(report: dict[str, Any]) -> Figure | None:
    from turbospec.lab.fit.units import fmt_ctx

    items = [(f"{r.get('kv_type')} {r.get('mode')}: {fmt_ctx(int(r.get('max_ctx') or 0))}", r["breakdown"])
             for r in _rows(report) if isinstance(r.get("breakdown"), dict)]
    return _memory_figure(items, _num(report.get("mem_bytes")),
                          f"{report.get('model', 'model')}: memory at the largest context that fits")


def fit_memory_at_ctx(report: dict[str, Any]) -> Figure | None:
    rows = [r for r in _rows(report) if isinstance(r.get("at_ctx"), dict)]
    if not rows:
        return None
    ctx = rows[0]["at_ctx"].get("ctx")
    items = [(f"{r.get('kv_type')} {r.get('mode')}: {'fits' if r['at_ctx'].get('fits') else 'NO'}", r["at_ctx"])
             for r in rows]
    return _memory_figure(items, _num(report.get("mem_bytes")),
                          f"{report.get('model', 'model')}: memory at {ctx} tokens")


FIT: list[tuple[str, Callable[[dict[str, Any]], Figure | None]]] = [
    ("memory", fit_memory), ("memory_at_ctx", fit_memory_at_ctx),
]


# ---- tco -----------------------------------------------------------------------------------------------------
def tco_figure(onprem: OnPrem, apis: Sequence[ApiPricing], tokens: Sequence[float] | None = None,
               currency: str = "", claimed: dict[str, dict[float, float]] | None = None,
               title: str | None = None) -> Figure:
    """Monthly cost curves (log-log), break-even markers, per-unit capacity, and optionally the published points
    ``claimed[api_name][tokens] = cost`` as hollow markers."""
    from turbospec.lab.tco.cost import api_monthly_cost, break_even_summary, onprem_monthly_cost, token_grid
    from turbospec.lab.tco.report import fmt_tokens

    claimed = claimed or {}
    bes = break_even_summary(onprem, apis)
    if tokens is None:
        points = [v for be in bes.values() for v in be.values() if v] + [t for c in claimed.values() for t in c]
        hi = max([1e9, *(2 * v for v in points)])
        tokens = token_grid(1e6, hi, 400)
    fig, ax = _figure((9, 5.5))
    cur = f" ({currency})" if currency else ""
    total = [onprem_monthly_cost(onprem, t) for t in tokens]
    hw = [onprem_monthly_cost(onprem, t, include_maintenance=False) for t in tokens]
    ax.plot(tokens, total, color="black", lw=2, label=f"{onprem.name}: hw + power + maintenance")
    ax.plot(tokens, hw, color="black", lw=1.5, ls="--", label=f"{onprem.name}: hw + power")
    colors = ["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown"]
    for i, api in enumerate(apis):
        c = colors[i % len(colors)]
        ax.plot(tokens, [api_monthly_cost(api, t) for t in tokens], color=c, lw=1.8,
                label=f"{api.name} ({api.in_price:g}/{api.out_price:g} USD per 1M, {api.in_ratio:.0%} input)")
        for key, marker in (("hw_power", "o"), ("total", "s")):
            t = bes[api.name][key]
            if t is not None and tokens[0] <= t <= tokens[-1]:
                ax.plot([t], [api_monthly_cost(api, t)], marker=marker, color=c, ms=7)
                ax.annotate(fmt_tokens(t), (t, api_monthly_cost(api, t)), textcoords="offset points",
                            xytext=(6, -12), fontsize=8, color=c)
        if api.name in claimed:
            xs = sorted(claimed[api.name])
            ax.plot(xs, [claimed[api.name][x] for x in xs], ls="none", marker="D", mfc="none", color=c, ms=7,
                    label=f"{api.name}: seeds' published column")
    ax.set_xscale("log")
    ax.set_yscale("log")
    if onprem.capacity is not None and tokens[0] <= onprem.capacity <= tokens[-1]:
        ax.axvline(onprem.capacity, color="gray", lw=1, ls=":")
        ax.text(onprem.capacity, 0.03, f" 1 unit full at {onprem.tps:.4g} t/s", rotation=90, fontsize=8,
                color="gray", transform=ax.get_xaxis_transform(), ha="right", va="bottom")
    ax.set_xlabel("tokens per month (input + output)")
    ax.set_ylabel(f"cost per month{cur}")
    ax.set_title(title or "Monthly cost: on-prem vs API (o: break-even hw+power, s: with maintenance)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    return fig


def tco_cost(report: dict[str, Any]) -> Figure | None:
    """`tco_figure` of a `turbospec tco --format json` document."""
    from dataclasses import fields

    from turbospec.lab.tco.pricing import ApiPricing, OnPrem

    def build(cls, d: dict[str, Any]):
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    onprem = build(OnPrem, report["onprem"])
    apis = [build(ApiPricing, a) for a in report["apis"]]
    claimed = {name: {float(t): float(v) for t, v in c.items()} for name, c in (report.get("claimed") or {}).items()}
    return tco_figure(onprem, apis, currency=report.get("currency") or "", claimed=claimed)


TCO: list[tuple[str, Callable[[dict[str, Any]], Figure | None]]] = [("cost", tco_cost)]


# ---- seeds (`turbospec lab seeds`) -----------------------------------------------------------------------------
def seeds_tps(report: dict[str, Any]) -> Figure | None:
    """Code and prose decode t/s side by side, a pair of bars per engine row (its K/V pair in the label)."""
    rows = [r for r in _rows(report) if _num(r.get("code_tps")) is not None or _num(r.get("prose_tps")) is not None]
    if not rows:
        return None
    fig, ax = _figure()
    xs = range(len(rows))
    for shift, key, name in ((-0.2, "code_tps", "code"), (0.2, "prose_tps", "prose")):
        ax.bar([x + shift for x in xs], [_num(r.get(key)) or 0.0 for r in rows], width=0.4, label=name)
    ax.set_xticks(list(xs), [f"{r.get('label', r.get('config', ''))}\n{r.get('kv', '')}" for r in rows],
                  rotation=20, ha="right", fontsize=8)
    _finish(fig, ax, "", "decode t/s (median, depth 0)", "code vs prose decode speed")
    ax.grid(axis="x", visible=False)
    return fig


SEEDS: list[tuple[str, Callable[[dict[str, Any]], Figure | None]]] = [
    ("code_prose_tps", seeds_tps), ("kld_vs_bits", lambda r: quality_kld_vs_bits({"perplexity": r.get("kld") or []})),
]
