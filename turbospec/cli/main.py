"""`turbospec` command line: each subcommand's module registers its flags; this module dispatches and turns
TurboSpecError into a one-line message."""

from __future__ import annotations

import argparse
import sys

from turbospec.cli import bench, export, fit, lab, quality, run, serve, tco
from turbospec.errors import TurboSpecError
from turbospec.parallel import launch
from turbospec.version import __version__

COMMANDS = (run, serve, bench, fit, quality, tco, lab, export)  # each has register(subparsers) setting its func


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="turbospec", description="Speculative decoding over compressed KV caches.")
    ap.add_argument("--version", action="version", version=f"turbospec {__version__}")
    sub = ap.add_subparsers(dest="cmd")
    for command in COMMANDS:
        command.register(sub)
    ap.set_defaults(tp=1, threads=None)  # commands without --tp run in this process
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if not args.cmd:  # no subcommand: `run`
        args = ap.parse_args(["run"] + (argv if argv is not None else sys.argv[1:]))
    try:
        if args.tp != 1:  # --tp N: the command as N ranks under torchrun (or this process is one of them)
            code = launch.tensor_parallel(args.tp, argv if argv is not None else sys.argv[1:], args.threads)
            if code is not None:
                return code
        return int(args.func(args) or 0)
    except TurboSpecError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
