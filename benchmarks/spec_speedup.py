"""Speculative-decoding speed-up over plain decoding, measured *paired*: every repetition runs plain decoding and
each drafter configuration back to back on the same prompt, and the speed-up is the median of the per-repetition
ratios. On a machine whose speed drifts by 30% within minutes (this one), ratios of medians taken minutes apart
swing by that much; paired ratios do not.

    python benchmarks/spec_speedup.py --categories code explain --configs "draft-mtp:n=3" "draft-mtp:n=1" \
        --reps 7 --gen 128 --threads 2 --out docs/results/spec_speedup.json

A config is `spec-type[:key=value,...]` (chains as comma lists: `suffix,draft-mtp:n=3`) with keys n (n_max),
vocab (draft vocab), pmin, topk (MTP tree width), window, adaptive (1: adaptive speculation -- draft length and, with
topk > 1, tree width; default 0, always draft n tokens), and the
suffix drafter's sn (most draft tokens), sf (tokens per matched token), sp (branch share), shared (1: a store of
earlier requests), nm (ngram-mod's most draft tokens), merge (1: a chain's drafts verified together as one tree), sample (0: argmax MTP drafts at
--temp > 0). Prompts: the shipped bench set
(`turbospec/data/prompts.json`, the categories of `turbospec bench`), plus with `--random N` a prompt of N random
token ids (where drafts rarely hit); `--depths` puts that many tokens of the shipped prose text before every prompt
(decode at depth; the prefill is not in the decode speed), or with `--filler random` random token ids (as
`turbospec bench -d`: a context the drafter cannot learn from). `--edit N` adds N edit prompts: a held-out source file
(`turbospec/data/eval/code.jsonl`, about --edit-tokens tokens) and the start of its rewrite with one identifier
renamed, which the model goes on rewriting. `--repeat` sends every prompt twice to one engine and times the second
request (an agent that re-sends a request; with `shared=1` the suffix drafter drafts from the first answer).
`--keep` runs every configuration on one engine per depth, so a request prefills only what follows the longest
prefix already in that engine's cache (the depth's filler is prefilled once per configuration instead of once per
run: what makes 32K-64K depths affordable), and adaptive speculation keeps the step costs it measured on that
engine (as a server does) instead of starting every run from the start-up calibration; decode is timed as without it.
With `--plain-on-engine` each configuration's paired plain runs are on its own engine with the drafter detached (the
same cache memory: two identical plain engines at 32K differed by a median 2.4% over 7 pairs, up to 10% in one).

    python benchmarks/spec_speedup.py --categories code --edit 4 --gen 256 --reps 3 \
        --configs ngram-mod "suffix" "draft-mtp:n=3" "suffix,draft-mtp:n=3" --out docs/results/spec_suffix.json

    python benchmarks/spec_speedup.py --categories code explain --random 200 --depths 0 8192 32768 65536 \
        --configs "draft-mtp:n=3,adaptive=1" "draft-mtp:n=3" --reps 3 --keep --out docs/results/spec_adaptive.json

The configuration `none` is plain decoding run and paired as a configuration: the A/A control, whose ratios show
how far this machine's noise alone moves a cell (with `--plain-on-engine`, plain against plain on one engine).

`--lockstep` (with `--keep`) runs each repetition's request on plain decoding's engine and every configuration's at
once, their decoding interleaved token by token (`run_lockstep`): the machine's drift then touches them alike, and
plain against plain (`none`) lands within about 1% per cell where runs one after the other land within 3-4%.

    python benchmarks/spec_speedup.py --categories code explain --random 200 --depths 0 8192 32768 65536 \
        --configs none "draft-mtp:n=3,adaptive=1" --reps 11 --keep --lockstep --out docs/results/spec_adaptive_lockstep_prose.json
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from pathlib import Path

import torch

from turbospec.config import EngineConfig, SpecConfig
from turbospec.engine import Engine
from turbospec.engine.build import load_parts
from turbospec.lab.workload import load_prompts
from turbospec.sampling import SamplingParams
from turbospec.speculative import make_drafter
from turbospec.speculative.adaptive import calibrate
from turbospec.tokenizer import Tokenizer

KEYS = {"n": ("n_max", int), "vocab": ("draft_vocab", int), "pmin": ("p_min", float), "topk": ("mtp_topk", int),
        "window": ("mtp_prompt_window", int), "adaptive": ("adaptive", lambda v: v not in ("0", "false", "off")),
        "nm": ("ngram_mod_n_max", int), "sn": ("suffix_n_max", int), "sf": ("suffix_factor", float), "sp": ("suffix_p_min", float),
        "shared": ("suffix_shared", lambda v: v not in ("0", "false", "off")),
        "merge": ("merge", lambda v: v not in ("0", "false", "off")),
        "sample": ("draft_sample", lambda v: v not in ("0", "false", "off"))}


def parse_config(text: str) -> SpecConfig:
    kind, _, rest = text.partition(":")
    kw = {}
    for part in filter(None, rest.split(",")):
        k, _, v = part.partition("=")
        name, cast = KEYS[k]
        kw[name] = cast(v)
    return SpecConfig.parse(kind, **kw)


COSTS: dict = {}  # adaptive speculation's start-up cost model, measured once per configuration (as `build_engine` does)


def edit_prompts(tok: Tokenizer, n: int, tokens: int) -> dict[str, list[int]]:
    """n 'rewrite this file with one identifier renamed' prompts from the held-out code: the file, then its
    rewrite's first two lines (the model is a base model: the rewrite is begun for it)."""
    root = Path(__file__).resolve().parents[1]
    rows = [json.loads(x) for x in (root / "turbospec/data/eval/code.jsonl").read_text().splitlines() if x.strip()]
    out: dict[str, list[int]] = {}
    for row in rows:
        if len(out) == n:
            break
        text = row["text"]
        start = text.find("\ndef ")
        if start < 0:
            continue
        body = text[start + 1:]
        ids = tok.encode(body, add_special=False)[:tokens]
        body = tok.decode(ids)
        body = body[:body.rfind("\n") + 1]
        names = [w for w in ("self", "name", "value", "data", "result", "args") if w in body]
        if not names:
            continue
        old = names[0]
        new = {"self": "this", "name": "label", "value": "val", "data": "payload", "result": "res",
               "args": "params"}[old]
        edited = body.replace(old, new)
        head = "".join(edited.splitlines(keepends=True)[:2])
        prompt = (f"# {row['path']}\n{body}\n\n# {row['path']}, with `{old}` renamed to `{new}`:\n{head}")
        out[f"edit:{row['path']}"] = tok.encode(prompt)
    return out


def new_engine(model, tok, path: str, cfg: SpecConfig | None, ctx: int) -> Engine:
    drafter = make_drafter(cfg, model, ctx + 8 + (cfg.depth if cfg else 0), path) if cfg is not None else None
    return Engine(model, tok, EngineConfig(ctx=ctx, spec=cfg or SpecConfig()), drafter=drafter)


def prepare(model, eng: Engine, cfg: SpecConfig | None, keep: bool) -> None:
    """Adaptive speculation's cost model for a run on `eng`: the start-up calibration (measured once per
    configuration, as `build_engine` does), kept on a kept engine (--keep) once it has its own."""
    if cfg is not None and cfg.adaptive and (eng.step_costs is None or not keep):
        if cfg not in COSTS:
            COSTS[cfg] = calibrate(model, cfg.n_max, cfg)
        # each run starts from the start-up costs; on a kept engine (--keep) the costs it measured stay, as in a server
        eng.step_costs = copy.deepcopy(COSTS[cfg])


def run_once(model, tok, path: str, prompt: list[int], cfg: SpecConfig | None, gen: int,
             repeat: bool = False, temp: float = 0.0, seed: int = 0, eng: Engine | None = None) -> dict:
    """One timed request, on `eng` (kept between runs) or on a new engine."""
    keep = eng is not None
    if eng is None:
        eng = new_engine(model, tok, path, cfg, len(prompt) + gen + 64)
    prepare(model, eng, cfg, keep)
    sp = SamplingParams(max_tokens=gen, temperature=temp, ignore_eos=True, seed=seed)
    if repeat:  # the first request, untimed
        list(eng.stream(prompt, sp))
    t = time.perf_counter()
    list(eng.stream(prompt, sp))
    st = eng.last_stats
    return result(st, {"decode_tps": st.decode_tps, "wall_s": time.perf_counter() - t, "ttft_ms": st.ttft_s * 1e3},
                  cfg)


def run_lockstep(model, prompt: list[int], runs: list[tuple[Engine, SpecConfig | None]], gen: int,
                 temp: float = 0.0, seed: int = 0, flip: bool = False) -> list[dict]:
    """The same request on each (kept) engine at once, their decoding interleaved token by token: each engine's
    next token is asked for in turn (the order reversed every round, and from the start with `flip`), and an
    engine's decode speed is its tokens after the first over the time spent in its own calls. Every engine decodes
    through the same seconds of the machine, so a drift of its speed (this machine's noise: seconds to minutes)
    touches them alike; run one after the other, it lands on one of them."""
    sp = SamplingParams(max_tokens=gen, temperature=temp, ignore_eos=True, seed=seed)
    for eng, cfg in runs:
        prepare(model, eng, cfg, True)
    streams = [eng.stream(prompt, sp) for eng, _ in runs]
    spent = [0.0] * len(runs)
    tokens = [0] * len(runs)
    ttft = [0.0] * len(runs)
    for i, g in enumerate(streams):  # the prompts (what the cache lacks) and first tokens: not decode time
        t = time.perf_counter()
        tokens[i] = len(next(g).tokens)
        ttft[i] = time.perf_counter() - t
    live = list(range(len(runs)))
    rnd = 0
    while live:
        order = live if (rnd % 2 == 0) != flip else live[::-1]
        rnd += 1
        for i in list(order):
            t = time.perf_counter()
            try:
                tokens[i] += len(next(streams[i]).tokens)
            except StopIteration:  # (the request's wrap-up after its last token: not decode time, as in GenStats)
                live.remove(i)
                continue
            spent[i] += time.perf_counter() - t
    out = []
    for i, (eng, cfg) in enumerate(runs):
        st = eng.last_stats
        out.append(result(st, {"decode_tps": (tokens[i] - 1) / spent[i] if spent[i] > 0 else 0.0,
                               "wall_s": ttft[i] + spent[i], "ttft_ms": ttft[i] * 1e3}, cfg))
    return out


def result(st, out: dict, cfg: SpecConfig | None) -> dict:
    """A run's numbers with its drafting statistics (`st`: the engine's last_stats)."""
    spec = st.spec
    if spec is not None:
        out["drafts"], out["accepted"] = spec.drafts, spec.accepted
        out["mean_acc_len"] = 1 + spec.accepted / max(spec.drafts, 1)
        out["skipped"] = spec.skipped
        out["trees"] = spec.trees
    elif cfg is not None:  # the configuration `none`: plain decoding timed as a configuration (the A/A control)
        out.update(drafts=0, accepted=0, mean_acc_len=1.0, skipped=0, trees=0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", default=None)
    ap.add_argument("--categories", nargs="*", default=["code", "explain"])
    ap.add_argument("--configs", nargs="+", default=["draft-mtp:n=3"])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--out", default=None)
    ap.add_argument("--random", type=int, default=0, help="add a prompt of N random token ids")
    ap.add_argument("--depths", type=int, nargs="+", default=[0], help="context tokens before every prompt")
    ap.add_argument("--edit", type=int, default=0, help="add N file-edit prompts")
    ap.add_argument("--edit-tokens", type=int, default=400, help="tokens of each edited file")
    ap.add_argument("--repeat", action="store_true", help="time the second of two identical requests")
    ap.add_argument("--temp", type=float, default=0.0, help="sampling temperature (default 0: greedy)")
    ap.add_argument("--filler", choices=["prose", "random"], default="prose",
                    help="what fills --depths: the shipped prose text, or random token ids (as `turbospec bench -d`)")
    ap.add_argument("--plain-on-engine", action="store_true",
                    help="with --keep: pair each configuration with plain decoding on its own engine (drafter "
                         "detached: the same cache and memory), not on a plain engine of its own")
    ap.add_argument("--lockstep", action="store_true",
                    help="with --keep: plain decoding and every configuration decode each repetition's request at "
                         "once, token by token in turn, each on its own engine (see run_lockstep)")
    ap.add_argument("--keep", action="store_true",
                    help="one engine per configuration and depth: requests reuse the cached prefix (the filler)")
    ap.add_argument("--dump-prompts", default=None, metavar="DIR",
                    help="write each prompt's text to DIR/<name>.txt (for `turbospec run -f`) and exit")
    a = ap.parse_args()
    if (a.plain_on_engine or a.lockstep) and not a.keep:
        ap.error("--plain-on-engine and --lockstep need --keep")
    if a.plain_on_engine and a.lockstep:
        ap.error("--lockstep runs plain decoding on an engine of its own: not with --plain-on-engine")
    if a.lockstep and a.repeat:
        ap.error("--lockstep times one request per engine: not with --repeat")
    # a checkpoint directory or a GGUF file, with its tokenizer (the loader `turbospec run` uses)
    path, model, tokenizer = load_parts(EngineConfig(model=a.model, dtype=a.dtype, threads=a.threads))
    if tokenizer is None:
        raise SystemExit(f"{a.model}: no tokenizer (the prompts are text)")
    tok = tokenizer
    base = {c: tok.encode(p) for c, p in load_prompts(",".join(a.categories)).items()} if a.categories else {}
    base.update(edit_prompts(tok, a.edit, a.edit_tokens))
    if a.random:
        g = torch.Generator().manual_seed(0)
        base["random"] = torch.randint(3, model.cfg.vocab_size, (a.random,), generator=g).tolist()
    if a.dump_prompts:
        out_dir = Path(a.dump_prompts)
        out_dir.mkdir(parents=True, exist_ok=True)
        for name, ids in base.items():
            (out_dir / (name.replace(":", "_").replace("/", "_") + ".txt")).write_text(tok.decode(ids))
        return
    if a.filler == "random":  # as `turbospec bench -d` (and llama-bench -d): nothing for a drafter to learn from
        g = torch.Generator().manual_seed(1)
        filler = torch.randint(3, model.cfg.vocab_size, (max(a.depths),), generator=g).tolist()
    else:
        lines = (Path(__file__).resolve().parents[1] / "turbospec/data/eval/prose.jsonl").read_text().splitlines()
        filler = tok.encode(" ".join(json.loads(x)["text"] for x in lines[:400] if x.strip()))
        while len(filler) < max(a.depths):
            filler = filler + filler
    prompts = {f"{c}@{d}" if len(a.depths) > 1 or d else c: filler[:d] + p for d in a.depths for c, p in base.items()}
    configs = {c: parse_config(c) for c in a.configs}
    engines: dict[tuple[int, str], Engine] = {}  # --keep: (depth, config) -> its engine

    def engine(d: int, name: str) -> Engine | None:
        if not a.keep:
            return None
        if any(k[0] != d for k in engines):
            engines.clear()  # one depth's engines at a time: their caches hold the whole context
        if (d, name) not in engines:
            ctx = max(len(p) for p in base.values()) + d + a.gen + 64
            engines[(d, name)] = new_engine(model, tok, path, configs.get(name), ctx)
        return engines[(d, name)]

    results = {}
    for cat, prompt in prompts.items():
        d = int(cat.rpartition("@")[2]) if "@" in cat else a.depths[0]
        run_once(model, tok, path, prompt[-64:], None, 16)  # warm-up
        rows = {name: [] for name in ["plain", *configs]}
        for rep in range(a.reps):
            if a.lockstep:  # plain and every configuration at once, interleaved token by token
                names = ["plain", *configs]
                got = run_lockstep(model, prompt, [(engine(d, n), configs.get(n)) for n in names], a.gen, a.temp,
                                   rep, flip=rep % 2 == 1)
                for n, r in zip(names, got):
                    rows[n].append(r)
                continue
            if a.plain_on_engine:  # each configuration paired with plain decoding on its own engine and cache
                for name, cfg in configs.items():
                    eng = engine(d, name)
                    assert eng is not None
                    for run in ("plain", name) if rep % 2 == 0 else (name, "plain"):
                        if run == "plain":
                            drafter, eng.drafter = eng.drafter, None  # the same engine, cache and memory, no drafts
                            try:
                                rows.setdefault(f"plain|{name}", []).append(
                                    run_once(model, tok, path, prompt, None, a.gen, a.repeat, a.temp, rep, eng))
                            finally:
                                eng.drafter = drafter
                        else:
                            rows[name].append(run_once(model, tok, path, prompt, cfg, a.gen, a.repeat, a.temp, rep,
                                                       eng))
                continue
            order = [("plain", None), *configs.items()]
            for name, cfg in order if rep % 2 == 0 else order[::-1]:  # (alternated: no config always runs first)
                rows[name].append(run_once(model, tok, path, prompt, cfg, a.gen, a.repeat, a.temp, rep,
                                           engine(d, name)))
        if a.plain_on_engine:
            rows["plain"] = rows[f"plain|{next(iter(configs))}"]
        plain = [r["decode_tps"] for r in rows["plain"]]
        res = {"plain_tps_median": statistics.median(plain), "configs": {}}
        for name in configs:
            tps = [r["decode_tps"] for r in rows[name]]
            own = [r["decode_tps"] for r in rows.get(f"plain|{name}", rows["plain"])]
            ratios = [x / p for x, p in zip(tps, own)]
            res["configs"][name] = {
                "plain_tps_median": statistics.median(own),
                "tps_median": statistics.median(tps), "speedup_median": statistics.median(ratios),
                "speedup_min": min(ratios), "speedup_max": max(ratios),
                "mean_acc_len": statistics.median(r["mean_acc_len"] for r in rows[name]),
                "undrafted_steps": statistics.median(r["skipped"] for r in rows[name]),
                "tree_steps": statistics.median(r.get("trees", 0) for r in rows[name]),
                "ratios": ratios,
                # time to the first token (prefill of what the cache lacks, and the drafter's start on the prompt)
                "ttft_ms_median": statistics.median(r["ttft_ms"] for r in rows[name]),
                "plain_ttft_ms_median": statistics.median(
                    r["ttft_ms"] for r in rows.get(f"plain|{name}", rows["plain"]))}
            c = res["configs"][name]
            print(f"{cat:16s} {name:28s} {c['tps_median']:7.1f} t/s vs plain {c['plain_tps_median']:7.1f}: "
                  f"{c['speedup_median']:.2f}x (paired, min {c['speedup_min']:.2f} max {c['speedup_max']:.2f}), "
                  f"mean acceptance length {c['mean_acc_len']:.2f}, {c['tree_steps']:g} tree steps, "
                  f"TTFT {c['ttft_ms_median']:.0f} ms (plain {c['plain_ttft_ms_median']:.0f})", flush=True)
        res["raw"] = rows
        results[cat] = res
    if a.out:
        meta = {"model": path, "plain_on_engine": a.plain_on_engine, "lockstep": a.lockstep, "dtype": a.dtype, "threads": a.threads, "gen": a.gen, "reps": a.reps,
                "repeat": a.repeat, "keep": a.keep, "filler": a.filler, "temp": a.temp, "edit_tokens": a.edit_tokens if a.edit else None,
                "date": time.strftime("%Y-%m-%d")}
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps({"meta": meta, "results": results}, indent=1))


if __name__ == "__main__":
    main()
