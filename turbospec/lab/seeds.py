"""The seeds' tables in one command (`turbospec lab seeds`).

The seed write-ups compare engines by one table: code t/s, prose t/s, TTFT, peak memory, the speed lost from a
short to a long context, acceptance, and next to it what the KV format costs in quality and what the speed is
worth against an API. This runs every configured engine — turbospec in each named configuration
(`turbospec.lab.bench.run_local`) and any OpenAI-compatible server (`turbospec.lab.client.run_remote`) — over the
shipped code and prose prompts at each context depth, measures the KLD of every K/V format used against f16/f16
on the local model (`turbospec.lab.quality.run_quality`), and feeds each engine's t/s to the cost model of
`turbospec.lab.tco`. Nothing is measured here that those modules do not measure; this module only chooses the
runs and folds their rows into the two tables.
"""

from __future__ import annotations

import gc
import statistics
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from turbospec import dtypes
from turbospec.config import EngineConfig
from turbospec.errors import TurboSpecError
from turbospec.lab import bench, client, quality, tco
from turbospec.lab.progress import progress
from turbospec.lab.report import console_table, env_info, markdown_header, markdown_table, write_json
from turbospec.lab.workload import BenchOptions, load_prompts

# the shipped prompt set's categories (turbospec/data/prompts.json) by kind; "math" is neither
CODE_CATEGORIES = ("code", "code_cpp", "long_code_review")
PROSE_CATEGORIES = ("explain", "summarize", "qa_factual", "translation", "creative")
DEEP_DEPTH = 4096  # the default deeper depth, or half the model's context when that is less
SEEDS_COLUMNS = [("label", "engine"), ("kv", "K/V"), ("code_tps", "code t/s"), ("prose_tps", "prose t/s"),
                 ("ttft_ms", "TTFT ms"), ("peak_mib", "peak MiB"), ("loss_pct", "speed lost"),
                 ("acc_rate", "acceptance"), ("kld_mean", "KLD")]


@dataclass(frozen=True)
class UrlTarget:
    """An OpenAI-compatible server: its base URL (…/v1), a label, and the K/V pair its cache uses (for KLD)."""

    url: str
    name: str | None = None
    kv: str | None = None  # "K/V", e.g. "q8_0/q8_0"; None: KLD left blank


@dataclass(frozen=True)
class SeedsOptions:
    """What `run_seeds` measures: generated tokens, repetitions and depths of the speed runs, the code and prose
    prompt categories, the KLD run (text, chunk size, chunks, baseline) and the cost preset."""

    n_gen: int = 128
    repetitions: int = 3
    warmup: int = 1
    depths: tuple[int, ...] | None = None  # None: 0 and min(DEEP_DEPTH, half the model's context)
    code: tuple[str, ...] = CODE_CATEGORIES
    prose: tuple[str, ...] = PROSE_CATEGORIES
    temp: float = 0.0
    seed: int = 0
    kld: bool = True
    kld_text: str = str(quality.EVAL_DIR / "prose.jsonl")
    kld_ctx: int = 512
    kld_chunks: int = 4
    baseline: str = "f16/f16"
    preset: str = "seeds"
    api_key: str | None = None
    quiet: bool = False

    def __post_init__(self) -> None:
        if not self.code or not self.prose:
            raise TurboSpecError("--code and --prose each need at least one prompt category")
        both = set(self.code) & set(self.prose)
        if both:
            raise TurboSpecError(f"prompt categories in both --code and --prose: {', '.join(sorted(both))}")
        load_prompts(",".join(self.code + self.prose))  # unknown categories: a one-line error
        if self.depths is not None and (not self.depths or min(self.depths) < 0):
            raise TurboSpecError("--depths: one or more depths >= 0")
        if self.kld_ctx < 8 or self.kld_chunks < 1:
            raise TurboSpecError("--kld-ctx must be >= 8 and --kld-chunks >= 1")
        if self.preset not in tco.PRESETS:
            raise TurboSpecError(f"unknown cost preset {self.preset!r} (have: {', '.join(tco.PRESETS)})")
        quality.parse_pair(self.baseline)
        BenchOptions(n_gen=self.n_gen, repetitions=self.repetitions, warmup=self.warmup)  # their checks

    @property
    def categories(self) -> str:
        return ",".join(self.code + self.prose)


def kv_pair(config: EngineConfig) -> str:
    """The K/V formats of `config`'s cache as `K/V` (an unset format is the model dtype's, f32 for float32)."""
    own = dtypes.short_name(config.dtype)
    return f"{config.cache_type_k or own}/{config.cache_type_v or own}"


def default_depths(config: EngineConfig | None) -> tuple[int, ...]:
    """0 and the deeper default: DEEP_DEPTH, or half the model's context when that is smaller."""
    deep = DEEP_DEPTH
    if config is not None:
        try:
            from turbospec.engine.build import model_path
            from turbospec.model.gguf import GGUFFile, is_gguf
            from turbospec.model.loader import load_config

            path = model_path(config.model)
            cfg = GGUFFile(path).config() if is_gguf(path) else load_config(path)
            deep = min(deep, cfg.max_position_embeddings // 2)
        except (TurboSpecError, OSError, ValueError):
            pass
    return (0, deep) if deep > 0 else (0,)


def check_url(url: str, api_key: str | None, timeout: float = 10) -> None:
    """A one-line error unless something answers HTTP at `url` (any status: the measurement tells the rest)."""
    if not url.startswith(("http://", "https://")):
        raise TurboSpecError(f"--url {url!r}: expected an http(s) base URL such as http://127.0.0.1:8080/v1")
    req = client.request(client.api_base(url) + "/models", api_key)
    try:
        with urllib.request.urlopen(req, timeout=timeout):
            pass
    except urllib.error.HTTPError:
        pass  # it answered
    except (urllib.error.URLError, OSError, ValueError) as e:
        reason = getattr(e, "reason", e)
        raise TurboSpecError(f"--url {url}: cannot reach the server ({' '.join(str(reason).split())[:120]})") from None


def _reset_peak_rss() -> None:
    """Start the process's peak resident set size afresh (Linux: /proc/self/clear_refs 5), so each configuration
    reports its own peak rather than the largest so far; elsewhere peaks only grow."""
    gc.collect()
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
    except OSError:
        pass


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def seeds_rows(runs: list[dict[str, Any]], kld: dict[str, float], code: tuple[str, ...] | list[str],
               prose: tuple[str, ...] | list[str]) -> list[dict[str, Any]]:
    """One row per engine configuration from its bench / client rows (`runs`: dicts with engine, config, kv and
    rows) and the mean KLD per K/V pair: code and prose t/s (median over the categories' decode t/s at the
    shallowest depth), TTFT (median over both), peak memory (largest), speed lost from the shallowest to the
    deepest depth (median over categories, %), acceptance (median, spec rows only), the row's KLD."""
    out = []
    for run in runs:
        rows = run["rows"]
        depths = sorted({r.get("depth", 0) for r in rows})
        d0, dn = depths[0], depths[-1]
        at0 = [r for r in rows if r.get("depth", 0) == d0]
        code0 = [r for r in at0 if r["category"] in code]
        prose0 = [r for r in at0 if r["category"] in prose]
        row: dict[str, Any] = {
            "engine": run["engine"], "config": run["config"], "label": run.get("label") or run["engine"],
            "kv": run.get("kv"),
            "code_tps": _median([r["decode_tps"] for r in code0]),
            "prose_tps": _median([r["decode_tps"] for r in prose0]),
            "ttft_ms": _median([r["ttft_ms"] for r in code0 + prose0]),
            "peak_mib": max((r["peak_rss_mib"] for r in rows if r.get("peak_rss_mib") is not None), default=None),
            "depth_min": d0, "depth_max": dn, "loss_pct": None,
            "acc_rate": _median([r["acc_rate"] for r in at0 if r.get("acc_rate") is not None]),
            "code_acc": _median([r["acc_rate"] for r in code0 if r.get("acc_rate") is not None]),
            "prose_acc": _median([r["acc_rate"] for r in prose0 if r.get("acc_rate") is not None]),
            "kld_mean": kld.get(run["kv"]) if run.get("kv") else None,
        }
        if dn > d0:
            base = {r["category"]: r["decode_tps"] for r in at0}
            deep = {r["category"]: r["decode_tps"] for r in rows if r.get("depth", 0) == dn}
            row["loss_pct"] = _median([100.0 * (1 - deep[c] / base[c]) for c in deep if base.get(c)])
        out.append(row)
    return out


def cost_tables(rows: list[dict[str, Any]], preset_name: str = "seeds") -> dict[str, Any]:
    """The `turbospec tco` model fed by each row's t/s (the mean of its code and prose t/s, as `tco --tps`):
    per engine the tco rows, break-even volumes and tco's own Markdown table, plus one combined table
    (token volumes x APIs and engines)."""
    preset = tco.PRESETS[preset_name]
    apis, claimed = tco.apis_for(preset)
    tokens = list(preset.tokens)
    engines = []
    for r in rows:
        speeds = [s for s in (r["code_tps"], r["prose_tps"]) if s]
        tps = statistics.fmean(speeds) if speeds else None
        onprem = tco.onprem_for(preset, {"tps": tps})
        engines.append({"label": r["label"], "engine": r["engine"], "config": r["config"], "tps": tps,
                        "capacity_tokens_per_month": onprem.capacity,
                        "rows": tco.tco_table(onprem, apis, tokens),
                        "break_even": tco.break_even_summary(onprem, apis),
                        "table": tco.format_table(onprem, apis, tokens, preset.currency, claimed)})
    cur = f" ({preset.currency})"
    head = ["tokens/month"] + [a.name + cur for a in apis]
    head += [f"{e['label']} @ {e['tps']:.1f} t/s" if e["tps"] else e["label"] for e in engines]
    cells = []
    for i, t in enumerate(tokens):
        line = [tco.fmt_tokens(t)] + [tco.fmt_money(tco.api_monthly_cost(a, t)) for a in apis]
        for e in engines:
            er = e["rows"][i]
            line.append(f"{tco.fmt_money(er['onprem_total'])} ({er['units']} unit{'s' if er['units'] > 1 else ''})")
        cells.append(line)
    notes = []
    for e in engines:
        for api, be in e["break_even"].items():
            hw, tot = ("never" if v is None else tco.fmt_tokens(v) for v in (be["hw_power"], be["total"]))
            notes.append(f"{e['label']}: break-even vs {api} at {tot} tokens/month ({hw} without maintenance)")
    return {"preset": preset_name, "source": preset.source, "currency": preset.currency, "tokens": tokens,
            "apis": [asdict(a) for a in apis], "engines": engines, "head": head, "cells": cells, "notes": notes}


def _fmt(v: Any, kind: str) -> str:
    if v is None:
        return ""
    if kind == "loss_pct":
        return f"{-v:+.1f}%"
    if kind == "acc_rate":
        return f"{100 * v:.1f}%"
    if kind == "kld_mean":
        return "0" if v == 0 else f"{v:.3g}"  # 3 significant digits: q8_0's KLD is ~1e-6 on small models
    if kind == "peak_mib":
        return f"{v:,.0f}"
    if isinstance(v, float):
        return f"{v:.1f}"
    return str(v)


def table_cells(report: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """The seeds' table as (header, rows of strings): blank where a value is unknown."""
    rows = report["rows"]
    dn = max((r["depth_max"] for r in rows), default=0)
    d0 = min((r["depth_min"] for r in rows), default=0)
    names = {"loss_pct": f"speed lost {d0}->{dn}", "kld_mean": f"KLD vs {report['settings'].get('baseline', 'f16/f16')}"}
    head = [names.get(k, h) for k, h in SEEDS_COLUMNS]
    return head, [[_fmt(r.get(k), k) for k, _ in SEEDS_COLUMNS] for r in rows]


def _md(head: list[str], cells: list[list[str]]) -> str:
    return markdown_table([dict(zip(head, c, strict=True)) for c in cells], head)


def run_seeds(configs: list[tuple[str, EngineConfig]], urls: list[UrlTarget], opts: SeedsOptions,
              settings: dict[str, Any] | None = None, kld_config: EngineConfig | None = None) -> dict[str, Any]:
    """Measure each named turbospec configuration and each server over the code and prose prompts at each depth,
    the KLD of the K/V pairs used (on `kld_config`'s model, default the first configuration's), and the cost
    table; the report (env, settings, rows, runs, kld, cost)."""
    if not configs and not urls:
        raise TurboSpecError("nothing to measure: no turbospec configuration and no --url")
    for u in urls:
        if u.kv is not None:
            quality.parse_pair(u.kv)
        check_url(u.url, opts.api_key)
    kld_config = kld_config or (configs[0][1] if configs else None)
    depths = tuple(sorted(set(opts.depths))) if opts.depths is not None else default_depths(kld_config)
    longest = max(len(t.encode()) for t in load_prompts(opts.categories).values())  # >= its tokens
    bopts = BenchOptions(n_prompt=longest, n_gen=opts.n_gen, repetitions=opts.repetitions, warmup=opts.warmup,
                         depths=depths, categories=opts.categories, temp=opts.temp, seed=opts.seed,
                         quiet=opts.quiet)
    if settings is None:
        settings = {"configs": {n: c.to_dict() for n, c in configs}, "urls": [asdict(u) for u in urls],
                    **{k: v for k, v in asdict(opts).items() if k != "api_key"}}
    settings = {**settings, "depths": list(depths)}
    stages = len(configs) + len(urls) + int(opts.kld)
    bar = progress(stages, "seeds", opts.quiet)
    runs: list[dict[str, Any]] = []
    env: dict[str, Any] | None = None
    for name, cfg in configs:
        bar.set_postfix_str(f"turbospec {name}")
        _reset_peak_rss()
        rep = bench.run_local(cfg, bopts, {})
        env = env or rep["env"]
        for r in rep["rows"]:
            r["engine"], r["config"] = "turbospec", name
        runs.append({"engine": "turbospec", "config": name, "label": f"turbospec {name}", "kv": kv_pair(cfg),
                     "rows": rep["rows"]})
        bar.update(1)
    for u in urls:
        label = u.name or u.url
        bar.set_postfix_str(label)
        rep = client.run_remote([u.url], bopts, opts.api_key, {})
        for r in rep["rows"]:
            r["engine"] = label
        runs.append({"engine": label, "config": "server", "label": label, "kv": u.kv, "url": u.url,
                     "rows": rep["rows"]})
        bar.update(1)
    kld_rows: list[dict[str, Any]] = []
    pairs = list(dict.fromkeys(r["kv"] for r in runs if r["kv"]))
    if opts.kld and pairs and kld_config is not None:
        bar.set_postfix_str("KLD")
        qopts = quality.QualityOptions(text=opts.kld_text, ctxs=(opts.kld_ctx,), chunks=opts.kld_chunks,
                                       pairs=tuple(pairs), baseline=opts.baseline, quiet=opts.quiet)
        qrep = quality.run_quality(kld_config.replace(cache_type_k=None, cache_type_v=None), qopts, {})
        kld_rows = qrep["perplexity"]
        env = env or qrep["env"]
    if opts.kld:
        bar.update(1)
    bar.close()
    kld = {r["kv"]: r["kld_mean"] for r in kld_rows}
    rows = seeds_rows(runs, kld, opts.code, opts.prose)
    return {"kind": "seeds", "env": env or env_info(None), "settings": settings, "rows": rows, "runs": runs,
            "kld": kld_rows, "cost": cost_tables(rows, opts.preset)}


def markdown_report(report: dict[str, Any]) -> str:
    """report.md: the seeds' table, the cost table, then the details (per category rows, KLD, tco per engine)."""
    head, cells = table_cells(report)
    cost = report["cost"]
    md = markdown_header("turbospec lab seeds", report)
    md += ["## The seeds' table", "",
           "code / prose t/s: decode, median over the categories at the shallowest depth; TTFT: median over both; "
           "speed lost: median over categories from the shallowest to the deepest depth; acceptance: median "
           "(speculating configurations only); KLD: mean over the scored tokens, this row's K/V formats vs the "
           "baseline on the local model; peak MiB: peak RSS of the local engine (blank for servers).", "",
           _md(head, cells), "",
           f"## Cost (`turbospec tco --preset {cost['preset']}` fed by the measured t/s)", "",
           "Each engine's on-prem column uses the mean of its code and prose t/s as `--tps` (capacity per unit); "
           f"money in {cost['currency']}. Source of the preset: {cost['source']}.", "",
           _md(cost["head"], cost["cells"]), ""]
    md += [f"- {n}" for n in cost["notes"]]
    md += ["", "## Per category (median of repetitions)", ""]
    detail = [r for run in report["runs"] for r in run["rows"]]
    cols = [c for c in ("engine", "config", "depth", "category", "prefill_tps", "decode_tps", "ttft_ms",
                        "tpot_ms", "acc_rate", "mean_acc_len", "peak_rss_mib") if any(c in r for r in detail)]
    md += [markdown_table(detail, cols), ""]
    if report["kld"]:
        md += ["## KLD of the K/V formats used", "", markdown_table(report["kld"], quality.PPL_COLUMNS), ""]
    for e in cost["engines"]:
        md += [f"## tco: {e['label']}", "", e["table"], ""]
    return "\n".join(md)


def write_reports(report: dict[str, Any], out: Path, plot_formats: tuple[str, ...] = ("png",)) -> list[Path]:
    """report.json, report.md and the plots (code vs prose t/s, KLD against bits per value) into directory `out`;
    the files written."""
    from turbospec.lab import plots

    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "report.json", report)
    (out / "report.md").write_text(markdown_report(report))
    return [out / "report.json", out / "report.md", *plots.write_figures(report, out, plot_formats)]


def print_tables(report: dict[str, Any]) -> None:
    """The seeds' table and the cost table on stdout (`report.console_table`), then the cost notes."""
    head, cells = table_cells(report)
    cost = report["cost"]
    console_table("the seeds' table (turbospec lab seeds)", head, cells, right_align=True)
    console_table(f"cost: tco --preset {cost['preset']} at the measured t/s ({cost['currency']})", cost["head"],
                  cost["cells"], right_align=True)
    for n in cost["notes"]:
        print(n)
