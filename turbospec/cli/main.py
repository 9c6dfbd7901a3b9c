"""`turbospec` command line: each subcommand's module registers its flags; this module dispatches and turns
TurboSpecError into a one-line message."""

from __future__ import annotations

import argparse
import sys

from turbospec.cli import bench, export, fit, lab, quality, run, serve, tco
from turbospec.errors import TurboSpecError
from turbospec.version import __version__

COMMANDS = (run, serve, bench, fit, quality, tco, lab, export)  # each has register(subparsers) setting its func


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="turbospec", description="Speculative decoding over compressed KV caches.")
    ap.add_argument("--version", action="version", version=f"turbospec {__version__}")
    sub = ap.add_subparsers(dest="cmd")
    for command in COMMANDS:
        command.register(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if not args.cmd:  # no subcommand: `run`
        args = ap.parse_args(["run"] + (argv if argv is not None else sys.argv[1:]))
    try:
        return int(args.func(args) or 0)
    except TurboSpecError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
