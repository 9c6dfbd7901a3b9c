"""`turbospec fit`: its flags, turned into an `Arch`, a `Setup` and a budget for turbospec.lab.fit."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from turbospec import dtypes
from turbospec.errors import TurboSpecError
from turbospec.lab import fit
from turbospec.weights import WEIGHT_CHOICES


def register(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("fit", help="maximum context per KV type for a memory budget (weights, KV, "
                                   "recurrent state, MTP/draft, activations)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("-m", "--model", help="checkpoint directory (config.json + safetensors) or .gguf file")
    src.add_argument("--config", help="a config.json")
    src.add_argument("--preset", help=f"named architecture: {', '.join(fit.PRESETS)}")
    p.add_argument("--mem", required=True, help="memory budget, e.g. 24GiB, 24GB, 512MiB")
    p.add_argument("--backend", choices=("cpu", "cuda"), default="cpu",
                   help="cpu: turbospec's CPU engine (default); cuda: a llama.cpp-style GPU run")
    p.add_argument("--dtype", default="float32", help="CPU weight/compute dtype as `turbospec run` (float32)")
    p.add_argument("-ctk", "--cache-type-k", default=None,
                   help=f"K cache type(s), comma list (default: {','.join(fit.DEFAULT_KV_TYPES)})")
    p.add_argument("-ctv", "--cache-type-v", default=None, help="V cache type(s) (default: as -ctk)")
    p.add_argument("-ctkd", "--cache-type-k-draft", default=None,
                   help="MTP/draft K cache type (default: as K)")
    p.add_argument("-ctvd", "--cache-type-v-draft", default=None,
                   help="MTP/draft V cache type (default: as V)")
    w = p.add_mutually_exclusive_group()
    w.add_argument("--weights-bpw", type=float, default=None, help="bits per weight, e.g. 4.85 for Q4_K_M")
    w.add_argument("--weight-dtype", default=None, help=f"weight format: {', '.join(fit.WEIGHT_BPW)}")
    w.add_argument("--weights", default="auto", choices=WEIGHT_CHOICES,
                   help="cpu: as `turbospec run --weights` (matrices packed at load; default auto: as stored, a "
                        "GGUF file's Q8_0/Q4_0/Q4_K matrices packed)")
    p.add_argument("-ub", "--ubatch-size", type=int, default=512, help="ubatch (default 512)")
    p.add_argument("--mtp", dest="mtp", action="store_true", default=None, help="include MTP rows")
    p.add_argument("--no-mtp", dest="mtp", action="store_false", help="no MTP rows")
    p.add_argument("-md", "--draft-model", default=None, help="draft model (directory, .gguf or config.json)")
    p.add_argument("--n-max", type=int, default=3, help="draft tokens per step (default 3)")
    p.add_argument("--spec-type", default=None,
                   help="plan this speculation, as `serve --spec-type` names it (comma list of draft-mtp, "
                        "draft-model, ngram, ngram-mod, suffix): rows without and with it, the model-free "
                        "drafters' tables counted (instead of --mtp / -md rows)")
    p.add_argument("--spec-suffix-shared", action="store_true",
                   help="with suffix: the server's shared store of earlier requests (as serve's flag)")
    p.add_argument("--spec-suffix-store", type=int, default=1 << 18, metavar="N",
                   help="tokens that store keeps (as serve's flag; default 262144)")
    p.add_argument("-c", "--ctx-size", type=int, default=None, help="also report whether this context fits")
    p.add_argument("--ctx-max", type=int, default=None, help="search cap (default: 4M tokens)")
    p.add_argument("--logits-rows", type=int, default=None,
                   help="rows of logits held at once (default: 1+n_max on cpu, ubatch on cuda)")
    p.add_argument("--runtime-overhead", default=None,
                   help="process baseline: a size, or 'measure' (cpu: runs a minimal model in a "
                        f"subprocess); default cpu {fit.CPU_RUNTIME_OVERHEAD // 2**20} MiB "
                        f"(+ {fit.CPU_IMPORT_OVERHEAD // 2**20} MiB before loading; with -np > 1, a server: "
                        f"{fit.CPU_SERVE_OVERHEAD // 2**20} MiB) measured, cuda {fit.CUDA_RUNTIME_OVERHEAD // 2**20} MiB estimate")
    p.add_argument("--spec-state", choices=("per-position", "checkpoint"), default="per-position",
                   help="GDN rollback for speculation: a state copy per chain position (turbospec, default) "
                        "or one checkpoint copy (llama.cpp speculative checkpointing)")
    p.add_argument("-np", "--parallel", type=int, default=1,
                   help="cpu: sequences served together (serve -np): the context is then the positions of the KV "
                        "pool they share, and hybrids hold a recurrent state per sequence (default 1)")
    p.add_argument("--ctx-checkpoints", type=int, default=3,
                   help="hybrids: recurrent states kept for prefix reuse, per sequence (serve's flag; default 3)")
    p.add_argument("--moe-cache-mem", type=int, default=None, metavar="MIB",
                   help="MoE models: MiB of routed experts kept in memory, as `turbospec run --moe-cache-mem` "
                        "(default: all of them when they fit, else what is left next to a -c (4096) context)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--plot", default=None, metavar="FILE",
                   help="also draw the memory parts per KV type (and at -c) as FILE.png or FILE.svg (a second "
                        "chart, FILE_at_ctx, with -c)")
    p.set_defaults(func=run)
    return p


def _types(s: str | None) -> list[str]:
    if not s:
        return []
    return [t.strip() for t in s.split(",") if t.strip()]


def run(a: argparse.Namespace) -> int:
    arch = fit.load_arch(a.model, a.config, a.preset)
    bpw = fit.weight_bpw(a.weight_dtype) if a.weight_dtype else a.weights_bpw
    if a.moe_cache_mem is not None and a.moe_cache_mem < 0:
        raise TurboSpecError("--moe-cache-mem must be >= 0 MiB")
    if a.ubatch_size < 1 or a.n_max < 0 or a.parallel < 1 or a.ctx_checkpoints < 0:
        raise TurboSpecError("-ub and -np must be >= 1, --n-max and --ctx-checkpoints >= 0")
    if a.parallel > 1 and a.backend != "cpu":
        raise TurboSpecError("-np > 1 plans turbospec's CPU server (--backend cpu)")
    if not dtypes.is_dtype_name(a.dtype):
        raise TurboSpecError(f"unknown --dtype {a.dtype!r} (float32, bfloat16, float16)")
    runtime, imp = fit.runtime_baseline(a.runtime_overhead, a.backend)
    setup = fit.Setup(backend=a.backend, dtype=a.dtype, weights_bpw=bpw, ubatch=a.ubatch_size, n_max=a.n_max,
                      weights=a.weights, logits_rows=a.logits_rows, runtime_overhead=runtime, import_overhead=imp,
                      spec_state=a.spec_state, parallel=a.parallel, ctx_checkpoints=a.ctx_checkpoints,
                      suffix_store=a.spec_suffix_store if a.spec_suffix_shared else 0,
                      moe_cache_mem=None if a.moe_cache_mem is None else a.moe_cache_mem << 20)
    mem = fit.parse_mem(a.mem)
    draft = fit.load_arch(a.draft_model) if a.draft_model else None
    info = fit.plan(arch, setup, mem, _types(a.cache_type_k), _types(a.cache_type_v), a.mtp, draft,
                    a.cache_type_k_draft, a.cache_type_v_draft, a.ctx_size, cap=a.ctx_max or (1 << 22),
                    spec=_types(a.spec_type) or None)
    if a.json:
        print(json.dumps(info, indent=2))
    else:
        print(fit.format_report(info))
        sys.stdout.flush()
    if a.plot:
        write_plots(info, Path(a.plot))
    return 0


def write_plots(info: dict, path: Path) -> list[Path]:
    """The fit report's memory chart at `path` (SVG for .svg, else PNG), the chart at -c beside it as
    <stem>_at_ctx<suffix>; the files written."""
    from turbospec.lab import plots

    names = {"memory": path, "memory_at_ctx": path.with_name(f"{path.stem}_at_ctx{path.suffix}")}
    files = [plots.save(fig, names[name]) for name, fig in plots.figures(info, only=names)]
    for f in files:
        print(f"plot written to {f}", file=sys.stderr)
    return files
