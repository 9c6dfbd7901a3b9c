"""Published starting assumptions (`PRESETS`: the seeds' RTX 4090 table), and applying single overrides to
one."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from turbospec.lab.tco.cost import blended_tps
from turbospec.lab.tco.pricing import ApiPricing, OnPrem, check


@dataclass
class Preset:
    """An on-prem unit, APIs, the token volumes of the table, the currency, and what the source published."""

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



def onprem_for(preset: Preset, overrides: dict[str, float | None] | None = None,
               prefill_tps: float | None = None, in_ratio: float | None = None) -> OnPrem:
    """The preset's on-prem unit with the given `OnPrem` fields replaced (None: keep the preset's). With
    `prefill_tps`, `tps` is the decode speed and the capacity uses the speed blended at `in_ratio` (default:
    the preset's first API's)."""
    onprem_kw = {**asdict(preset.onprem), **{k: v for k, v in (overrides or {}).items() if v is not None}}
    if prefill_tps is not None:
        check(onprem_kw["tps"] is not None, "--prefill-tps needs --tps (the decode speed)")
        ratio = in_ratio if in_ratio is not None else preset.apis[0].in_ratio if preset.apis else 0.7
        onprem_kw["tps"] = blended_tps(onprem_kw["tps"], prefill_tps, ratio)
    return OnPrem(**onprem_kw)


def apis_for(preset: Preset, custom: Sequence[tuple[str, float, float]] = (), in_ratio: float | None = None,
             fx: float | None = None) -> tuple[list[ApiPricing], dict[str, dict[float, float]]]:
    """(APIs, published API costs to show beside them). `custom` (name, USD in, USD out per 1M) replaces the
    preset's APIs; `in_ratio` / `fx` override theirs. The published column is kept only next to the preset's
    own prices, ratio and exchange rate."""
    if custom:
        ratio = in_ratio if in_ratio is not None else SEEDS_IN_RATIO
        fx = fx if fx is not None else (preset.apis[0].fx if preset.apis else 1.0)
        return [ApiPricing(name, i, o, in_ratio=ratio, fx=fx) for name, i, o in custom], {}
    apis = [
        ApiPricing(
            a.name,
            a.in_price,
            a.out_price,
            in_ratio=a.in_ratio if in_ratio is None else in_ratio,
            fx=a.fx if fx is None else fx,
        )
        for a in preset.apis
    ]
    same = all(x.in_ratio == y.in_ratio and x.fx == y.fx for x, y in zip(apis, preset.apis, strict=True))
    return apis, (preset.claimed if same else {})
