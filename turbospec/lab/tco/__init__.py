"""Total cost of ownership, on-prem inference box vs a pay-per-token API.

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
Everything is in one local currency (KRW for the seeds' preset). Importing this package is cheap: matplotlib
is imported only by :func:`plot_tco`.

Modules: `pricing` (the inputs), `cost` (the cost model), `presets` (published assumptions and overrides),
`report` (tables, JSON, CSV), `plot` (the PNG or SVG file, drawn by `turbospec.lab.plots`). The command line
is `turbospec.cli.tco`.
"""


from turbospec.lab.tco.cost import (
    api_monthly_cost,
    blended_tps,
    break_even_summary,
    break_even_tokens,
    onprem_breakdown,
    onprem_monthly_cost,
    onprem_units,
    tco_table,
    token_grid,
)
from turbospec.lab.tco.plot import plot_tco
from turbospec.lab.tco.presets import PRESETS, SEEDS_FX, SEEDS_IN_RATIO, Preset, apis_for, onprem_for
from turbospec.lab.tco.pricing import MONTHS_PER_YEAR, ApiPricing, OnPrem
from turbospec.lab.tco.report import fmt_money, fmt_tokens, format_table, parse_tokens, render

__all__ = [
    "MONTHS_PER_YEAR",
    "PRESETS",
    "SEEDS_FX",
    "SEEDS_IN_RATIO",
    "ApiPricing",
    "OnPrem",
    "Preset",
    "api_monthly_cost",
    "apis_for",
    "blended_tps",
    "break_even_summary",
    "break_even_tokens",
    "fmt_money",
    "fmt_tokens",
    "format_table",
    "onprem_breakdown",
    "onprem_for",
    "onprem_monthly_cost",
    "onprem_units",
    "parse_tokens",
    "plot_tco",
    "render",
    "tco_table",
    "token_grid",
]
