"""The cost curves as a PNG or SVG file (drawn by `turbospec.lab.plots.tco_figure`; matplotlib is imported only
when a plot is drawn)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from turbospec.lab.tco.pricing import ApiPricing, OnPrem


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
    points ``claimed[api_name][tokens] = cost`` as hollow markers. Writes an SVG for a .svg path, else a PNG, and
    returns its path."""
    from turbospec.lab.plots import save, tco_figure

    return save(tco_figure(onprem, apis, tokens, currency, claimed, title), path)
