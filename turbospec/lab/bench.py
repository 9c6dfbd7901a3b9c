"""Speed of the local engine with the reproducibility checklist built in (`turbospec bench`).

Defaults follow the seeds' checklist (see `BenchOptions`): median of the repetitions with min/max and
mean +- sd. Sweeps (`key=v1,v2`) form a cartesian product of `EngineConfig`s; depths fill the context first
(llama-bench -d) and report the speed loss vs depth 0; categories use the shipped prompt set instead of random
tokens. The report writers here serve `turbospec.lab.client` (servers) too.
"""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import Iterable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from turbospec.config import EngineConfig
from turbospec.engine import build_engine
from turbospec.engine.build import assemble_engine, load_parts
from turbospec.errors import TurboSpecError
from turbospec.kv.fill import fill_random
from turbospec.lab import plots
from turbospec.lab.progress import loading, progress
from turbospec.lab.report import env_info, markdown_header, markdown_table, summarize, write_csv, write_json
from turbospec.lab.workload import BenchOptions, load_prompts
from turbospec.sampling import SamplingParams

# sweep key -> (the EngineConfig.replace keys it changes, the value's type)
SWEEP_KEYS: dict[str, tuple[tuple[str, ...], type]] = {
    "ctk": (("cache_type_k",), str), "ctv": (("cache_type_v",), str),
    "kv": (("cache_type_k", "cache_type_v"), str), "spec-type": (("spec_types",), str),
    "n-max": (("spec_n_max",), int), "ub": (("ubatch",), int), "dtype": (("dtype",), str),
    "threads": (("threads",), int), "ctkd": (("spec_draft_k_type",), str),
    "draft-vocab": (("spec_draft_vocab",), int), "p-min": (("spec_p_min",), float),
    "mtp-window": (("spec_mtp_prompt_window",), int), "mtp-topk": (("spec_mtp_topk",), int),
}


def parse_sweeps(items: list[str]) -> list[dict[str, str]]:
    """`["ctk=f16,q8_0", "ub=8,16"]` -> the cartesian product as `{key: value}` points (`[{}]` for none)."""
    axes: list[list[tuple[str, str]]] = []
    for it in items:
        if "=" not in it:
            raise TurboSpecError(f"--sweep expects key=v1,v2 (got {it!r})")
        key, vals = it.split("=", 1)
        key = key.strip()
        if key not in SWEEP_KEYS:
            raise TurboSpecError(f"unknown sweep key {key!r} (keys: {', '.join(SWEEP_KEYS)})")
        axes.append([(key, v.strip()) for v in vals.split(",") if v.strip()])
    return [dict(c) for c in itertools.product(*axes)] if axes else [{}]


def apply_sweep(config: EngineConfig, point: dict[str, str]) -> EngineConfig:
    """`config` with one sweep point's values, each in its option's type; `none` unsets a value, and spec-type
    chains are written with `+` (ngram-mod+draft-mtp)."""
    changes: dict[str, Any] = {}
    for key, value in point.items():
        names, kind = SWEEP_KEYS[key]
        for name in names:
            if value == "none":
                changes[name] = () if name == "spec_types" else None
            elif name == "spec_types":
                changes[name] = value.replace("+", ",")
            else:
                try:
                    changes[name] = kind(value)
                except ValueError:
                    raise TurboSpecError(f"sweep {key}={value}: expected {kind.__name__}") from None
    try:
        return config.replace(**changes)
    except TypeError:
        raise TurboSpecError(f"sweep {point_name(point)}: 'none' is not a value of every key") from None


def run_local(config: EngineConfig, opts: BenchOptions, settings: dict[str, Any] | None = None
              ) -> dict[str, Any]:
    """Measure every sweep point x depth x prompt category of `config`; the report (env, settings, rows).
    `settings` is recorded as given (the command line passes its flags); default: config and options. With
    `opts.interleave` every point's engine is built first (points of one dtype share one copy of the weights) and
    each repetition runs every point back to back, in alternating order: rows gain the paired ratios to the first
    point (`decode_ratio`, `prefill_ratio`)."""
    points = parse_sweeps(list(opts.sweep))
    depths = list(opts.depths)
    prompts = load_prompts(opts.categories) if opts.categories else None
    rows: list[dict[str, Any]] = []
    total = len(points) * len(depths) * (len(prompts) if prompts else 1)
    bar = progress(total, "bench", opts.quiet)
    ctx = max(config.ctx, max(depths) + opts.n_prompt + opts.n_gen + 16, 4096 if prompts else 0)
    configs = [apply_sweep(config, point).replace(ctx=ctx) for point in points]
    if opts.depth_fill == "random" and any(c.spec.types for c in configs):
        raise TurboSpecError("--depth-fill random measures plain decoding: a drafter's own state (the MTP layer's "
                             "KV, n-gram tables) cannot be filled with random values; drop --spec-type")
    cases = list(prompts.items()) if prompts else [("random", None)]
    model_path = None
    if opts.interleave:
        engines = _engines(configs, opts.quiet)
        model_path = engines[0].model_path
        for depth in depths:
            for cat, text in cases:
                per_engine = [_Case(e, opts, depth, text) for e in engines]
                runs: list[list[dict[str, Any]]] = [[] for _ in engines]
                for rep in range(opts.warmup + opts.repetitions):
                    order = range(len(engines)) if rep % 2 == 0 else reversed(range(len(engines)))
                    for i in order:
                        run = per_engine[i].run(rep)
                        if rep >= opts.warmup:
                            runs[i].append(run)
                first = len(rows)
                for point, case, point_runs in zip(points, per_engine, runs):
                    rows.append(_row(point, depth, cat, case.ptoks, point_runs, opts))
                    bar.update(1)
                _add_ratios(rows[first:], runs)
        del engines
    else:
        for point, cfg in zip(points, configs):
            with loading(opts.quiet) as load_bar:
                engine = build_engine(cfg, load_bar)
            model_path = engine.model_path
            for depth in depths:
                for cat, text in cases:
                    case = _Case(engine, opts, depth, text)
                    runs_ = [case.run(rep) for rep in range(opts.warmup + opts.repetitions)][opts.warmup:]
                    rows.append(_row(point, depth, cat, case.ptoks, runs_, opts))
                    bar.update(1)
                    bar.set_postfix(config=rows[-1]["config"], depth=depth, tg=f"{rows[-1]['decode_tps']:.1f}")
            del engine
    bar.close()
    _add_depth_loss(rows)
    if settings is None:
        settings = {"engine": config.to_dict(), **asdict(opts)}
    return {"env": env_info(model_path), "settings": settings, "rows": rows}


def _engines(configs: list[EngineConfig], quiet: bool) -> list[Any]:
    """One engine per config, the weights loaded once per dtype (--interleave)."""
    if len({c.threads for c in configs}) > 1:
        raise TurboSpecError("--interleave runs every point in one process with one thread count: sweep threads "
                             "without it")
    parts: dict[str, tuple] = {}
    engines = []
    for cfg in configs:
        if cfg.dtype not in parts:
            with loading(quiet) as load_bar:
                parts[cfg.dtype] = load_parts(cfg, load_bar)
        engines.append(assemble_engine(cfg, *parts[cfg.dtype]))
    return engines


class _Case:
    """One engine at one depth with one prompt (a category's text, or random tokens per repetition): the context
    filled once, untimed; `run(rep)` streams one repetition and returns its measurements."""

    def __init__(self, engine, opts: BenchOptions, depth: int, text: str | None):
        self.engine, self.opts, self.depth = engine, opts, depth
        self.vocab = engine.model.cfg.vocab_size
        rng = random.Random(1234 + depth)
        self.filler = [rng.randrange(3, self.vocab) for _ in range(depth)]
        self.base = engine.encode_prompt(text) if text is not None else None
        self.ptoks: list[int] = self.base or []
        self.params = SamplingParams(temperature=opts.temp, top_k=0, top_p=1.0, min_p=0.0, seed=opts.seed,
                                     max_tokens=opts.n_gen, ignore_eos=True)
        if depth and opts.depth_fill == "random":  # random KV values, kept as a checkpoint: resumed every time
            engine.cache.reset()
            fill_random(engine.cache, depth, seed=depth)
            engine.cached_tokens = list(self.filler)
        elif depth:  # every repetition resumes at the depth (a hybrid model from its checkpoint there: the prefill
            # of filler + one token keeps one before that token)
            engine.prefill(self.filler + (self.base or [3])[:1], rows=1)
            engine.cached_tokens = engine.cached_tokens[:depth]

    def run(self, rep: int) -> dict[str, Any]:
        engine = self.engine
        if self.base is None:
            r2 = random.Random(rep)
            self.ptoks = [r2.randrange(3, self.vocab) for _ in range(self.opts.n_prompt)]
        else:  # the same prompt each repetition: do not let prefix reuse skip it
            engine.cached_tokens = engine.cached_tokens[:self.depth]
        toks = self.filler + self.ptoks
        for _ in engine.stream(toks, self.params):
            pass
        st = engine.last_stats
        computed = len(toks) - engine.reused_tokens
        spec = st.spec
        return {
            "prefill_tps": computed / st.prefill_s if st.prefill_s else 0.0,
            "decode_tps": st.decode_tps, "ttft_ms": st.ttft_s * 1e3, "gen": st.gen_tokens,
            "peak_rss_mib": st.peak_rss_bytes / 2**20,
            "acc_rate": spec.acceptance_rate if spec else None,
            "mean_acc_len": spec.mean_acceptance_length if spec else None,
            "per_pos": spec.per_position if spec else None,
            "experts": st.experts.to_dict() if st.experts is not None else None,
        }


def _row(point: dict[str, str], depth: int, cat: str, ptoks: list[int], runs: list[dict[str, Any]],
         opts: BenchOptions) -> dict[str, Any]:
    """One report row: medians (with min/max, mean and sd) of the repetitions' measurements."""
    row: dict[str, Any] = {"config": point_name(point), **point, "depth": depth, "category": cat,
                           "n_prompt": len(ptoks), "n_gen": opts.n_gen}
    for key in ("prefill_tps", "decode_tps", "ttft_ms"):
        s = summarize([r[key] for r in runs])
        row[key] = s["median"]
        row[f"{key}_min"], row[f"{key}_max"] = s["min"], s["max"]
        row[f"{key}_mean"], row[f"{key}_sd"] = s["mean"], s["sd"]
    row["peak_rss_mib"] = max(r["peak_rss_mib"] for r in runs)
    if runs[0]["experts"] is not None:  # a MoE model: the expert cache over the decode phases
        ex = [r["experts"] for r in runs]
        row["expert_hit_rate"] = summarize([x["hit_rate"] for x in ex])["median"]
        row["expert_loaded_mib_per_tok"] = summarize([x["loaded_mib_per_tok"] for x in ex])["median"]
        row["disk_mib_per_tok"] = summarize([x["disk_mib_per_tok"] for x in ex])["median"]
    if runs[0]["acc_rate"] is not None:
        row["acc_rate"] = summarize([r["acc_rate"] for r in runs])["median"]
        row["mean_acc_len"] = summarize([r["mean_acc_len"] for r in runs])["median"]
        row["per_pos"] = runs[-1]["per_pos"]
    return row


def _add_ratios(rows: list[dict[str, Any]], runs: list[list[dict[str, Any]]]) -> None:
    """Each point's per-repetition ratio to the first point's same repetition, median and range (--interleave)."""
    for row, point_runs in zip(rows, runs):
        for key in ("decode_tps", "prefill_tps"):
            ratios = [r[key] / b[key] for r, b in zip(point_runs, runs[0]) if b[key]]
            if ratios:
                name = key.replace("_tps", "_ratio")
                row[name] = summarize(ratios)["median"]
                row[f"{name}_min"], row[f"{name}_max"] = min(ratios), max(ratios)


def point_name(point: dict[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in point.items()) or "default"


def _add_depth_loss(rows: list[dict[str, Any]]) -> None:
    base = {(r["config"], r["category"]): r["decode_tps"] for r in rows if r["depth"] == 0}
    for r in rows:
        b = base.get((r["config"], r["category"]))
        if b:
            r["decode_loss_vs_d0_pct"] = 100.0 * (1 - r["decode_tps"] / b)


def write_reports(report: dict[str, Any], out: Path, plot_formats: Iterable[str] = ("png",)) -> list[Path]:
    """report.json, report.csv, report.md and the plots (`turbospec.lab.plots`: t/s vs depth, acceptance, ...) in
    each of `plot_formats` (png, svg) of a local or server report into directory `out`; the files written."""
    out.mkdir(parents=True, exist_ok=True)
    rows = report["rows"]
    write_json(out / "report.json", report)
    flat = [{k: (json.dumps(v) if isinstance(v, list) else v) for k, v in r.items()} for r in rows]
    write_csv(out / "report.csv", flat)
    cols = [c for c in ("engine", "config", "depth", "category", "n_prompt", "n_gen", "prefill_tps", "prefill_ratio",
                        "decode_tps", "decode_tps_sd", "decode_ratio", "ttft_ms", "tpot_ms", "itl_p99_ms", "e2e_ms",
                        "acc_rate", "mean_acc_len", "decode_loss_vs_d0_pct", "peak_rss_mib", "expert_hit_rate",
                        "expert_loaded_mib_per_tok", "disk_mib_per_tok")
            if any(c in r for r in rows)]
    md = markdown_header("turbospec bench", report)
    md += ["## Results (median of repetitions)", "", markdown_table(rows, cols), ""]
    (out / "report.md").write_text("\n".join(md))
    files = [out / "report.json", out / "report.csv", out / "report.md"]
    return files + plots.write_figures(report, out, plot_formats)


def print_table(report: dict[str, Any]) -> None:
    """The report's rows as a console table (plain dicts when rich is missing)."""
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        for r in report["rows"]:
            print(r)
        return
    rows = report["rows"]
    t = Table(title="turbospec bench (median of repetitions)")
    cols = [c for c in ("engine", "config", "depth", "category", "prefill_tps", "prefill_ratio", "decode_tps",
                        "decode_ratio", "ttft_ms", "tpot_ms", "itl_p99_ms", "acc_rate", "mean_acc_len",
                        "decode_loss_vs_d0_pct", "expert_hit_rate", "disk_mib_per_tok")
            if any(c in r for r in rows)]
    for c in cols:
        t.add_column(c)
    for r in rows:
        t.add_row(*[f"{r[c]:.2f}" if isinstance(r.get(c), float) else str(r.get(c, "")) for c in cols])
    Console(stderr=False).print(t)
