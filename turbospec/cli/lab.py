"""`turbospec lab`: commands that run several lab tools together. `lab seeds`: the seeds' tables in one command
(turbospec.lab.seeds): each named configuration (`--config "NAME: -ctk q8_0 --spec-type draft-mtp"`, bench's
`--sweep key=v1,v2` on top) and each `--url` server over code and prose prompts at several depths, the KLD of
the K/V formats used, and the cost table."""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

from turbospec.cli.args import add_model_args, add_plot_format_arg, add_spec_args, engine_config
from turbospec.config import EngineConfig
from turbospec.errors import TurboSpecError
from turbospec.lab import bench, quality, seeds, tco


class _FlagsParser(argparse.ArgumentParser):
    """Parses one --config's flags; a bad flag is a one-line error, not an exit."""

    def error(self, message: str):
        raise TurboSpecError(f"--config: {message}")


def register(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("lab", help="lab commands that combine the tools (seeds: the seeds' tables in one run)")
    lab_sub = p.add_subparsers(dest="lab_cmd", metavar="{seeds}")
    s = lab_sub.add_parser(
        "seeds", help="code/prose t/s, TTFT, peak memory, depth loss, acceptance, KLD and cost of each engine",
        description="The seeds' tables in one command: every turbospec configuration and --url server over the "
                    "shipped code and prose prompts at each depth, with the KLD of each row's K/V formats and the "
                    "tco cost table fed by the measured t/s. Model and speculation flags (llama.cpp's names) set "
                    "the base configuration.")
    add_model_args(s)
    add_spec_args(s)
    g = s.add_argument_group("engines")
    g.add_argument("--config", action="append", default=[], metavar="'NAME: FLAGS'",
                   help="a named turbospec configuration: the base flags plus these, e.g. "
                        "'mtp-tbq4: -ctk tbq4_0 -ctv tbq4_0 --spec-type draft-mtp' (repeatable; default: the base "
                        "flags alone, named 'default')")
    g.add_argument("--sweep", action="append", default=[], metavar="KEY=V1,V2",
                   help=f"as bench, applied to every configuration (keys: {', '.join(bench.SWEEP_KEYS)})")
    g.add_argument("--no-local", action="store_true", help="measure only the --url servers (KLD still uses -m)")
    g.add_argument("--url", action="append", default=[],
                   help="an OpenAI-compatible server's base URL, e.g. http://127.0.0.1:8080/v1 (repeatable)")
    g.add_argument("--url-name", action="append", default=[], help="label of the n-th --url (repeatable)")
    g.add_argument("--url-kv", action="append", default=[], metavar="K/V",
                   help="K/V cache formats of the n-th --url server, e.g. q8_0/q8_0, for its KLD (repeatable; "
                        "'-' for none)")
    g.add_argument("--api-key", default=None, help="for --url")
    g = s.add_argument_group("workload")
    g.add_argument("-d", "--depths", default=None,
                   help=f"context depths, comma list (default 0,{seeds.DEEP_DEPTH}, or half the model's context)")
    g.add_argument("--code", default=",".join(seeds.CODE_CATEGORIES), help="code prompt categories")
    g.add_argument("--prose", default=",".join(seeds.PROSE_CATEGORIES), help="prose prompt categories")
    g.add_argument("-n", "--n-gen", type=int, default=128, help="generated tokens (default 128)")
    g.add_argument("-r", "--repetitions", type=int, default=3, help="measured repetitions (default 3)")
    g.add_argument("--warmup", type=int, default=1, help="discarded warm-up runs (default 1)")
    g.add_argument("--temp", type=float, default=0.0, help="temperature (default 0 = greedy)")
    g.add_argument("--seed", type=int, default=0)
    g = s.add_argument_group("KLD and cost")
    g.add_argument("--no-kld", action="store_true", help="skip the KLD run")
    g.add_argument("--kld-text", default=str(quality.EVAL_DIR / "prose.jsonl"), help="text for the KLD run")
    g.add_argument("--kld-ctx", type=int, default=512, help="KLD chunk size (default 512)")
    g.add_argument("--kld-chunks", type=int, default=4, help="KLD chunks (default 4)")
    g.add_argument("--baseline", default="f16/f16", help="KLD baseline K/V pair (default f16/f16)")
    g.add_argument("--preset", choices=sorted(tco.PRESETS), default="seeds", help="tco preset (default seeds)")
    s.add_argument("--out", default=None, help="report directory (default seeds-<timestamp>)")
    add_plot_format_arg(s)
    s.add_argument("-q", "--quiet", action="store_true")
    s.set_defaults(func=run_seeds)

    def no_subcommand(a: argparse.Namespace) -> int:
        p.print_help(sys.stderr)
        return 2

    p.set_defaults(func=no_subcommand)
    return p


def _flags_parser() -> _FlagsParser:
    fp = _FlagsParser(prog="--config", add_help=False)
    add_model_args(fp)
    add_spec_args(fp)
    return fp


def configurations(a: argparse.Namespace) -> list[tuple[str, EngineConfig]]:
    """The named EngineConfigs: each --config (the base flags plus its own) or the base alone, times the
    --sweep points."""
    bases: list[tuple[str, argparse.Namespace]] = []
    fp = _flags_parser()
    for item in a.config:
        head, sep, rest = item.partition(":")
        if not sep or head.strip().startswith("-") or not head.strip():
            name, flags = item.strip(), item  # no name: the flags are its name
        else:
            name, flags = head.strip(), rest
        ns = argparse.Namespace(**vars(a))
        try:
            fp.parse_args(shlex.split(flags), namespace=ns)
        except ValueError as e:
            raise TurboSpecError(f"--config {item!r}: {e}") from None
        bases.append((name, ns))
    if not bases:
        bases = [("default", a)]
    out = []
    points = bench.parse_sweeps(list(a.sweep))
    for name, ns in bases:
        cfg = engine_config(ns)
        for point in points:
            tag = bench.point_name(point)
            label = name if not point else tag if name == "default" else f"{name} {tag}"
            out.append((label, bench.apply_sweep(cfg, point)))
    return out


def _listed(text: str, what: str, kind=str) -> tuple:
    try:
        return tuple(kind(x.strip()) for x in text.split(",") if x.strip())
    except ValueError:
        raise TurboSpecError(f"{what}: expected a comma list of {kind.__name__}s (got {text!r})") from None


def url_targets(a: argparse.Namespace) -> list[seeds.UrlTarget]:
    for flag, given in (("--url-name", a.url_name), ("--url-kv", a.url_kv)):
        if len(given) > len(a.url):
            raise TurboSpecError(f"{flag} given {len(given)} times for {len(a.url)} --url")
    out = []
    for i, url in enumerate(a.url):
        name = a.url_name[i] if i < len(a.url_name) else None
        kv = a.url_kv[i] if i < len(a.url_kv) and a.url_kv[i] not in ("", "-") else None
        out.append(seeds.UrlTarget(url, name, kv))
    return out


def run_seeds(a: argparse.Namespace) -> int:
    opts = seeds.SeedsOptions(
        n_gen=a.n_gen, repetitions=a.repetitions, warmup=a.warmup,
        depths=_listed(a.depths, "--depths", int) if a.depths else None,
        code=_listed(a.code, "--code"), prose=_listed(a.prose, "--prose"), temp=a.temp, seed=a.seed,
        kld=not a.no_kld, kld_text=a.kld_text, kld_ctx=a.kld_ctx, kld_chunks=a.kld_chunks, baseline=a.baseline,
        preset=a.preset, api_key=a.api_key, quiet=a.quiet)
    configs = [] if a.no_local else configurations(a)
    settings = {k: v for k, v in vars(a).items() if k not in ("func", "api_key")}
    report = seeds.run_seeds(configs, url_targets(a), opts, settings, kld_config=engine_config(a))
    out = Path(a.out or time.strftime("seeds-%Y%m%d-%H%M%S"))
    files = seeds.write_reports(report, out, a.plot_format)
    seeds.print_tables(report)
    print("wrote " + ", ".join(str(f) for f in files), file=sys.stderr)
    return 0
