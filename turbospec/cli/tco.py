"""`turbospec tco`: its flags, turned into an on-prem unit, APIs and token volumes for turbospec.lab.tco."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from turbospec.cli.args import add_plot_format_arg
from turbospec.errors import TurboSpecError
from turbospec.lab import tco

# the OnPrem fields a flag of the same name overrides
ONPREM_FLAGS = ("hw_price", "years", "power_w", "idle_power_w", "kwh_price", "hours_per_day",
                "days_per_month", "utilisation", "maint_hours", "maint_rate", "tps")


def _api_arg(text: str) -> tuple[str, float, float]:
    parts = text.rsplit(":", 2)
    try:
        return parts[0], float(parts[1]), float(parts[2])
    except (IndexError, ValueError):
        raise argparse.ArgumentTypeError(
            f"expected NAME:IN_PRICE:OUT_PRICE (USD per 1M), got {text!r}"
        ) from None


def _tokens_arg(text: str) -> float:
    try:
        return tco.parse_tokens(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def register(sub) -> argparse.ArgumentParser:
    """Add the ``tco`` subcommand to an argparse subparsers object; returns its parser."""
    p = sub.add_parser(
        "tco",
        help="on-prem vs API total cost of ownership: monthly costs, break-even tokens/month, plot",
        description="On-prem vs API monthly cost. Starts from a preset (default: the seeds' RTX 4090 table); "
        "every flag overrides one value. Money in the preset's currency (KRW for seeds).",
    )
    p.add_argument(
        "--preset", choices=sorted(tco.PRESETS), default="seeds", help="starting assumptions (default seeds)"
    )
    g = p.add_argument_group("on-prem")
    g.add_argument("--hw-price", type=float, help="hardware price of one unit")
    g.add_argument("--years", type=float, help="amortization period in years")
    g.add_argument("--power-w", type=float, help="power draw while generating, W")
    g.add_argument(
        "--idle-power-w",
        type=float,
        help="power draw while idle, W (default: --power-w all powered hours; needs --tps)",
    )
    g.add_argument("--kwh-price", type=float, help="electricity price per kWh")
    g.add_argument("--hours-per-day", type=float, help="powered-on hours per day")
    g.add_argument("--days-per-month", type=float, help="days per month (default 30)")
    g.add_argument(
        "--utilisation",
        "--utilization",
        type=float,
        dest="utilisation",
        help="share of powered-on time spent generating at --tps, 0..1 (caps capacity)",
    )
    g.add_argument("--maint-hours", type=float, help="maintenance engineering hours per month")
    g.add_argument("--maint-rate", type=float, help="cost of one engineering hour")
    g.add_argument(
        "--tps",
        type=float,
        help="sustained tokens/s of one unit (measured or entered); sets the capacity per unit",
    )
    g.add_argument(
        "--prefill-tps",
        type=float,
        help="with --tps as decode speed: prompt tokens/s; the capacity then uses the blended speed",
    )
    g = p.add_argument_group("API")
    g.add_argument("--in-price", type=float, help="USD per 1M input tokens (with --out-price: a custom API)")
    g.add_argument("--out-price", type=float, help="USD per 1M output tokens")
    g.add_argument("--api-name", default="API", help="name of the --in-price/--out-price API")
    g.add_argument(
        "--api",
        action="append",
        type=_api_arg,
        default=[],
        metavar="NAME:IN:OUT",
        help="an API priced IN/OUT USD per 1M tokens (repeatable; replaces the preset's APIs)",
    )
    g.add_argument("--in-ratio", type=float, help="input share of all tokens, 0..1 (7:3 -> 0.7)")
    g.add_argument("--fx", type=float, help="local currency per USD")
    g = p.add_argument_group("output")
    g.add_argument(
        "--tokens",
        nargs="+",
        type=_tokens_arg,
        metavar="N",
        help="monthly token volumes, e.g. 1M 10M 100M 1e9 (default: the preset's rows)",
    )
    g.add_argument("--currency", help="label for the local currency (default: the preset's)")
    g.add_argument("--format", choices=["table", "json", "csv"], default="table", help="output format")
    g.add_argument("--plot", metavar="PATH", help="also write the cost curves: SVG for a .svg PATH, else PNG")
    add_plot_format_arg(g, None, "--plot (PATH with each format's suffix)")
    p.set_defaults(func=run)
    return p



def run(a: argparse.Namespace) -> int:
    """Print the cost table (or JSON / CSV) for the parsed ``tco`` flags; write the plot if asked."""
    preset = tco.PRESETS[a.preset]
    try:
        onprem = tco.onprem_for(preset, {k: getattr(a, k) for k in ONPREM_FLAGS}, a.prefill_tps, a.in_ratio)
        custom = list(a.api)
        if (a.in_price is None) != (a.out_price is None):
            raise ValueError("--in-price and --out-price go together")
        if a.in_price is not None:
            custom.append((a.api_name, a.in_price, a.out_price))
        apis, claimed = tco.apis_for(preset, custom, a.in_ratio, a.fx)
    except ValueError as e:
        raise TurboSpecError(str(e)) from None
    tokens = list(a.tokens) if a.tokens else list(preset.tokens)
    currency = a.currency if a.currency is not None else preset.currency
    sys.stdout.write(tco.render(a.format, a.preset, preset, onprem, apis, tokens, currency, claimed))
    if a.plot_format and not a.plot:
        raise TurboSpecError("--plot-format needs --plot PATH")
    if a.plot:
        from turbospec.lab import plots

        paths = [Path(a.plot).with_suffix(f".{f}") for f in a.plot_format] if a.plot_format else [Path(a.plot)]
        fig = plots.tco_figure(onprem, apis, currency=currency, claimed=claimed)  # drawn once, written per format
        for path in paths:
            print(f"plot written to {plots.save(fig, path)}", file=sys.stderr)
    return 0
