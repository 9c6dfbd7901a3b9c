"""Perplexity, KL divergence vs a baseline, and long-context retrieval, per KV configuration.

Perplexity the llama-perplexity way: the text is cut into chunks of `ctx` tokens, each chunk is processed from
an empty cache in ubatch pieces (later pieces attend to the quantized entries of earlier ones) and the second
half of every chunk is scored. KLD(p_baseline || p_candidate) per scored position on the same weights (default
baseline: f16/f16 KV, no speculation), reported as mean, median, 99%, 99.9%, max, same-top-1 % and RMS delta-p
(change of the probability of the correct token). Retrieval: a passkey, or one number among many in a
number-dense "financial report", placed at a chosen depth of real filler text; greedy answer must contain the
value.
"""

from __future__ import annotations

import json
import math
import random
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from turbospec.config import EngineConfig, kv_type
from turbospec.engine import Engine, load_parts
from turbospec.errors import TurboSpecError
from turbospec.kv.plan import AttentionPlan
from turbospec.lab import plots
from turbospec.lab.progress import loading, progress
from turbospec.lab.report import env_info, markdown_table, write_csv, write_json

PAIRS = ["f16/f16", "q8_0/q8_0", "q4_0/q4_0", "tbq4_0/tbq4_0", "turbo4/turbo4", "turbo3/turbo3",
         "turbo2/turbo2", "q8_0/turbo4", "q8_0/turbo3"]
EVAL_DIR = Path(__file__).resolve().parent.parent / "data" / "eval"
PPL_COLUMNS = ["kv", "ctx", "ppl", "kld_mean", "kld_median", "kld_p99", "kld_p999", "kld_max",
               "same_top1_pct", "rms_dp_pct"]
RETRIEVAL_COLUMNS = ["kv", "kind", "length", "depth", "accuracy"]


@dataclass(frozen=True)
class QualityOptions:
    """What `run_quality` measures: perplexity / KLD per K/V pair over chunks of each size of `ctxs`, and,
    with `retrieval`, the retrieval grid (kinds x lengths x depths, `cases` documents per cell)."""

    text: str = str(EVAL_DIR / "prose.jsonl")  # text or .jsonl (field 'text')
    ctxs: tuple[int, ...] = (512,)  # chunk sizes
    chunks: int = 4  # most chunks per size
    pairs: tuple[str, ...] = tuple(PAIRS)  # K/V pairs
    baseline: str = "f16/f16"
    retrieval: bool = False
    lengths: tuple[int, ...] = (1024, 2048, 4096)  # retrieval context lengths
    depths: tuple[float, ...] = (0.1, 0.5, 0.9)  # retrieval needle depths (0..1)
    cases: int = 5  # retrieval cases per cell
    kinds: tuple[str, ...] = ("passkey", "numbers")
    quiet: bool = False  # no progress bars


def read_text(path: str | Path) -> str:
    p = Path(path)
    if not p.exists():
        raise TurboSpecError(f"text file {p} does not exist")
    if p.suffix == ".jsonl":
        return "\n\n".join(json.loads(line)["text"] for line in p.read_text().splitlines() if line.strip())
    return p.read_text()


def parse_pair(p: str) -> tuple[str, str]:
    """A K/V format pair `K/V` (or one name for both), each normalised as -ctk/-ctv are."""
    if "/" not in p:
        p = f"{p}/{p}"
    k, v = (kv_type(t) for t in p.split("/", 1))
    if k is None or v is None:
        raise TurboSpecError(f"--kv {p!r}: expected K/V format names such as q8_0/q8_0")
    return k, v


@torch.inference_mode()
def prefill_hidden(model, ids: torch.Tensor, k_type: str, v_type: str, ubatch: int) -> torch.Tensor:
    """Hidden states [N, H] of every position, prefilled from an empty (K, V)-format cache in `ubatch` pieces
    (later pieces attend to the quantized entries of earlier ones)."""
    cache = model.new_cache(ids.numel(), k_type=k_type, v_type=v_type)
    hs = []
    for s in range(0, ids.numel(), ubatch):
        piece = ids[s:s + ubatch]
        hs.append(model.forward(piece, AttentionPlan.causal(cache.length, piece.numel()), cache))
        cache.commit()
    return torch.cat(hs)


def chunk_logprobs(model, ids: torch.Tensor, k_type: str, v_type: str, ubatch: int) -> torch.Tensor:
    """Log-probabilities [ctx//2 - 1, V] for the second half of one chunk."""
    n = ids.numel()
    h = prefill_hidden(model, ids, k_type, v_type, ubatch)[n // 2:n - 1]
    return torch.log_softmax(model.logits(h), dim=-1)


def kld_stats(kld: torch.Tensor) -> dict[str, float]:
    k = kld.double()
    q = torch.quantile(k, torch.tensor([0.5, 0.99, 0.999], dtype=torch.float64))
    return {"kld_mean": k.mean().item(), "kld_median": q[0].item(), "kld_p99": q[1].item(),
            "kld_p999": q[2].item(), "kld_max": k.max().item()}


def perplexity_table(model, tokens: list[int], ctx: int, chunks: int, pairs: list[str], baseline: str,
                     ubatch: int, progress=None) -> list[dict[str, Any]]:
    n_chunks = min(len(tokens) // ctx, chunks)
    if n_chunks < 1:
        raise TurboSpecError(f"text has {len(tokens)} tokens, fewer than one chunk of {ctx}")
    acc = {p: {"nll": 0.0, "n": 0, "kld": [], "same": 0, "dp": [], "s": 0.0} for p in pairs}
    for c in range(n_chunks):
        ids = torch.tensor(tokens[c * ctx:(c + 1) * ctx], dtype=torch.int64)
        targets = ids[ctx // 2 + 1:]
        base = chunk_logprobs(model, ids, *parse_pair(baseline), ubatch)
        for p in pairs:
            t = time.perf_counter()
            lp = base if p == baseline else chunk_logprobs(model, ids, *parse_pair(p), ubatch)
            st = acc[p]
            st["s"] += time.perf_counter() - t
            st["nll"] -= lp.gather(1, targets[:, None]).sum().item()
            st["n"] += targets.numel()
            st["kld"].append((base.exp() * (base - lp)).sum(-1).clamp_min(0))
            st["same"] += int((base.argmax(-1) == lp.argmax(-1)).sum())
            st["dp"].append(lp.gather(1, targets[:, None]).exp() - base.gather(1, targets[:, None]).exp())
            if progress:
                progress()
    rows = []
    for p in pairs:
        st = acc[p]
        dp = torch.cat(st["dp"]).double()
        rows.append({"kv": p, "ctx": ctx, "chunks": n_chunks, "tokens_scored": st["n"],
                     "ppl": math.exp(st["nll"] / st["n"]), **kld_stats(torch.cat(st["kld"])),
                     "same_top1_pct": 100.0 * st["same"] / st["n"],
                     "rms_dp_pct": 100.0 * dp.pow(2).mean().sqrt().item(),
                     "seconds": st["s"]})
    return rows


def make_retrieval_case(tok, filler: list[int], length: int, depth: float, kind: str, rng: random.Random
                        ) -> tuple[list[int], str]:
    """A document of about `length` tokens: filler with a fact at relative `depth`, then a question."""
    if kind == "passkey":
        value = str(rng.randrange(10000, 99999))
        fact = f"\nThe passkey is {value}. Remember it.\n"
        question = "\nWhat is the passkey? The passkey is"
    else:  # numbers: one account among many number-dense lines, the seeds' financial-report worry
        target = rng.randrange(1, 99)
        def amount() -> str:
            return f"{rng.randrange(1, 9)},{rng.randrange(100, 999)},{rng.randrange(100, 999)}"

        value = amount()
        rows = [f"Account {a} balance: {amount()}\n" for a in rng.sample(range(100, 999), 6)]
        fact = "".join(rows[:3]) + f"Account {target} balance: {value}\n" + "".join(rows[3:])
        question = f"\nWhat is the balance of account {target}? The balance of account {target} is"
    f_ids, q_ids = tok.encode(fact, add_special=False), tok.encode(question, add_special=False)
    room = max(0, length - len(f_ids) - len(q_ids))
    start = rng.randrange(0, max(1, len(filler) - room))
    body = filler[start:start + room]
    cut = int(len(body) * depth)
    return body[:cut] + f_ids + body[cut:] + q_ids, value


def retrieval_grid(engine_factory, tok, filler: list[int], pairs: list[str], lengths: list[int],
                   depths: list[float], cases: int, kinds: list[str], seed: int = 0, progress=None
                   ) -> list[dict[str, Any]]:
    from turbospec.sampling import SamplingParams

    rows = []
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    for p in pairs:
        engine = engine_factory(*parse_pair(p), max(lengths) + 512)  # room for fact + question
        for kind in kinds:
            for length in lengths:
                for depth in depths:
                    rng = random.Random(f"{seed}-{kind}-{length}-{depth}")
                    hits = 0
                    for _ in range(cases):
                        ids, value = make_retrieval_case(tok, filler, length, depth, kind, rng)
                        out = engine.generate([ids], params)[0]["text"]
                        hits += int(value in out.replace(" ", ""))
                        if progress:
                            progress()
                    rows.append({"kv": p, "kind": kind, "length": length, "depth": depth, "cases": cases,
                                 "accuracy": hits / cases})
    return rows


def run_quality(config: EngineConfig, opts: QualityOptions, settings: dict[str, Any] | None = None
                ) -> dict[str, Any]:
    """Load `config`'s model once and measure `opts`; the report (env, settings, perplexity, retrieval rows).
    KV types, context and threads of the retrieval engines come from `config` (ubatch too); `settings` is
    recorded as given (the command line passes its flags); default: config and options."""
    pairs = list(opts.pairs)
    for p in pairs + [opts.baseline]:
        parse_pair(p)
    ctxs = list(opts.ctxs)
    with loading(opts.quiet) as load_bar:
        path, model, tok = load_parts(config, load_bar)
    if tok is None:
        raise TurboSpecError(f"{path} has no tokenizer.json (quality measures text)")
    text = read_text(opts.text)[: max(ctxs) * opts.chunks * 8]
    tokens = tok.encode(text, add_special=False)
    total = sum(min(len(tokens) // c, opts.chunks) for c in ctxs) * len(pairs)
    bar = progress(total, "quality", opts.quiet)
    ppl_rows: list[dict[str, Any]] = []
    for c in ctxs:
        ppl_rows += perplexity_table(model, tokens, c, opts.chunks, pairs, opts.baseline, config.ubatch,
                                     lambda: bar.update(1))
    bar.close()
    ret_rows: list[dict[str, Any]] = []
    if opts.retrieval:
        lengths, depths, kinds = list(opts.lengths), list(opts.depths), list(opts.kinds)
        filler = tok.encode(read_text(EVAL_DIR / "prose.jsonl")[:200000], add_special=False)
        rbar = progress(len(pairs) * len(kinds) * len(lengths) * len(depths) * opts.cases, "retrieval", opts.quiet)

        def factory(k: str, v: str, ctx: int) -> Engine:
            cfg = config.replace(ctx=ctx, cache_type_k=k, cache_type_v=v, prefix_cache=False)
            return Engine(model, tok, cfg, model_path=path)

        ret_rows = retrieval_grid(factory, tok, filler, pairs, lengths, depths, opts.cases, kinds,
                                  progress=lambda: rbar.update(1))
        rbar.close()
    if settings is None:
        settings = {"engine": config.to_dict(), **asdict(opts)}
    return {"env": env_info(path), "settings": settings, "perplexity": ppl_rows, "retrieval": ret_rows}


def write_reports(report: dict[str, Any], out: Path, opts: QualityOptions, plot_formats: Iterable[str] = ("png",)
                  ) -> list[Path]:
    """report.json, perplexity.csv, report.md (and retrieval.csv) and the plots (`turbospec.lab.plots`: kld,
    kld_vs_bits, retrieval) in each of `plot_formats` (png, svg) into directory `out`; the files written."""
    ppl_rows, ret_rows = report["perplexity"], report["retrieval"]
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "report.json", report)
    write_csv(out / "perplexity.csv", ppl_rows)
    source = f"model {report['env'].get('model')}, text {opts.text}, baseline {opts.baseline}"
    md = ["# turbospec quality", "", source, "", markdown_table(ppl_rows, PPL_COLUMNS), ""]
    files = [out / "report.json", out / "perplexity.csv"]
    if ret_rows:
        write_csv(out / "retrieval.csv", ret_rows)
        files.append(out / "retrieval.csv")
        md += ["## Retrieval accuracy", "", markdown_table(ret_rows, RETRIEVAL_COLUMNS), ""]
    (out / "report.md").write_text("\n".join(md))
    return [*files, out / "report.md", *plots.write_figures(report, out, plot_formats)]


def print_tables(report: dict[str, Any]) -> None:
    """The perplexity table (and the retrieval table) as Markdown on stdout."""
    print(markdown_table(report["perplexity"], PPL_COLUMNS))
    if report["retrieval"]:
        print(markdown_table(report["retrieval"], RETRIEVAL_COLUMNS))
