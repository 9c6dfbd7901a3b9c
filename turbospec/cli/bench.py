"""`turbospec bench`: its flags, turned into an `EngineConfig` and `BenchOptions` for turbospec.lab.bench
(local engine) or turbospec.lab.client (`--url`: servers)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from turbospec.cli.args import add_model_args, add_spec_args, engine_config
from turbospec.lab import bench, client
from turbospec.lab.workload import BenchOptions


def register(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("bench", help="measure prefill/decode speed and acceptance, reproducibly")
    add_model_args(p)
    add_spec_args(p)
    p.add_argument("-p", "--n-prompt", type=int, default=512, help="prompt tokens (default 512)")
    p.add_argument("-n", "--n-gen", type=int, default=512, help="generated tokens (default 512)")
    p.add_argument("-r", "--repetitions", type=int, default=5, help="measured repetitions (default 5)")
    p.add_argument("--warmup", type=int, default=1, help="discarded warm-up runs (default 1)")
    p.add_argument("-d", "--depth", default="0", help="context depths, comma list (default 0)")
    p.add_argument("--sweep", action="append", default=[],
                   help=f"key=v1,v2 (keys: {', '.join(bench.SWEEP_KEYS)}); several form a cartesian product; "
                        "write spec-type chains with + (ngram-mod+draft-mtp)")
    p.add_argument("--categories", default=None, help="use the shipped prompt set: all or a comma list")
    p.add_argument("--temp", type=float, default=0.0, help="temperature (default 0 = greedy)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--url", action="append", default=None,
                   help="benchmark an OpenAI-compatible server instead (repeatable: side by side)")
    p.add_argument("--api-key", default=None, help="for --url")
    p.add_argument("--out", default=None, help="report directory (default bench-<timestamp>)")
    p.add_argument("-q", "--quiet", action="store_true")
    p.set_defaults(func=run)
    return p


def options(a: argparse.Namespace, depths: tuple[int, ...] = (0,)) -> BenchOptions:
    return BenchOptions(n_prompt=a.n_prompt, n_gen=a.n_gen, repetitions=a.repetitions, warmup=a.warmup,
                        depths=depths, sweep=tuple(a.sweep), categories=a.categories, temp=a.temp,
                        seed=a.seed, quiet=a.quiet)


def run(a: argparse.Namespace) -> int:
    opts = options(a)
    if a.url:
        settings = {k: v for k, v in vars(a).items() if k not in ("func", "api_key")}
        report = client.run_remote(a.url, opts, a.api_key, settings)
    else:
        settings = {k: v for k, v in vars(a).items() if k != "func"}
        depths = tuple(int(d) for d in str(a.depth).split(","))
        report = bench.run_local(engine_config(a), options(a, depths), settings)
    out = Path(a.out or time.strftime("bench-%Y%m%d-%H%M%S"))
    files = bench.write_reports(report, out)
    bench.print_table(report)
    print("wrote " + ", ".join(str(f) for f in files), file=sys.stderr)
    return 0
