"""The cost model: monthly on-prem cost (units, amortization, electricity, maintenance) and API cost at a
token volume, and the break-even volume."""

from __future__ import annotations

import math
from collections.abc import Sequence

from turbospec.lab.tco.pricing import ApiPricing, OnPrem, check


def blended_tps(decode_tps: float, prefill_tps: float, in_ratio: float) -> float:
    """Tokens/s over a workload with ``in_ratio`` input tokens processed at ``prefill_tps`` and the rest
    generated at ``decode_tps`` (harmonic mix: time per token is the weighted mean of 1/tps)."""
    check(decode_tps > 0 and prefill_tps > 0, "throughputs must be > 0")
    return 1.0 / (in_ratio / prefill_tps + (1.0 - in_ratio) / decode_tps)


def onprem_units(onprem: OnPrem, tokens_per_month: float) -> int:
    """Units needed to serve ``tokens_per_month`` (at least one)."""
    check(tokens_per_month >= 0, f"tokens_per_month must be >= 0, got {tokens_per_month}")
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
    check(tokens_per_month >= 0, f"tokens_per_month must be >= 0, got {tokens_per_month}")
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
    check(0 < lo < hi and n >= 2, "token_grid needs 0 < lo < hi and n >= 2")
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



def break_even_summary(onprem: OnPrem, apis: Sequence[ApiPricing]) -> dict[str, dict[str, float | None]]:
    """Per API name: the break-even tokens/month without (`hw_power`) and with (`total`) maintenance."""
    return {
        api.name: {
            "hw_power": break_even_tokens(onprem, api, include_maintenance=False),
            "total": break_even_tokens(onprem, api, include_maintenance=True),
        }
        for api in apis
    }

