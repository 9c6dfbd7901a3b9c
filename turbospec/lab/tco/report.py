"""Reports: token counts read and printed, the Markdown cost table, and the table / JSON / CSV outputs."""

from __future__ import annotations

import csv
import io
import json
import re
from collections.abc import Sequence
from dataclasses import asdict

from turbospec.lab.tco.cost import break_even_summary, onprem_breakdown, tco_table
from turbospec.lab.tco.presets import Preset
from turbospec.lab.tco.pricing import ApiPricing, OnPrem, check

_SUFFIXES = {"": 1.0, "K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12, "만": 1e4, "억": 1e8}


def parse_tokens(text: str) -> float:
    """``"100M"``, ``"1.5B"``, ``"5e8"``, ``"100,000,000"``, ``"1억"`` -> tokens."""
    m = re.fullmatch(r"\s*([0-9][0-9_,]*(?:\.[0-9]*)?(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z만억]?)\s*", text)
    if not m or m.group(2).upper() not in _SUFFIXES:
        raise ValueError(f"cannot read a token count from {text!r} (examples: 100M, 1.5B, 5e8, 1억)")
    value = float(m.group(1).replace(",", "").replace("_", "")) * _SUFFIXES[m.group(2).upper()]
    check(value >= 0, f"token counts must be >= 0, got {text!r}")
    return value


def fmt_tokens(t: float) -> str:
    """1.5e8 -> '150M'."""
    for suffix, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if t >= scale:
            return f"{t / scale:,.4g}{suffix}"
    return f"{t:,.0f}"


def fmt_money(x: float | None) -> str:
    """Whole units from 100 up, cents below; '-' for None."""
    if x is None:
        return "-"
    return f"{x:,.0f}" if abs(x) >= 100 or x == 0 else f"{x:,.2f}"



def format_table(
    onprem: OnPrem,
    apis: Sequence[ApiPricing],
    tokens: Sequence[float],
    currency: str = "",
    claimed: dict[str, dict[float, float]] | None = None,
) -> str:
    """A Markdown table of monthly costs, the on-prem breakdown and the break-even points."""
    cur = f" ({currency})" if currency else ""
    claimed = claimed or {}
    head = ["tokens/month", "units", f"on-prem hw+power{cur}", f"on-prem total{cur}"]
    for api in apis:
        head.append(f"{api.name}{cur}")
        if api.name in claimed:
            head.append(f"{api.name} (seeds say)")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in tco_table(onprem, apis, tokens):
        cells = [
            fmt_tokens(row["tokens"]),
            str(row["units"]),
            fmt_money(row["onprem_hw_power"]),
            fmt_money(row["onprem_total"]),
        ]
        for api in apis:
            cells.append(fmt_money(row[api.name]))
            if api.name in claimed:
                cells.append(fmt_money(claimed[api.name].get(row["tokens"])))
        lines.append("| " + " | ".join(cells) + " |")
    b = onprem_breakdown(onprem, 0.0)
    money = fmt_money
    hours = f"{onprem.hours_per_day:g} h x {onprem.days_per_month:g} d x {onprem.kwh_price:g}/kWh"
    if onprem.idle_power_w is None:
        power = f"electricity {money(b['electricity'])} ({onprem.power_w:g} W x {hours})"
    else:
        extra = onprem.per_token * 1e6
        power = (
            f"electricity {money(b['electricity'])} at idle ({onprem.idle_power_w:g} W x {hours}; "
            f"+{extra:,.1f} per 1M tokens generated at {onprem.power_w:g} W)"
        )
    lines.append("")
    lines.append(
        f"on-prem per unit and month{cur}: amortization {money(b['amortization'])} ({money(onprem.hw_price)} "
        f"over {onprem.years:g} years) + {power} = {money(b['hw_power'])}; + maintenance "
        f"{money(b['maintenance'])} ({onprem.maint_hours:g} h x {money(onprem.maint_rate)}) "
        f"= {money(b['total'])}"
    )
    if onprem.capacity is None:
        lines.append("capacity: unlimited (no --tps given: one unit serves any volume)")
    else:
        lines.append(
            f"capacity: {fmt_tokens(onprem.capacity)} tokens/month per unit at {onprem.tps:.4g} t/s, "
            f"{onprem.hours_per_day:g} h/day, utilisation {onprem.utilisation:.0%}"
        )
    for api in apis:
        lines.append(
            f"{api.name}: {api.in_ratio:.0%} x {api.in_price:g} + {1 - api.in_ratio:.0%} x "
            f"{api.out_price:g} = {api.usd_per_mtok:.4g} USD per 1M tokens x fx {api.fx:g} = "
            f"{money(api.per_mtok)} {currency} per 1M".rstrip()
        )
    for name, be in break_even_summary(onprem, apis).items():
        hw, tot = (
            "never" if v is None else f"{fmt_tokens(v)} tokens/month" for v in (be["hw_power"], be["total"])
        )
        lines.append(f"break-even vs {name}: {hw} (hw+power), {tot} (with maintenance)")
    return "\n".join(lines)



def render(fmt: str, preset_name: str, preset: Preset, onprem: OnPrem, apis: Sequence[ApiPricing],
           tokens: Sequence[float], currency: str, claimed: dict[str, dict[float, float]]) -> str:
    """The output of `turbospec tco` in `fmt` (table, json or csv), ending with a newline."""
    if fmt == "json":
        doc = {
            "preset": preset_name,
            "currency": currency,
            "onprem": asdict(onprem),
            "onprem_breakdown": onprem_breakdown(onprem, 0.0),
            "capacity_tokens_per_month": onprem.capacity,
            "apis": [{**asdict(a), "usd_per_mtok": a.usd_per_mtok, "per_mtok": a.per_mtok} for a in apis],
            "rows": tco_table(onprem, apis, tokens),
            "break_even": break_even_summary(onprem, apis),
            "claimed": {k: {str(int(t)): v for t, v in c.items()} for k, c in claimed.items()},
        }
        return json.dumps(doc, indent=2) + "\n"
    if fmt == "csv":
        rows = tco_table(onprem, apis, tokens)
        buf = io.StringIO()
        w = csv.DictWriter(buf, fieldnames=list(rows[0]) if rows else ["tokens"], lineterminator="\n")
        w.writeheader()
        w.writerows(rows)
        return buf.getvalue()
    text = format_table(onprem, apis, tokens, currency, claimed) + "\n"
    if claimed:
        for name, claim in preset.claimed_break_even.items():
            text += f"the seeds claim break-even vs {name}: {claim}\n"
    return text
