"""The inputs of the cost model: an on-prem unit (`OnPrem`) and a pay-per-token API (`ApiPricing`), validated.
Money is in one local currency; API prices are in USD per 1M tokens with an exchange rate."""

from __future__ import annotations

from dataclasses import dataclass

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
        check(self.hw_price >= 0, f"hw_price must be >= 0, got {self.hw_price}")
        check(self.power_w >= 0, f"power_w must be >= 0, got {self.power_w}")
        check(self.kwh_price >= 0, f"kwh_price must be >= 0, got {self.kwh_price}")
        check(self.years > 0, f"years must be > 0, got {self.years}")
        check(0 < self.hours_per_day <= 24, f"hours_per_day must be in (0, 24], got {self.hours_per_day}")
        check(0 < self.days_per_month <= 31, f"days_per_month must be in (0, 31], got {self.days_per_month}")
        check(0 < self.utilisation <= 1, f"utilisation must be in (0, 1], got {self.utilisation}")
        check(self.maint_hours >= 0, f"maint_hours must be >= 0, got {self.maint_hours}")
        check(self.maint_rate >= 0, f"maint_rate must be >= 0, got {self.maint_rate}")
        if self.tps is not None:
            check(self.tps > 0, f"tps must be > 0, got {self.tps}")
        if self.idle_power_w is not None:
            check(
                0 <= self.idle_power_w <= self.power_w,
                f"idle_power_w must be in [0, power_w={self.power_w}], got {self.idle_power_w}",
            )
            check(self.tps is not None, "idle_power_w needs tps: busy hours are tokens / tps")

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
        check(
            self.in_price >= 0 and self.out_price >= 0,
            f"{self.name}: prices must be >= 0, got {self.in_price} / {self.out_price}",
        )
        check(0 <= self.in_ratio <= 1, f"in_ratio must be in [0, 1], got {self.in_ratio}")
        check(self.fx > 0, f"fx must be > 0, got {self.fx}")

    @property
    def usd_per_mtok(self) -> float:
        """Blended USD price of 1M tokens at ``in_ratio``."""
        return self.in_ratio * self.in_price + (1.0 - self.in_ratio) * self.out_price

    @property
    def per_mtok(self) -> float:
        """Blended price of 1M tokens in the local currency."""
        return self.usd_per_mtok * self.fx


def check(ok: bool, message: str) -> None:
    """Raise ValueError(message) unless ok (the command line turns it into a one-line error)."""
    if not ok:
        raise ValueError(message)

