"""The cost curves as a PNG (matplotlib is imported only when a plot is drawn)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from turbospec.lab.tco.cost import api_monthly_cost, break_even_summary, onprem_monthly_cost, token_grid
from turbospec.lab.tco.pricing import ApiPricing, OnPrem
from turbospec.lab.tco.report import fmt_tokens


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
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # lazily: importing the package stays cheap
    from matplotlib.figure import Figure

    claimed = claimed or {}
    bes = break_even_summary(onprem, apis)
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
                    fmt_tokens(t),
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
