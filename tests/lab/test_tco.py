"""Tests for turbospec.lab.tco: the seeds' cost table reproduced, the API column recomputed from the stated
prices, break-even points, capacity steps, and the `tco` command line."""

from __future__ import annotations

import argparse
import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from turbospec.cli.tco import register, run
from turbospec.lab.tco import (
    PRESETS,
    ApiPricing,
    OnPrem,
    api_monthly_cost,
    blended_tps,
    break_even_tokens,
    onprem_breakdown,
    onprem_monthly_cost,
    onprem_units,
    parse_tokens,
    plot_tco,
    tco_table,
    token_grid,
)

SEEDS = PRESETS["seeds"]
HAIKU, MINI = SEEDS.apis


def round_to(x: float, step: float) -> float:
    return round(x / step) * step


# ------------------------------------------------------------------------------------------------------------
# The seeds' figures, computed the way the seeds computed them


def test_seeds_onprem_figures():
    b = onprem_breakdown(SEEDS.onprem, 1e8)
    # "구매가 230만원, 3년 상각 | 약 64,000원/월"
    assert b["amortization"] == pytest.approx(2_300_000 / 36)
    assert round_to(b["amortization"], 1000) == 64_000
    # "TDP 450W × 24h × 30일 × 130원/kWh | 약 42,000원/월": 324 kWh
    assert b["electricity"] == pytest.approx(0.450 * 24 * 30 * 130) == 42_120
    assert round_to(b["electricity"], 1000) == 42_000
    # the on-prem column of their table: "약 106,000원" at every volume (hardware + power only)
    for t in SEEDS.tokens:
        assert round_to(onprem_monthly_cost(SEEDS.onprem, t, include_maintenance=False), 1000) == 106_000
    assert b["hw_power"] == pytest.approx(106_008.89, abs=0.01)
    # "시니어 엔지니어 월 4시간 × 80,000원/h | 약 320,000원/월", "합계 | 약 426,000원/월"
    assert b["maintenance"] == 320_000
    assert round_to(b["total"], 1000) == 426_000
    assert b["units"] == 1  # the seeds assume no capacity limit


def test_seeds_api_column_from_the_stated_prices():
    # Claude 3.5 Haiku $0.8 / $4 per 1M at 7:3: 0.7 * 0.8 + 0.3 * 4 = $1.76 per 1M tokens
    assert HAIKU.usd_per_mtok == pytest.approx(1.76)
    assert api_monthly_cost(HAIKU, 1e8) / HAIKU.fx == pytest.approx(176.0)
    assert api_monthly_cost(HAIKU, 1e8) == pytest.approx(237_600)
    # GPT-4o-mini $0.15 / $0.6: $0.285 per 1M -> 100M tokens = $28.50 = 38,475 KRW
    assert MINI.usd_per_mtok == pytest.approx(0.285)
    assert api_monthly_cost(MINI, 1e8) == pytest.approx(38_475)
    assert round_to(api_monthly_cost(MINI, 1e8), 500) == 38_500


def test_seeds_published_api_column_does_not_follow_from_their_prices():
    # The seeds' table says 650,000 and 110,000 KRW at 100M tokens: 2.7x and 2.9x the stated prices.
    assert SEEDS.claimed["Claude 3.5 Haiku"][1e8] == 650_000
    assert SEEDS.claimed["GPT-4o-mini"][1e8] == 110_000
    for api, ratio in ((HAIKU, 2.736), (MINI, 2.859)):
        for t, published in SEEDS.claimed[api.name].items():
            assert published / api_monthly_cost(api, t) == pytest.approx(ratio, rel=2e-3)


def test_break_even_points_with_the_corrected_api_column():
    hw = 2_300_000 / 36 + 42_120
    total = hw + 320_000
    assert break_even_tokens(SEEDS.onprem, HAIKU, include_maintenance=False) == pytest.approx(hw / 2376 * 1e6)
    assert break_even_tokens(SEEDS.onprem, HAIKU) == pytest.approx(total / 2376 * 1e6)
    assert break_even_tokens(SEEDS.onprem, MINI, include_maintenance=False) == pytest.approx(
        hw / 384.75 * 1e6
    )
    assert break_even_tokens(SEEDS.onprem, MINI) == pytest.approx(total / 384.75 * 1e6)
    # in round numbers: Haiku 44.6M / 179M, GPT-4o-mini 276M / 1.11B tokens per month
    got = [
        break_even_tokens(SEEDS.onprem, api, include_maintenance=m) / 1e6
        for api in (HAIKU, MINI)
        for m in (False, True)
    ]
    assert [round(x, 1) for x in got] == [44.6, 179.3, 275.5, 1107.2]
    # the seeds said ~15M / ~30M (Haiku) and ~100M / ~200-300M (GPT-4o-mini)


def test_seeds_table_rows():
    rows = tco_table(SEEDS.onprem, SEEDS.apis, SEEDS.tokens)
    assert [r["tokens"] for r in rows] == [1e6, 1e7, 5e7, 1e8, 5e8]
    assert [round(r["Claude 3.5 Haiku"]) for r in rows] == [2_376, 23_760, 118_800, 237_600, 1_188_000]
    assert [round(r["GPT-4o-mini"]) for r in rows] == [385, 3_848, 19_238, 38_475, 192_375]
    assert all(round(r["onprem_hw_power"]) == 106_009 and round(r["onprem_total"]) == 426_009 for r in rows)


# ------------------------------------------------------------------------------------------------------------
# Capacity, utilisation, idle power


def test_capacity_and_units_at_80_tps():
    box = OnPrem(hw_price=2_300_000, power_w=450, kwh_price=130, tps=80)
    assert box.capacity == pytest.approx(80 * 3600 * 24 * 30)  # 207.36M tokens a month
    assert onprem_units(box, box.capacity) == 1
    assert onprem_units(box, box.capacity + 1) == 2
    assert onprem_units(box, 5e8) == 3
    assert onprem_monthly_cost(box, 5e8) == pytest.approx(3 * (2_300_000 / 36 + 42_120))
    # GPT-4o-mini: one full card (207M tokens) costs the API 79,782 KRW < 106,009: on-prem never wins
    assert break_even_tokens(box, MINI, include_maintenance=False) is None
    # Haiku: break-even below one card's capacity, unchanged by the limit
    assert break_even_tokens(box, HAIKU, include_maintenance=False) == pytest.approx(44.62e6, rel=1e-3)


def test_break_even_needing_several_units():
    # At 43 t/s (the seeds' baseline without MTP) one card serves 111.5M tokens; with maintenance Haiku
    # only breaks even with 3 cards: (3 * 106,009 + 320,000) / 2,376 per 1M = 268.5M tokens.
    box = OnPrem(hw_price=2_300_000, power_w=450, kwh_price=130, tps=43, maint_hours=4, maint_rate=80_000)
    t = break_even_tokens(box, HAIKU)
    assert onprem_units(box, t) == 3
    assert t == pytest.approx((3 * (2_300_000 / 36 + 42_120) + 320_000) / 2376 * 1e6)
    assert onprem_monthly_cost(box, t) == pytest.approx(api_monthly_cost(HAIKU, t))


def test_utilisation_and_hours_scale_capacity():
    box = OnPrem(hw_price=1, power_w=100, kwh_price=100, tps=10, hours_per_day=8, utilisation=0.5)
    assert box.capacity == pytest.approx(10 * 3600 * 8 * 30 * 0.5)
    assert onprem_breakdown(box)["electricity"] == pytest.approx(0.1 * 8 * 30 * 100)


def test_idle_power_makes_electricity_follow_the_load():
    box = OnPrem(hw_price=0, power_w=450, idle_power_w=30, kwh_price=130, tps=80)
    hours = 24 * 30
    assert onprem_breakdown(box, 0)["electricity"] == pytest.approx(0.030 * hours * 130)
    full = box.capacity
    assert onprem_breakdown(box, full)["electricity"] == pytest.approx(0.450 * hours * 130)
    half = onprem_breakdown(box, full / 2)["electricity"]
    assert half == pytest.approx((0.030 + 0.450) / 2 * hours * 130)


def test_blended_tps():
    # 70% prompt tokens at 1000 t/s, 30% generated at 80 t/s: 0.7/1000 + 0.3/80 s per token
    assert blended_tps(80, 1000, 0.7) == pytest.approx(1 / (0.7 / 1000 + 0.3 / 80))
    assert blended_tps(80, 1000, 0.0) == pytest.approx(80)


@settings(max_examples=60, deadline=None)
@given(
    hw=st.floats(1e5, 1e7),
    power=st.floats(50, 1000),
    maint=st.floats(0, 1e6),
    tps=st.one_of(st.none(), st.floats(5, 500)),
    price=st.floats(0.05, 20),
)
def test_break_even_is_the_first_crossing(hw, power, maint, tps, price):
    box = OnPrem(hw_price=hw, power_w=power, kwh_price=130, maint_hours=1, maint_rate=maint, tps=tps)
    api = ApiPricing("x", in_price=price, out_price=price, fx=1350)
    t = break_even_tokens(box, api)
    hi = t if t is not None else 1e12
    for x in token_grid(1e3, hi * (1 - 1e-9), 60):  # API strictly cheaper before the break-even point
        assert api_monthly_cost(api, x) < onprem_monthly_cost(box, x)
    if t is not None:
        assert onprem_monthly_cost(box, t) == pytest.approx(api_monthly_cost(api, t), rel=1e-9)


def test_validation():
    with pytest.raises(ValueError, match="years"):
        OnPrem(hw_price=1, power_w=1, kwh_price=1, years=0)
    with pytest.raises(ValueError, match="utilisation"):
        OnPrem(hw_price=1, power_w=1, kwh_price=1, utilisation=1.5)
    with pytest.raises(ValueError, match="idle_power_w needs tps"):
        OnPrem(hw_price=1, power_w=100, kwh_price=1, idle_power_w=10)
    with pytest.raises(ValueError, match="in_ratio"):
        ApiPricing("x", 1, 1, in_ratio=1.2)
    with pytest.raises(ValueError):
        api_monthly_cost(HAIKU, -1)


def test_parse_tokens():
    assert parse_tokens("100M") == 1e8
    assert parse_tokens("1.5B") == 1.5e9
    assert parse_tokens("5e8") == 5e8
    assert parse_tokens("100,000,000") == 1e8
    assert parse_tokens("1억") == 1e8
    assert parse_tokens("1500만") == 1.5e7
    with pytest.raises(ValueError):
        parse_tokens("lots")


# ------------------------------------------------------------------------------------------------------------
# Command line and plot


def parse(*argv: str) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="turbospec")
    register(ap.add_subparsers(dest="cmd"))
    return ap.parse_args(["tco", *argv])


def test_cli_seeds_table(capsys):
    assert run(parse("--preset", "seeds")) == 0
    out = capsys.readouterr().out
    assert "| 100M | 1 | 106,009 | 426,009 | 237,600 | 650,000 | 38,475 | 110,000 |" in out
    assert "amortization 63,889" in out and "electricity 42,120" in out
    assert "break-even vs Claude 3.5 Haiku: 44.62M tokens/month (hw+power), 179.3M tokens/month" in out
    assert "the seeds claim break-even vs GPT-4o-mini" in out


def test_cli_overrides_and_json(capsys):
    args = parse("--tps", "80", "--maint-hours", "0", "--tokens", "1M", "500M", "--format", "json")
    assert run(args) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["capacity_tokens_per_month"] == pytest.approx(207_360_000)
    assert [r["units"] for r in doc["rows"]] == [1, 3]
    assert doc["rows"][1]["onprem_total"] == pytest.approx(3 * (2_300_000 / 36 + 42_120))
    assert doc["break_even"]["GPT-4o-mini"]["total"] is None


def test_cli_custom_api_and_csv(capsys):
    args = parse(
        "--api",
        "cheap:0.1:0.4",
        "--in-price",
        "1",
        "--out-price",
        "5",
        "--api-name",
        "dear",
        "--in-ratio",
        "0.5",
        "--fx",
        "1",
        "--tokens",
        "1e6",
        "--format",
        "csv",
    )
    assert run(args) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0] == "tokens,units,onprem_hw_power,onprem_total,cheap,dear"
    cells = lines[1].split(",")
    assert float(cells[4]) == pytest.approx(0.25) and float(cells[5]) == pytest.approx(3.0)


def test_cli_errors_are_one_line():
    from turbospec.errors import TurboSpecError

    with pytest.raises(TurboSpecError, match="utilisation"):
        run(parse("--utilisation", "0"))
    with pytest.raises(TurboSpecError, match="--in-price and --out-price"):
        run(parse("--in-price", "1"))
    with pytest.raises(SystemExit):
        parse("--tokens", "many")


def test_turbospec_cli_registers_tco(capsys):
    from turbospec.cli.main import main

    assert main(["tco", "--tokens", "100M"]) == 0
    assert "237,600" in capsys.readouterr().out


def test_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    path = plot_tco(SEEDS.onprem, SEEDS.apis, tmp_path / "tco.png", currency="KRW", claimed=SEEDS.claimed)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert run(parse("--tps", "80", "--plot", str(tmp_path / "cli.png"))) == 0
    assert (tmp_path / "cli.png").stat().st_size > 10_000
    assert math.isfinite(onprem_monthly_cost(SEEDS.onprem))
