"""`turbospec quality`: its flags, turned into an `EngineConfig` and `QualityOptions` for
turbospec.lab.quality."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from turbospec.cli.args import add_model_args, add_plot_format_arg, engine_config
from turbospec.lab import quality


def register(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("quality",
                       help="perplexity, KLD vs a baseline and retrieval accuracy per KV configuration")
    add_model_args(p)
    p.add_argument("--text", default=str(quality.EVAL_DIR / "prose.jsonl"),
                   help="text or .jsonl (field 'text')")
    p.add_argument("--ctx", default="512", help="chunk sizes, comma list (default 512)")
    p.add_argument("--chunks", type=int, default=4, help="max chunks per size (default 4)")
    p.add_argument("--kv", default=",".join(quality.PAIRS),
                   help="K/V pairs, comma list (default: the standard table)")
    p.add_argument("--baseline", default="f16/f16", help="baseline K/V pair (default f16/f16)")
    p.add_argument("--retrieval", action="store_true", help="also run the retrieval grid")
    p.add_argument("--lengths", default="1024,2048,4096", help="retrieval context lengths")
    p.add_argument("--depths", default="0.1,0.5,0.9", help="retrieval needle depths (0..1)")
    p.add_argument("--cases", type=int, default=5, help="retrieval cases per cell (default 5)")
    p.add_argument("--kinds", default="passkey,numbers", help="retrieval kinds: passkey, numbers")
    p.add_argument("--out", default=None, help="report directory (default quality-<timestamp>)")
    add_plot_format_arg(p)
    p.add_argument("-q", "--quiet", action="store_true")
    p.set_defaults(func=run)
    return p


def options(a: argparse.Namespace) -> quality.QualityOptions:
    retrieval = {}
    if a.retrieval:  # the grid's flags are read only when it runs
        retrieval = {"lengths": tuple(int(x) for x in a.lengths.split(",")),
                     "depths": tuple(float(x) for x in a.depths.split(",")),
                     "kinds": tuple(k.strip() for k in a.kinds.split(",") if k.strip())}
    return quality.QualityOptions(
        text=a.text, ctxs=tuple(int(c) for c in a.ctx.split(",")), chunks=a.chunks,
        pairs=tuple(p.strip() for p in a.kv.split(",") if p.strip()), baseline=a.baseline,
        retrieval=a.retrieval, cases=a.cases, quiet=a.quiet, **retrieval)


def run(a: argparse.Namespace) -> int:
    settings = {k: v for k, v in vars(a).items() if k != "func"}
    opts = options(a)
    report = quality.run_quality(engine_config(a), opts, settings)
    out = Path(a.out or time.strftime("quality-%Y%m%d-%H%M%S"))
    files = quality.write_reports(report, out, opts, a.plot_format)
    quality.print_tables(report)
    print("wrote " + ", ".join(str(f) for f in files), file=sys.stderr)
    return 0
