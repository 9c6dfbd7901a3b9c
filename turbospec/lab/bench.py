"""`turbospec bench`: speed with the reproducibility checklist built in.

Defaults follow the seeds' checklist: 512-token prompt, 512 generated, temperature 0, 1 warm-up run discarded,
5 repetitions, median with min/max and mean +- sd. Sweeps (`--sweep key=v1,v2`) form a cartesian product;
`--depth 0,8192` fills the context first (llama-bench -d) and reports the speed loss vs depth 0; `--categories`
uses the shipped prompt set instead of random tokens. `--url` measures an OpenAI-compatible server instead.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

from turbospec.errors import TurboSpecError
from turbospec.lab.report import (
    bar_plot,
    env_info,
    line_plot,
    markdown_table,
    summarize,
    write_csv,
    write_json,
)

SWEEP_KEYS = {
    "ctk": "cache_type_k", "ctv": "cache_type_v", "spec-type": "spec_type", "n-max": "spec_draft_n_max",
    "ub": "ubatch_size", "dtype": "dtype", "threads": "threads", "ctkd": "cache_type_k_draft",
    "draft-vocab": "spec_draft_vocab", "p-min": "spec_draft_p_min", "mtp-window": "spec_mtp_prompt_window",
    "mtp-topk": "spec_mtp_topk",
}
PROMPTS_FILE = Path(__file__).resolve().parent.parent / "data" / "prompts.json"


def load_prompts(categories: str | None) -> dict[str, str]:
    data = json.loads(PROMPTS_FILE.read_text())["prompts"]
    if not categories or categories == "all":
        return data
    out = {}
    for c in categories.split(","):
        if c not in data:
            raise TurboSpecError(f"unknown prompt category {c!r} (have: {', '.join(data)})")
        out[c] = data[c]
    return out


def parse_sweeps(items: list[str]) -> list[dict[str, str]]:
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


def apply_config(a: argparse.Namespace, cfg: dict[str, str]) -> argparse.Namespace:
    b = copy.copy(a)
    for k, v in cfg.items():
        dest = SWEEP_KEYS[k]
        cur = getattr(a, dest, None)
        if v == "none":
            setattr(b, dest, None)
        elif dest == "spec_type":
            setattr(b, dest, v.replace("+", ","))  # chains inside a sweep: ngram-mod+draft-mtp
        elif isinstance(cur, int) or dest in ("spec_draft_n_max", "ubatch_size", "threads"):
            setattr(b, dest, int(v))
        elif isinstance(cur, float):
            setattr(b, dest, float(v))
        else:
            setattr(b, dest, v)
    return b


def run_local(a: argparse.Namespace) -> dict[str, Any]:
    from turbospec.cli import load_engine
    from turbospec.sampling import SamplingParams

    configs = parse_sweeps(a.sweep)
    depths = [int(d) for d in str(a.depth).split(",")]
    prompts = load_prompts(a.categories) if a.categories else None
    rows: list[dict[str, Any]] = []
    total = len(configs) * len(depths) * (len(prompts) if prompts else 1)
    from tqdm import tqdm

    bar = tqdm(total=total, desc="bench", file=sys.stderr, disable=a.quiet)
    model_path = None
    for cfg in configs:
        ca = apply_config(a, cfg)
        ca.ctx_size = max(a.ctx_size, max(depths) + a.n_prompt + a.n_gen + 16, 4096 if prompts else 0)
        engine, model_path = load_engine(ca)
        vocab = engine.model.cfg.vocab_size
        params = SamplingParams(temperature=a.temp, top_k=0, top_p=1.0, min_p=0.0, seed=a.seed,
                                max_tokens=a.n_gen, ignore_eos=True)
        for depth in depths:
            rng = random.Random(1234 + depth)
            filler = [rng.randrange(3, vocab) for _ in range(depth)]
            cases = prompts.items() if prompts else [("random", None)]
            for cat, text in cases:
                base = engine.encode_prompt(text) if text is not None else None
                runs = []
                for rep in range(a.warmup + a.repetitions):
                    if base is None:
                        r2 = random.Random(rep)
                        ptoks = [r2.randrange(3, vocab) for _ in range(a.n_prompt)]
                    else:
                        ptoks = base
                    toks = filler + ptoks
                    if text is not None and rep > 0:  # same prompt each rep: do not let prefix reuse skip it
                        engine.cached_tokens = engine.cached_tokens[:depth]
                    for _ in engine.stream(toks, params):
                        pass
                    st = engine.last_stats
                    if rep < a.warmup:
                        continue
                    computed = len(toks) - engine.reused_tokens
                    spec = st.extra.get("spec")
                    runs.append({
                        "prefill_tps": computed / st.prefill_s if st.prefill_s else 0.0,
                        "decode_tps": st.decode_tps, "ttft_ms": st.ttft_s * 1e3, "gen": st.gen_tokens,
                        "peak_rss_mib": st.peak_rss_bytes / 2**20,
                        "acc_rate": spec.acceptance_rate if spec else None,
                        "mean_acc_len": spec.mean_acceptance_length if spec else None,
                        "per_pos": spec.per_position if spec else None,
                    })
                row: dict[str, Any] = {"config": _cfg_name(cfg), **cfg, "depth": depth, "category": cat,
                                       "n_prompt": len(ptoks), "n_gen": a.n_gen}
                for key in ("prefill_tps", "decode_tps", "ttft_ms"):
                    s = summarize([r[key] for r in runs])
                    row[key] = s["median"]
                    row[f"{key}_min"], row[f"{key}_max"] = s["min"], s["max"]
                    row[f"{key}_mean"], row[f"{key}_sd"] = s["mean"], s["sd"]
                row["peak_rss_mib"] = max(r["peak_rss_mib"] for r in runs)
                if runs[0]["acc_rate"] is not None:
                    row["acc_rate"] = summarize([r["acc_rate"] for r in runs])["median"]
                    row["mean_acc_len"] = summarize([r["mean_acc_len"] for r in runs])["median"]
                    row["per_pos"] = runs[-1]["per_pos"]
                rows.append(row)
                bar.update(1)
                bar.set_postfix(config=row["config"], depth=depth, tg=f"{row['decode_tps']:.1f}")
        del engine
    bar.close()
    _add_depth_loss(rows)
    settings = {k: v for k, v in vars(a).items() if k != "func"}
    return {"env": env_info(model_path), "settings": settings, "rows": rows}


def _cfg_name(cfg: dict[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in cfg.items()) or "default"


def _add_depth_loss(rows: list[dict[str, Any]]) -> None:
    base = {(r["config"], r["category"]): r["decode_tps"] for r in rows if r["depth"] == 0}
    for r in rows:
        b = base.get((r["config"], r["category"]))
        if b:
            r["decode_loss_vs_d0_pct"] = 100.0 * (1 - r["decode_tps"] / b)


def write_reports(report: dict[str, Any], out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    rows = report["rows"]
    write_json(out / "report.json", report)
    flat = [{k: (json.dumps(v) if isinstance(v, list) else v) for k, v in r.items()} for r in rows]
    write_csv(out / "report.csv", flat)
    cols = [c for c in ("engine", "config", "depth", "category", "n_prompt", "n_gen", "prefill_tps", "decode_tps",
                        "decode_tps_sd", "ttft_ms", "tpot_ms", "itl_p99_ms", "e2e_ms", "acc_rate", "mean_acc_len",
                        "decode_loss_vs_d0_pct", "peak_rss_mib") if any(c in r for r in rows)]
    env = report["env"]
    md = ["# turbospec bench", "", "## Environment", ""]
    md += [f"- {k}: {v}" for k, v in env.items()]
    md += ["", "## Settings", "", "```", json.dumps(report["settings"], indent=1, default=str), "```", "",
           "## Results (median of repetitions)", "", markdown_table(rows, cols), ""]
    (out / "report.md").write_text("\n".join(md))
    files = [out / "report.json", out / "report.csv", out / "report.md"]
    depths = sorted({r.get("depth", 0) for r in rows})
    if len(depths) > 1:
        series: dict[str, tuple[list[float], list[float]]] = {}
        for r in rows:
            s = series.setdefault(f"{r['config']} [{r['category']}]", ([], []))
            s[0].append(r["depth"])
            s[1].append(r["decode_tps"])
        files.append(line_plot(out / "tps_vs_depth.png", series, "context depth (tokens)", "decode t/s",
                               "decode speed vs depth"))
    acc = [r for r in rows if r.get("acc_rate") is not None]
    if acc:
        files.append(bar_plot(out / "acceptance.png", [f"{r['config']} {r['category']}" for r in acc],
                              [r["acc_rate"] for r in acc], "acceptance rate", "draft acceptance"))
    return files


def print_table(report: dict[str, Any]) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        for r in report["rows"]:
            print(r)
        return
    rows = report["rows"]
    t = Table(title="turbospec bench (median of repetitions)")
    cols = [c for c in ("engine", "config", "depth", "category", "prefill_tps", "decode_tps", "ttft_ms",
                        "tpot_ms", "itl_p99_ms", "acc_rate", "mean_acc_len", "decode_loss_vs_d0_pct")
            if any(c in r for r in rows)]
    for c in cols:
        t.add_column(c)
    for r in rows:
        t.add_row(*[f"{r[c]:.2f}" if isinstance(r.get(c), float) else str(r.get(c, "")) for c in cols])
    Console(stderr=False).print(t)


def add_cli(sub) -> argparse.ArgumentParser:
    from turbospec.cli import add_model_args, add_spec_args

    p = sub.add_parser("bench", help="measure prefill/decode speed and acceptance, reproducibly")
    add_model_args(p)
    add_spec_args(p)
    p.add_argument("-p", "--n-prompt", type=int, default=512, help="prompt tokens (default 512)")
    p.add_argument("-n", "--n-gen", type=int, default=512, help="generated tokens (default 512)")
    p.add_argument("-r", "--repetitions", type=int, default=5, help="measured repetitions (default 5)")
    p.add_argument("--warmup", type=int, default=1, help="discarded warm-up runs (default 1)")
    p.add_argument("-d", "--depth", default="0", help="context depths, comma list (default 0)")
    p.add_argument("--sweep", action="append", default=[],
                   help=f"key=v1,v2 (keys: {', '.join(SWEEP_KEYS)}); several form a cartesian product; "
                        "write spec-type chains with + (ngram-mod+draft-mtp)")
    p.add_argument("--categories", default=None, help="use the shipped prompt set: all or a comma list")
    p.add_argument("--temp", type=float, default=0.0, help="temperature (default 0 = greedy)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--url", action="append", default=None,
                   help="benchmark an OpenAI-compatible server instead (repeatable: side by side)")
    p.add_argument("--api-key", default=None, help="for --url")
    p.add_argument("--out", default=None, help="report directory (default bench-<timestamp>)")
    p.add_argument("-q", "--quiet", action="store_true")
    p.set_defaults(func=run_cli)
    return p


def run_cli(a: argparse.Namespace) -> int:
    for n in ("n_prompt", "n_gen", "repetitions"):
        if getattr(a, n) <= 0:
            raise TurboSpecError(f"--{n.replace('_', '-')} must be positive")
    if a.warmup < 0:
        raise TurboSpecError("--warmup must be >= 0")
    if a.url:
        from turbospec.lab.client import run_remote

        report = run_remote(a)
    else:
        report = run_local(a)
    out = Path(a.out or time.strftime("bench-%Y%m%d-%H%M%S"))
    files = write_reports(report, out)
    print_table(report)
    print("wrote " + ", ".join(str(f) for f in files), file=sys.stderr)
    return 0
