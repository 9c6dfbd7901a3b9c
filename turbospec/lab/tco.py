"""`turbospec tco`: total cost of ownership, on-prem inference box vs a pay-per-token API.

The model, per month:

* on-prem, per unit (one box / card): straight-line amortization ``hw_price / (12 * years)`` plus
  electricity ``kW * hours * kwh_price``; plus maintenance ``maint_hours * maint_rate`` once (one fork to keep
  alive, however many boxes run it). The box is powered ``hours_per_day * days_per_month`` hours. By default
  it draws ``power_w`` all that time (the seeds' assumption); with ``idle_power_w`` it draws ``power_w`` only
  while generating (``tokens / tps`` seconds) and ``idle_power_w`` otherwise.
* capacity: with a throughput ``tps`` (tokens per second, measured by ``turbospec bench`` or entered), one
  unit serves at most ``tps * 3600 * hours * utilisation`` tokens a month; more tokens need more units (a step
  function). Without ``tps`` capacity is unlimited, as in the seeds.
* API: ``tokens / 1e6 * (in_ratio * in_price + (1 - in_ratio) * out_price) * fx``, prices in USD per 1M
  tokens, ``fx`` in local currency per USD.

The break-even point is the smallest monthly token volume at which on-prem costs no more than the API.
Everything is in one local currency (KRW for the seeds' preset). Importing this module is cheap: matplotlib is
imported only by :func:`plot_tco`.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import math
import re
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

__all__ = [
    "PRESETS",
    "ApiPricing",
    "OnPrem",
    "Preset",
    "add_cli",
    "api_monthly_cost",
    "blended_tps",
    "break_even_tokens",
    "format_table",
    "onprem_breakdown",
    "onprem_monthly_cost",
    "onprem_units",
    "parse_tokens",
    "plot_tco",
    "run_cli",
    "tco_table",
    "token_grid",
]

MONTHS_PER_YEAR = 12


@dataclass
class OnPrem:
    """An on-prem inference unit (e.g. one GPU box). Money in the local currency."""

    hw_price: float  # purchase price of one unit
    power_w: float  # draw while generating (the seeds use the card's TDP)
    kwh_price: float  # electricity price per kWh
    years: float = 3.0  # straight-line amortization period
    hours_per_day: float = 24.0  # powered on
    days_per_month: float = 30.0
    utilisation: float = 1.0  # share of powered-on time that can be spent generating at `tps` (caps capacity)
    idle_power_w: float | None = None  # None: `power_w` all powered-on hours; else this while not generating
    maint_hours: float = 0.0  # engineering hours per month (fork upkeep, ops)
    maint_rate: float = 0.0  # cost of one engineering hour
    tps: float | None = None  # sustained tokens/s of one unit; None: no capacity limit (one unit)
    name: str = "on-prem"

    def __post_init__(self) -> None:
        _check(self.hw_price >= 0, f"hw_price must be >= 0, got {self.hw_price}")
        _check(self.power_w >= 0, f"power_w must be >= 0, got {self.power_w}")
        _check(self.kwh_price >= 0, f"kwh_price must be >= 0, got {self.kwh_price}")
        _check(self.years > 0, f"years must be > 0, got {self.years}")
        _check(0 < self.hours_per_day <= 24, f"hours_per_day must be in (0, 24], got {self.hours_per_day}")
        _check(0 < self.days_per_month <= 31, f"days_per_month must be in (0, 31], got {self.days_per_month}")
        _check(0 < self.utilisation <= 1, f"utilisation must be in (0, 1], got {self.utilisation}")
        _check(self.maint_hours >= 0, f"maint_hours must be >= 0, got {self.maint_hours}")
        _check(self.maint_rate >= 0, f"maint_rate must be >= 0, got {self.maint_rate}")
        if self.tps is not None:
            _check(self.tps > 0, f"tps must be > 0, got {self.tps}")
        if self.idle_power_w is not None:
            _check(
                0 <= self.idle_power_w <= self.power_w,
                f"idle_power_w must be in [0, power_w={self.power_w}], got {self.idle_power_w}",
            )
            _check(self.tps is not None, "idle_power_w needs tps: busy hours are tokens / tps")

    @property
    def hours_per_month(self) -> float:
        return self.hours_per_day * self.days_per_month

    @property
    def amortization(self) -> float:
        """Hardware cost per unit per month."""
        return self.hw_price / (MONTHS_PER_YEAR * self.years)

    @property
    def maintenance(self) -> float:
        return self.maint_hours * self.maint_rate

    @property
    def capacity(self) -> float | None:
        """Tokens per month one unit can serve (None: unlimited)."""
        if self.tps is None:
            return None
        return self.tps * 3600.0 * self.hours_per_month * self.utilisation

    @property
    def _idle_w(self) -> float:
        return self.power_w if self.idle_power_w is None else self.idle_power_w

    @property
    def fixed_per_unit(self) -> float:
        """Monthly cost of one unit before any token is generated: amortization + electricity at idle draw."""
        return self.amortization + self._idle_w / 1000.0 * self.hours_per_month * self.kwh_price

    @property
    def per_token(self) -> float:
        """Extra electricity per generated token (0 unless ``idle_power_w`` is set)."""
        if self.tps is None:
            return 0.0
        return (self.power_w - self._idle_w) / 1000.0 * self.kwh_price / (self.tps * 3600.0)


@dataclass
class ApiPricing:
    """A pay-per-token API: USD per 1M input / output tokens, the workload's input share, exchange rate."""

    name: str
    in_price: float  # USD per 1M input tokens
    out_price: float  # USD per 1M output tokens
    in_ratio: float = 0.7  # input share of all tokens (7:3 -> 0.7)
    fx: float = 1.0  # local currency per USD (1.0: report in USD)

    def __post_init__(self) -> None:
        _check(
            self.in_price >= 0 and self.out_price >= 0,
            f"{self.name}: prices must be >= 0, got {self.in_price} / {self.out_price}",
        )
        _check(0 <= self.in_ratio <= 1, f"in_ratio must be in [0, 1], got {self.in_ratio}")
        _check(self.fx > 0, f"fx must be > 0, got {self.fx}")

    @property
    def usd_per_mtok(self) -> float:
        """Blended USD price of 1M tokens at ``in_ratio``."""
        return self.in_ratio * self.in_price + (1.0 - self.in_ratio) * self.out_price

    @property
    def per_mtok(self) -> float:
        """Blended price of 1M tokens in the local currency."""
        return self.usd_per_mtok * self.fx


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


# ------------------------------------------------------------------------------------------------------------
# The model


def blended_tps(decode_tps: float, prefill_tps: float, in_ratio: float) -> float:
    """Tokens/s over a workload with ``in_ratio`` input tokens processed at ``prefill_tps`` and the rest
    generated at ``decode_tps`` (harmonic mix: time per token is the weighted mean of 1/tps)."""
    _check(decode_tps > 0 and prefill_tps > 0, "throughputs must be > 0")
    return 1.0 / (in_ratio / prefill_tps + (1.0 - in_ratio) / decode_tps)


def onprem_units(onprem: OnPrem, tokens_per_month: float) -> int:
    """Units needed to serve ``tokens_per_month`` (at least one)."""
    _check(tokens_per_month >= 0, f"tokens_per_month must be >= 0, got {tokens_per_month}")
    cap = onprem.capacity
    if cap is None or tokens_per_month <= cap:
        return 1
    return math.ceil(tokens_per_month / cap)


def onprem_breakdown(onprem: OnPrem, tokens_per_month: float = 0.0) -> dict[str, float]:
    """Monthly on-prem cost by item: units, amortization, electricity, maintenance, hw_power, total."""
    units = onprem_units(onprem, tokens_per_month)
    amortization = units * onprem.amortization
    electricity = units * (onprem.fixed_per_unit - onprem.amortization) + onprem.per_token * tokens_per_month
    return {
        "units": units,
        "amortization": amortization,
        "electricity": electricity,
        "maintenance": onprem.maintenance,
        "hw_power": amortization + electricity,
        "total": amortization + electricity + onprem.maintenance,
    }


def onprem_monthly_cost(
    onprem: OnPrem, tokens_per_month: float = 0.0, include_maintenance: bool = True
) -> float:
    """Monthly on-prem cost at a token volume; ``include_maintenance=False`` gives hardware + power only."""
    b = onprem_breakdown(onprem, tokens_per_month)
    return b["total"] if include_maintenance else b["hw_power"]


def api_monthly_cost(api: ApiPricing, tokens_per_month: float) -> float:
    """Monthly API cost (local currency) for ``tokens_per_month`` input + output tokens."""
    _check(tokens_per_month >= 0, f"tokens_per_month must be >= 0, got {tokens_per_month}")
    return tokens_per_month / 1e6 * api.per_mtok


def break_even_tokens(onprem: OnPrem, api: ApiPricing, include_maintenance: bool = True) -> float | None:
    """The smallest tokens/month at which on-prem costs no more than the API; None if it never does.

    On-prem cost is ``u * F + M + b * T`` with ``u = ceil(T / capacity)`` units (F: fixed cost per unit, M:
    maintenance, b: extra electricity per token); the API costs ``a * T``. In the segment with ``u`` units
    they meet at ``T = (u F + M) / (a - b)``, which lies inside the segment for the first ``u`` with
    ``u ((a - b) capacity - F) >= M``. Past that point on-prem can turn dearer again for a while each time a
    unit is added (the curves show the saw-tooth); this returns the first crossing.
    """
    a = api.per_mtok / 1e6
    b = onprem.per_token
    fixed = onprem.fixed_per_unit
    maint = onprem.maintenance if include_maintenance else 0.0
    if fixed + maint == 0:
        return 0.0
    if a <= b:
        return None
    cap = onprem.capacity
    if cap is None:
        return (fixed + maint) / (a - b)
    slack = (a - b) * cap - fixed  # what one fully used unit saves against the API
    if slack < 0 or (slack == 0 and maint > 0):
        return None
    units = max(1, math.ceil(maint / slack)) if slack > 0 else 1
    return (units * fixed + maint) / (a - b)


def token_grid(lo: float = 1e6, hi: float = 1e9, n: int = 200) -> list[float]:
    """``n`` log-spaced token volumes from ``lo`` to ``hi``."""
    _check(0 < lo < hi and n >= 2, "token_grid needs 0 < lo < hi and n >= 2")
    step = math.log(hi / lo) / (n - 1)
    return [lo * math.exp(i * step) for i in range(n)]


def tco_table(onprem: OnPrem, apis: Sequence[ApiPricing], tokens: Sequence[float]) -> list[dict]:
    """One row per monthly token volume: units, on-prem hw+power and total, and each API's cost.

    Rows are plain dicts (JSON / CSV ready): ``tokens``, ``units``, ``onprem_hw_power``, ``onprem_total`` and
    one key per API name.
    """
    rows = []
    for t in tokens:
        b = onprem_breakdown(onprem, t)
        row = {
            "tokens": float(t),
            "units": b["units"],
            "onprem_hw_power": b["hw_power"],
            "onprem_total": b["total"],
        }
        for api in apis:
            row[api.name] = api_monthly_cost(api, t)
        rows.append(row)
    return rows


# ------------------------------------------------------------------------------------------------------------
# Presets


@dataclass
class Preset:
    onprem: OnPrem
    apis: list[ApiPricing]
    tokens: list[float]
    currency: str
    source: str
    claimed: dict[str, dict[float, float]] = field(
        default_factory=dict
    )  # published API column per token volume
    claimed_break_even: dict[str, str] = field(default_factory=dict)


SEEDS_FX = 1350.0  # "환율 1,350원/달러 적용"
SEEDS_IN_RATIO = 0.7  # "입력:출력 비율 7:3 가정"

PRESETS: dict[str, Preset] = {
    # Seed document 000, "온프레미스 RTX 4090 월간 비용 추산":
    #   | 하드웨어 감가상각 | 구매가 230만원, 3년 상각 | 약 64,000원/월 |
    #   | 전력 | TDP 450W × 24h × 30일 × 130원/kWh | 약 42,000원/월 |
    #   | 포크 유지보수 (엔지니어링) | 시니어 엔지니어 월 4시간 × 80,000원/h | 약 320,000원/월 |
    #   | 합계 | 약 426,000원/월 |
    # So the card draws its full 450 W TDP 24 hours a day for 30 days (no idle power, utilisation 100%):
    # 0.45 kW x 720 h = 324 kWh x 130 = 42,120 KRW; 2,300,000 / 36 months = 63,889 KRW; together 106,009 KRW.
    # Their table has no throughput, so capacity is unlimited here (tps None); try --tps 80 (their headline).
    "seeds": Preset(
        onprem=OnPrem(
            name="RTX 4090 on-prem",
            hw_price=2_300_000,
            years=3,
            power_w=450,
            kwh_price=130,
            hours_per_day=24,
            days_per_month=30,
            utilisation=1.0,
            idle_power_w=None,
            maint_hours=4,
            maint_rate=80_000,
            tps=None,
        ),
        apis=[
            # "Claude 3.5 Haiku ($0.8/M 입력, $4/M 출력)", "GPT-4o-mini ($0.15/M 입력, $0.6/M 출력)"
            ApiPricing("Claude 3.5 Haiku", in_price=0.8, out_price=4.0, in_ratio=SEEDS_IN_RATIO, fx=SEEDS_FX),
            ApiPricing("GPT-4o-mini", in_price=0.15, out_price=0.6, in_ratio=SEEDS_IN_RATIO, fx=SEEDS_FX),
        ],
        tokens=[1e6, 1e7, 5e7, 1e8, 5e8],
        currency="KRW",
        source="shared/seeds/000 (cost table of the MTP + TurboQuant on RTX 4090 write-up)",
        # The seeds' API column as published ("약 ...원"); it does not follow from the prices they state.
        claimed={
            "Claude 3.5 Haiku": {1e6: 6_500, 1e7: 65_000, 5e7: 325_000, 1e8: 650_000, 5e8: 3_250_000},
            "GPT-4o-mini": {1e6: 1_100, 1e7: 11_000, 5e7: 55_000, 1e8: 110_000, 5e8: 550_000},
        },
        # "GPT-4o-mini 대비: 월 약 1억 토큰 이상 ...
        #  유지보수 비용(월 약 32만원)을 포함하면 분기점은 월 약 2~3억 토큰"
        # "Claude 3.5 Haiku 대비: 월 약 1,500만 토큰 이상 ... 유지보수 포함 시 약 3,000만 토큰이 분기점"
        claimed_break_even={
            "Claude 3.5 Haiku": "~15M (hw+power), ~30M (with maintenance)",
            "GPT-4o-mini": "~100M (hw+power), ~200-300M (with maintenance)",
        },
    ),
}


# ------------------------------------------------------------------------------------------------------------
# Reports


_SUFFIXES = {"": 1.0, "K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12, "만": 1e4, "억": 1e8}


def parse_tokens(text: str) -> float:
    """``"100M"``, ``"1.5B"``, ``"5e8"``, ``"100,000,000"``, ``"1억"`` -> tokens."""
    m = re.fullmatch(r"\s*([0-9][0-9_,]*(?:\.[0-9]*)?(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z만억]?)\s*", text)
    if not m or m.group(2).upper() not in _SUFFIXES:
        raise ValueError(f"cannot read a token count from {text!r} (examples: 100M, 1.5B, 5e8, 1억)")
    value = float(m.group(1).replace(",", "").replace("_", "")) * _SUFFIXES[m.group(2).upper()]
    _check(value >= 0, f"token counts must be >= 0, got {text!r}")
    return value


def _fmt_tokens(t: float) -> str:
    for suffix, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if t >= scale:
            return f"{t / scale:,.4g}{suffix}"
    return f"{t:,.0f}"


def _fmt_money(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:,.0f}" if abs(x) >= 100 or x == 0 else f"{x:,.2f}"


def _break_even_summary(onprem: OnPrem, apis: Sequence[ApiPricing]) -> dict[str, dict[str, float | None]]:
    return {
        api.name: {
            "hw_power": break_even_tokens(onprem, api, include_maintenance=False),
            "total": break_even_tokens(onprem, api, include_maintenance=True),
        }
        for api in apis
    }


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
            _fmt_tokens(row["tokens"]),
            str(row["units"]),
            _fmt_money(row["onprem_hw_power"]),
            _fmt_money(row["onprem_total"]),
        ]
        for api in apis:
            cells.append(_fmt_money(row[api.name]))
            if api.name in claimed:
                cells.append(_fmt_money(claimed[api.name].get(row["tokens"])))
        lines.append("| " + " | ".join(cells) + " |")
    b = onprem_breakdown(onprem, 0.0)
    money = _fmt_money
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
            f"capacity: {_fmt_tokens(onprem.capacity)} tokens/month per unit at {onprem.tps:.4g} t/s, "
            f"{onprem.hours_per_day:g} h/day, utilisation {onprem.utilisation:.0%}"
        )
    for api in apis:
        lines.append(
            f"{api.name}: {api.in_ratio:.0%} x {api.in_price:g} + {1 - api.in_ratio:.0%} x "
            f"{api.out_price:g} = {api.usd_per_mtok:.4g} USD per 1M tokens x fx {api.fx:g} = "
            f"{money(api.per_mtok)} {currency} per 1M".rstrip()
        )
    for name, be in _break_even_summary(onprem, apis).items():
        hw, tot = (
            "never" if v is None else f"{_fmt_tokens(v)} tokens/month" for v in (be["hw_power"], be["total"])
        )
        lines.append(f"break-even vs {name}: {hw} (hw+power), {tot} (with maintenance)")
    return "\n".join(lines)


def plot_tco(
    onprem: OnPrem,
    apis: Sequence[ApiPricing],
    path: str | Path,
    tokens: Sequence[float] | None = None,
    currency: str = "",
    claimed: dict[str, dict[float, float]] | None = None,
    title: str | None = None,
) -> Path:
    """Monthly cost curves (log-log), break-even markers, per-unit capacity, and optionally the published
    points ``claimed[api_name][tokens] = cost`` as hollow markers. Writes a PNG and returns its path."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # lazily: the CLI imports this module
    from matplotlib.figure import Figure

    claimed = claimed or {}
    bes = _break_even_summary(onprem, apis)
    if tokens is None:
        points = [v for be in bes.values() for v in be.values() if v] + [
            t for c in claimed.values() for t in c
        ]
        hi = max([1e9, *(2 * v for v in points)])
        tokens = token_grid(1e6, hi, 400)
    fig = Figure(figsize=(9, 5.5), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    cur = f" ({currency})" if currency else ""
    total = [onprem_monthly_cost(onprem, t) for t in tokens]
    hw = [onprem_monthly_cost(onprem, t, include_maintenance=False) for t in tokens]
    ax.plot(tokens, total, color="black", lw=2, label=f"{onprem.name}: hw + power + maintenance")
    ax.plot(tokens, hw, color="black", lw=1.5, ls="--", label=f"{onprem.name}: hw + power")
    colors = ["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown"]
    for i, api in enumerate(apis):
        c = colors[i % len(colors)]
        ax.plot(
            tokens,
            [api_monthly_cost(api, t) for t in tokens],
            color=c,
            lw=1.8,
            label=f"{api.name} ({api.in_price:g}/{api.out_price:g} USD per 1M, {api.in_ratio:.0%} input)",
        )
        for key, marker in (("hw_power", "o"), ("total", "s")):
            t = bes[api.name][key]
            if t is not None and tokens[0] <= t <= tokens[-1]:
                ax.plot([t], [api_monthly_cost(api, t)], marker=marker, color=c, ms=7)
                ax.annotate(
                    _fmt_tokens(t),
                    (t, api_monthly_cost(api, t)),
                    textcoords="offset points",
                    xytext=(6, -12),
                    fontsize=8,
                    color=c,
                )
        if api.name in claimed:
            xs = sorted(claimed[api.name])
            ax.plot(
                xs,
                [claimed[api.name][x] for x in xs],
                ls="none",
                marker="D",
                mfc="none",
                color=c,
                ms=7,
                label=f"{api.name}: seeds' published column",
            )
    ax.set_xscale("log")
    ax.set_yscale("log")
    if onprem.capacity is not None and tokens[0] <= onprem.capacity <= tokens[-1]:
        ax.axvline(onprem.capacity, color="gray", lw=1, ls=":")
        ax.text(
            onprem.capacity,
            0.03,
            f" 1 unit full at {onprem.tps:.4g} t/s",
            rotation=90,
            fontsize=8,
            color="gray",
            transform=ax.get_xaxis_transform(),
            ha="right",
            va="bottom",
        )
    ax.set_xlabel("tokens per month (input + output)")
    ax.set_ylabel(f"cost per month{cur}")
    ax.set_title(title or "Monthly cost: on-prem vs API (o: break-even hw+power, s: with maintenance)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    return path


# ------------------------------------------------------------------------------------------------------------
# Command line


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
        return parse_tokens(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_cli(subparsers) -> argparse.ArgumentParser:
    """Register the ``tco`` subcommand on an argparse subparsers object; returns its parser."""
    p = subparsers.add_parser(
        "tco",
        help="on-prem vs API total cost of ownership: monthly costs, break-even tokens/month, plot",
        description="On-prem vs API monthly cost. Starts from a preset (default: the seeds' RTX 4090 table); "
        "every flag overrides one value. Money in the preset's currency (KRW for seeds).",
    )
    p.add_argument(
        "--preset", choices=sorted(PRESETS), default="seeds", help="starting assumptions (default seeds)"
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
    g.add_argument("--plot", metavar="PATH", help="also write the cost curves as a PNG")
    p.set_defaults(func=run_cli)
    return p


def _from_args(args: argparse.Namespace) -> tuple[OnPrem, list[ApiPricing], list[float], str, dict, Preset]:
    preset = PRESETS[args.preset]
    over = {
        k: getattr(args, k)
        for k in (
            "hw_price",
            "years",
            "power_w",
            "idle_power_w",
            "kwh_price",
            "hours_per_day",
            "days_per_month",
            "utilisation",
            "maint_hours",
            "maint_rate",
            "tps",
        )
    }
    onprem_kw = {**asdict(preset.onprem), **{k: v for k, v in over.items() if v is not None}}
    in_ratio = args.in_ratio
    if args.prefill_tps is not None:
        _check(onprem_kw["tps"] is not None, "--prefill-tps needs --tps (the decode speed)")
        ratio = in_ratio if in_ratio is not None else preset.apis[0].in_ratio if preset.apis else 0.7
        onprem_kw["tps"] = blended_tps(onprem_kw["tps"], args.prefill_tps, ratio)
    onprem = OnPrem(**onprem_kw)
    custom = list(args.api)
    if (args.in_price is None) != (args.out_price is None):
        raise ValueError("--in-price and --out-price go together")
    if args.in_price is not None:
        custom.append((args.api_name, args.in_price, args.out_price))
    if custom:
        ratio = in_ratio if in_ratio is not None else SEEDS_IN_RATIO
        fx = args.fx if args.fx is not None else (preset.apis[0].fx if preset.apis else 1.0)
        apis = [ApiPricing(name, i, o, in_ratio=ratio, fx=fx) for name, i, o in custom]
        claimed = {}
    else:
        apis = [
            ApiPricing(
                a.name,
                a.in_price,
                a.out_price,
                in_ratio=a.in_ratio if in_ratio is None else in_ratio,
                fx=a.fx if args.fx is None else args.fx,
            )
            for a in preset.apis
        ]
        # the published column only makes sense next to the preset's own prices and ratio
        same = all(x.in_ratio == y.in_ratio and x.fx == y.fx for x, y in zip(apis, preset.apis, strict=True))
        claimed = preset.claimed if same else {}
    tokens = list(args.tokens) if args.tokens else list(preset.tokens)
    currency = args.currency if args.currency is not None else preset.currency
    return onprem, apis, tokens, currency, claimed, preset


def run_cli(args: argparse.Namespace) -> int:
    """Print the cost table (or JSON / CSV) for the parsed ``tco`` arguments; write the plot if asked."""
    try:
        onprem, apis, tokens, currency, claimed, preset = _from_args(args)
    except ValueError as e:
        from turbospec.errors import TurboSpecError

        raise TurboSpecError(str(e)) from None
    out = sys.stdout
    if args.format == "json":
        doc = {
            "preset": args.preset,
            "currency": currency,
            "onprem": asdict(onprem),
            "onprem_breakdown": onprem_breakdown(onprem, 0.0),
            "capacity_tokens_per_month": onprem.capacity,
            "apis": [{**asdict(a), "usd_per_mtok": a.usd_per_mtok, "per_mtok": a.per_mtok} for a in apis],
            "rows": tco_table(onprem, apis, tokens),
            "break_even": _break_even_summary(onprem, apis),
            "claimed": {k: {str(int(t)): v for t, v in c.items()} for k, c in claimed.items()},
        }
        out.write(json.dumps(doc, indent=2) + "\n")
    elif args.format == "csv":
        rows = tco_table(onprem, apis, tokens)
        buf = io.StringIO()
        w = csv.DictWriter(buf, fieldnames=list(rows[0]) if rows else ["tokens"], lineterminator="\n")
        w.writeheader()
        w.writerows(rows)
        out.write(buf.getvalue())
    else:
        out.write(format_table(onprem, apis, tokens, currency, claimed) + "\n")
        if claimed:
            for name, text in preset.claimed_break_even.items():
                out.write(f"the seeds claim break-even vs {name}: {text}\n")
    if args.plot:
        path = plot_tco(onprem, apis, args.plot, currency=currency, claimed=claimed)
        print(f"plot written to {path}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m turbospec.lab.tco [flags]``: the same as ``turbospec tco [flags]``."""
    ap = argparse.ArgumentParser(prog="turbospec")
    add_cli(ap.add_subparsers(dest="cmd"))
    args = ap.parse_args(["tco", *(sys.argv[1:] if argv is None else argv)])
    from turbospec.errors import TurboSpecError

    try:
        return run_cli(args)
    except TurboSpecError as e:  # the one-line message turbospec's CLI gives
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
