"""`turbospec bench`: its flags, turned into an `EngineConfig` and `BenchOptions` for turbospec.lab.bench
(local engine) or turbospec.lab.client (`--url`: servers); `--db` records the run in a history file
(turbospec.lab.history), read back by `turbospec bench history` and `turbospec bench compare`."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from turbospec.cli.args import (
    add_model_args,
    add_parallel_arg,
    add_plot_format_arg,
    add_spec_args,
    engine_config,
)
from turbospec.errors import TurboSpecError
from turbospec.lab import bench, client, history
from turbospec.lab.report import console_table
from turbospec.lab.workload import DEPTH_FILLS, BenchOptions


def register(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("bench", help="measure prefill/decode speed and acceptance, reproducibly")
    add_model_args(p)
    add_parallel_arg(p)
    add_spec_args(p)
    p.add_argument("-p", "--n-prompt", type=int, default=512, help="prompt tokens (default 512)")
    p.add_argument("-n", "--n-gen", type=int, default=512, help="generated tokens (default 512)")
    p.add_argument("-r", "--repetitions", type=int, default=5, help="measured repetitions (default 5)")
    p.add_argument("--warmup", type=int, default=1, help="discarded warm-up runs (default 1)")
    p.add_argument("-d", "--depth", default="0", help="context depths, comma list (default 0)")
    p.add_argument("--depth-fill", choices=DEPTH_FILLS, default="prefill",
                   help="how -d's context is filled: prefill (random tokens read by the model, default) or random "
                        "(the attention KV written with random values: decode and the prompt at depth 128K-262K "
                        "without first reading that many tokens; plain decoding only)")
    p.add_argument("--sweep", action="append", default=[],
                   help=f"key=v1,v2 (keys: {', '.join(bench.SWEEP_KEYS)}); several form a cartesian product; "
                        "write spec-type chains with + (ngram-mod+draft-mtp)")
    p.add_argument("--interleave", action="store_true",
                   help="build every sweep point's engine first (one copy of the weights per dtype) and run each "
                        "repetition on every point back to back, in alternating order: rows gain the paired ratios "
                        "to the first point (decode_ratio, prefill_ratio), which drift of the machine cancels out of")
    p.add_argument("--categories", default=None, help="use the shipped prompt set: all or a comma list")
    p.add_argument("--temp", type=float, default=0.0, help="temperature (default 0 = greedy)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--url", action="append", default=None,
                   help="benchmark an OpenAI-compatible server instead (repeatable: side by side)")
    p.add_argument("--api-key", default=None, help="for --url")
    p.add_argument("--out", default=None, help="report directory (default bench-<timestamp>)")
    add_plot_format_arg(p)
    p.add_argument("-q", "--quiet", action="store_true")
    p.add_argument("--db", default=None, metavar="FILE",
                   help="also append the run, with its environment, to this history database (SQLite, created on "
                        "first use); see `turbospec bench history` and `turbospec bench compare`")
    p.add_argument("--note", default=None, help="with --db: a note stored with the run")
    p.set_defaults(func=run)
    tools = p.add_subparsers(title="history tools (instead of measuring)", metavar="{history,compare}")
    h = tools.add_parser("history", help="list the runs of a --db history file, newest first",
                         description="List the runs recorded in a history file (`turbospec bench ... --db FILE`), "
                                     "newest first.")
    h.add_argument("--db", required=True, metavar="FILE", help="the history database")
    h.set_defaults(func=show_history)
    c = tools.add_parser("compare", help="run B against run A of a --db history file: regressions per row",
                         description="Compare two recorded runs row by row (engine, config, depth, category): "
                                     "medians, min-max spreads, change of B vs A and a verdict. Throughput is "
                                     "'slower' only when B's range lies below A's (no overlap), 'faster' when "
                                     "above, else 'same (within noise)'; TTFT the other way round. Changes "
                                     "of the median under --threshold are 'same' whatever the ranges.")
    c.add_argument("a", metavar="A", help="the baseline: a run id, or a git revision (commit hash prefix, HEAD~1, "
                                          "a tag or branch): its newest run")
    c.add_argument("b", metavar="B", help="the run compared with A (as A)")
    c.add_argument("--db", required=True, metavar="FILE", help="the history database")
    c.add_argument("--threshold", type=float, default=history.DEFAULT_THRESHOLD_PCT, metavar="PCT",
                   help=f"smallest change of the median called slower/faster (default "
                        f"{history.DEFAULT_THRESHOLD_PCT:g}%%; 0: any change whose ranges do not overlap)")
    c.set_defaults(func=show_compare)
    return p


def options(a: argparse.Namespace) -> BenchOptions:
    return BenchOptions(n_prompt=a.n_prompt, n_gen=a.n_gen, repetitions=a.repetitions, warmup=a.warmup,
                        depths=tuple(int(d) for d in str(a.depth).split(",")), sweep=tuple(a.sweep),
                        categories=a.categories, temp=a.temp, seed=a.seed, quiet=a.quiet, interleave=a.interleave,
                        depth_fill=a.depth_fill)


def run(a: argparse.Namespace) -> int:
    opts = options(a)
    if a.url and a.interleave:
        raise TurboSpecError("--interleave measures the local engine's sweep points; it does not apply with --url")
    if a.url and a.depth_fill != "prefill":
        raise TurboSpecError("--depth-fill random writes the local engine's cache; a server's context is filled "
                             "with words (--url)")
    if a.url:  # servers: depth = that many filler words before the prompt
        settings = {k: v for k, v in vars(a).items() if k not in ("func", "api_key")}
        report = client.run_remote(a.url, opts, a.api_key, settings)
    else:
        settings = {k: v for k, v in vars(a).items() if k != "func"}
        report = bench.run_local(engine_config(a), opts, settings)
        from turbospec.parallel import tp

        rank, ranks = tp.world()
        if ranks > 1:  # under torchrun every rank measured in step; rank 0 alone reports
            if rank:
                return 0
            report["env"]["tensor_parallel"] = ranks
    out = Path(a.out or time.strftime("bench-%Y%m%d-%H%M%S"))
    files = bench.write_reports(report, out, a.plot_format)
    bench.print_table(report)
    print("wrote " + ", ".join(str(f) for f in files), file=sys.stderr)
    if a.db:
        run_id = history.record(a.db, report, kind="bench", note=a.note)
        print(f"recorded run {run_id} in {a.db}", file=sys.stderr)
    return 0


def show_history(a: argparse.Namespace) -> int:
    """`turbospec bench history --db FILE`: the recorded runs, newest first."""
    runs = history.list_runs(a.db)
    cols = ["id", "created", "kind", "version", "commit", "machine", "rows", "settings", "note"]
    lines = [[str(r["id"]), r["created"][:16].replace("T", " "), r["kind"], str(r["version"] or ""),
              str(r["git_commit"] or ""), str(r["machine"] or ""), str(r["n_rows"]), r["settings"]["text"],
              r["note"] or ""] for r in runs]
    _print_table(f"{a.db}: {len(runs)} run{'s' * (len(runs) != 1)}", cols, lines)
    return 0


def show_compare(a: argparse.Namespace) -> int:
    """`turbospec bench compare A B --db FILE`: the regression table and a one-line verdict count."""
    if not a.threshold >= 0:
        raise TurboSpecError("--threshold must be >= 0")
    run_a, run_b = (history.load_run(a.db, history.resolve(a.db, ref)) for ref in (a.a, a.b))
    result = history.compare_runs(run_a, run_b, a.threshold)
    engines = any(r.get("engine") is not None for r in result)
    cols = ["engine"] * engines + ["config", "depth", "category", "metric", "A median", "A spread", "B median",
                                   "B spread", "change", "verdict"]
    lines = []
    for r in result:
        m = r["metric"]
        if "a_median" in r:
            cells = [_num(m, r["a_median"]), _spread(m, r["a_min"], r["a_max"], r["band"]), _num(m, r["b_median"]),
                     _spread(m, r["b_min"], r["b_max"], r["band"]),
                     "" if r["change_pct"] is None else f"{r['change_pct']:+.1f}%"]
        else:
            cells = [""] * 5
        key = [str(r.get("engine") or "")] * engines + [str(r["config"]), str(r["depth"]), str(r["category"])]
        lines.append([*key, m or "(row)", *cells, r["verdict"]])
    title = f"bench compare: A = {_run_name(run_a)}  ->  B = {_run_name(run_b)}"
    _print_table(title, cols, lines, verdicts=True)
    print(history.summary(result), flush=True)
    for line in history.differences(run_a, run_b):
        print(f"note: A and B differ in {line}", file=sys.stderr)
    return 0


def _run_name(run: dict[str, Any]) -> str:
    return f"run {run['id']} ({run.get('git_commit') or 'no commit'}, {run['created']})"


def _num(metric: str | None, v: float | None) -> str:
    """A metric's value with about four significant digits (three decimals for the acceptance rate)."""
    if v is None:
        return "-"
    if metric == "acc_rate":
        return f"{v:.3f}"
    return f"{v:.0f}" if abs(v) >= 1000 else f"{v:.1f}" if abs(v) >= 100 else f"{v:.2f}"


def _spread(metric: str | None, lo: float | None, hi: float | None, band: str | None) -> str:
    if lo is None or hi is None or band is None:
        return "-"
    if band == "sd":
        return "+-" + _num(metric, (hi - lo) / 2)
    return f"{_num(metric, lo)}-{_num(metric, hi)}"


VERDICT_STYLE = {"slower": "bold red", "lower": "bold red", "faster": "bold green", "higher": "bold green"}


def _print_table(title: str, cols: list[str], lines: list[list[str]], verdicts: bool = False) -> None:
    """`report.console_table`; with `verdicts`, the last column coloured: red slower, green faster."""
    styles = [VERDICT_STYLE.get(line[-1], "") for line in lines] if verdicts else None
    console_table(title, cols, lines, styles)
