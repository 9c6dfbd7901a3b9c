"""Decode t/s against context depth, a line per configuration (turbospec's KV types, with and without MTP, and
llama.cpp's), from `kv_bench_cli.py` results files (medians per depth; a later file's rows replace an earlier one's
at the same configuration and depth). Also reads the per-round log `kv_bench_cli.py` printed before it wrote results
per depth (lines `depth D round R: name t/s, name t/s, ...`; the median over rounds), and `served_speed.py --depth`
results files (a line per configuration; llama-server's named `llama.cpp CONFIG`).

    python benchmarks/plot_depth.py docs/results/kv_depth_hybrid_llama.json docs/results/kv_depth_hybrid_llama_32k.json \
        --title "bundled hybrid, float16" --out docs/results/depth/hybrid.png
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from turbospec.lab import plots  # noqa: E402

LOG_LINE = re.compile(r"^depth (\d+) round \d+: (.*)$")


def read(path: Path) -> dict[tuple[str, int], float]:
    """(configuration, depth) -> decode t/s of one results file or log."""
    if path.suffix == ".json":
        data = json.loads(path.read_text())
        if "summary" in data:  # served_speed.py --depth: a line per configuration and side
            depth = int(data["meta"].get("depth") or 0)
            return {(served_name(r["config"], r["side"]), depth): float(r["decode_tps"]) for r in data["summary"]
                    if r.get("decode_tps")}
        return {(r["type"], int(r["depth"])): float(r["decode_tps"]) for r in data["rows"] if r.get("decode_tps")}
    runs: dict[tuple[str, int], list[float]] = {}
    for line in path.read_text().splitlines():
        m = LOG_LINE.match(line.strip())
        if not m:
            continue
        for item in m.group(2).split(","):
            name, _, tps = item.strip().rpartition(" ")
            runs.setdefault((name, int(m.group(1))), []).append(float(tps))
    return {k: statistics.median(v) for k, v in runs.items()}


def served_name(config: str, side: str) -> str:
    """A served_speed.py configuration's line: llama-server's prefixed `llama.cpp` (drawn dashed)."""
    return f"llama.cpp {config}" if side == "llama-server" else config if side == "turbospec serve" else \
        f"{config} ({side})"


def depth_label(d: int) -> str:
    return f"{d // 1024}K" if d and d % 1024 == 0 else str(d)


def figure(points: dict[tuple[str, int], float], title: str):
    """Decode t/s (log scale) at each depth, evenly spaced, one line per configuration (llama.cpp's dashed)."""
    depths = sorted({d for _, d in points})
    series = {}
    for name in dict.fromkeys(n for n, _ in points):
        ds = [d for d in depths if (name, d) in points]
        series[name] = ([depths.index(d) for d in ds], [points[(name, d)] for d in ds])
    fig = plots.line_figure(series, "context depth (tokens)", "decode t/s (log scale)", title)
    from matplotlib.ticker import FuncFormatter

    ax = fig.axes[0]
    ax.set_yscale("log")
    plain = FuncFormatter(lambda v, _: f"{v:g}")
    ax.yaxis.set_major_formatter(plain)
    ax.yaxis.set_minor_formatter(plain)
    ax.tick_params(axis="y", which="minor", labelsize=7)
    ax.set_xticks(range(len(depths)), [depth_label(d) for d in depths])
    for line in ax.get_lines():
        if line.get_label().startswith("llama.cpp"):
            line.set_linestyle("--")
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", nargs="+", help="kv_bench_cli.py results files (.json) or its per-round log")
    ap.add_argument("--title", default="decode t/s against context depth")
    ap.add_argument("--out", required=True, help="the figure (.png or .svg)")
    a = ap.parse_args()
    points: dict[tuple[str, int], float] = {}
    for p in a.results:
        points.update(read(Path(p)))
    if not points:
        print("no decode rows in the results given", file=sys.stderr)
        return 1
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    print(f"wrote {plots.save(figure(points, a.title), a.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
