"""Planning: the largest context that fits a memory budget, per KV type and mode (base, MTP, draft model)."""

from __future__ import annotations

from dataclasses import asdict, replace

from turbospec import dtypes
from turbospec.errors import TurboSpecError
from turbospec.lab.fit.arch import Arch
from turbospec.lab.fit.measure import measure_runtime_overhead
from turbospec.lab.fit.memory import (
    CPU_IMPORT_OVERHEAD,
    CPU_RUNTIME_OVERHEAD,
    MODEL_FREE,
    Breakdown,
    Setup,
    estimate,
)
from turbospec.lab.fit.units import parse_mem

DEFAULT_KV_TYPES = ("f16", "q8_0", "q4_0", "tbq4_0", "turbo4", "turbo3", "turbo2")
# Bits per weight of common weight formats (GGUF averages over a whole file; Q4_K_M mixes Q4_K and Q6_K).
WEIGHT_BPW = {
    "f32": 32.0, "f16": 16.0, "bf16": 16.0,  # float spellings (float16, fp16, ...) via turbospec.dtypes
    "q8_0": 8.5, "q6_k": 6.5625, "q5_k_m": 5.69, "q4_k_m": 4.85, "q4_0": 4.5, "q3_k_m": 3.91, "q2_k": 3.35,
}


def weight_bpw(name: str) -> float:
    """Bits per weight of a weight format name (q4_k_m, bf16, ...)."""
    key = dtypes.short_name(name) if dtypes.is_dtype_name(name) else name.lower()
    if key not in WEIGHT_BPW:
        raise TurboSpecError(f"unknown --weight-dtype {name!r} ({', '.join(WEIGHT_BPW)})")
    return WEIGHT_BPW[key]


def runtime_baseline(overhead: str | None, backend: str = "cpu") -> tuple[int | None, int | None]:
    """(runtime, import) baselines in bytes from a size, or from 'measure' (cpu: measured on a minimal model
    in a subprocess); (None, None) for the defaults."""
    runtime = imp = None
    if overhead == "measure":
        if backend != "cpu":
            raise TurboSpecError("--runtime-overhead measure works for the cpu backend only")
        imp, runtime = measure_runtime_overhead()
    elif overhead:
        runtime = parse_mem(overhead)
        imp = max(0, runtime - (CPU_RUNTIME_OVERHEAD - CPU_IMPORT_OVERHEAD))
    return runtime, imp


def max_context(arch: Arch, setup: Setup, mem: int, k_type: str, v_type: str, mode: str = "base",
                draft: Arch | None = None, dk_type: str | None = None, dv_type: str | None = None,
                cap: int = 1 << 22, step: int = 256) -> tuple[int, Breakdown | None]:
    """Largest context (`cap`, else a multiple of `step` below it) whose estimate fits `mem`; (0, None) if none
    does."""
    def fits(c: int) -> Breakdown | None:
        b = estimate(arch, setup, c, k_type, v_type, mode, draft, dk_type, dv_type)
        return b if b.total <= mem else None

    step = min(step, cap)
    if fits(step) is None:
        return 0, None
    at_cap = fits(cap)
    if at_cap is not None:
        return cap, at_cap
    lo, hi = 1, cap // step
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid * step) is not None:
            lo = mid
        else:
            hi = mid
    return lo * step, fits(lo * step)



def fit_table(arch: Arch, setup: Setup, mem: int, k_types: list[str], v_types: list[str], modes: list[str],
              draft: Arch | None = None, dk_type: str | None = None, dv_type: str | None = None,
              at_ctx: int | None = None, cap: int = 1 << 22) -> list[dict]:
    """One row per K type (paired with the V type of the same position, or the one V type) x mode: the largest
    context and its breakdown, and with `at_ctx` whether that context fits."""
    if v_types and len(v_types) not in (1, len(k_types)):
        raise TurboSpecError("-ctv must list one type or as many as -ctk")
    rows = []
    for i, kt in enumerate(k_types):
        vt = v_types[i] if len(v_types) > 1 else (v_types[0] if v_types else kt)
        for mode in modes:
            n, b = max_context(arch, setup, mem, kt, vt, mode, draft, dk_type, dv_type, cap=cap)
            row = {"kv_type": kt if kt == vt else f"{kt}/{vt}", "k_type": kt, "v_type": vt,
                   "mode": mode_label(mode, setup), "max_ctx": n, "breakdown": b.to_dict() if b else None}
            if at_ctx:
                a = estimate(arch, setup, at_ctx, kt, vt, mode, draft, dk_type, dv_type)
                row["at_ctx"] = {"ctx": at_ctx, "fits": a.total <= mem, **a.to_dict()}
            rows.append(row)
    return rows



def mode_label(mode: str, setup: Setup) -> str:
    """A row's mode as the report names it: base, mtp, draft, or the speculation with its model-free drafters
    (mtp+ngram, suffix, ...)."""
    if mode == "base" or not setup.drafters:
        return mode
    return "+".join(([mode] if mode != "ngram" else []) + list(setup.drafters))


def spec_mode(types: list[str], arch: Arch, draft: Arch | None) -> tuple[str, tuple[str, ...]]:
    """`--spec-type` names (serve's) -> (the estimate's mode, the model-free drafters among them)."""
    known = (*MODEL_FREE, "draft-mtp", "draft-model")
    for t in types:
        if t not in known:
            raise TurboSpecError(f"--spec-type {t!r}: fit plans {', '.join(known)}")
    drafters = tuple(t for t in types if t in MODEL_FREE)
    if "draft-mtp" in types and "draft-model" in types:
        raise TurboSpecError("--spec-type: plan draft-mtp or draft-model, not both")
    if "draft-model" in types:
        if draft is None:
            raise TurboSpecError("--spec-type draft-model needs -md / --draft-model")
        return "draft", drafters
    if "draft-mtp" in types:
        if not arch.mtp_layers:
            raise TurboSpecError(f"--spec-type draft-mtp: {arch.name} has no MTP module")
        return "mtp", drafters
    if not drafters:
        raise TurboSpecError("--spec-type: name at least one drafter")
    return "ngram", drafters


def plan(arch: Arch, setup: Setup, mem: int, k_types: list[str] | None = None,
         v_types: list[str] | None = None, mtp: bool | None = None, draft: Arch | None = None,
         dk_type: str | None = None, dv_type: str | None = None, at_ctx: int | None = None,
         cap: int = 1 << 22, spec: list[str] | None = None) -> dict:
    """The fit report (JSON ready): one row per KV type x mode. Modes: base, mtp (default: when the model has
    an MTP module), draft (when a draft model is given); with `spec` (`--spec-type` names) base and that
    speculation (its model-free drafters' tables counted) instead. K types default to DEFAULT_KV_TYPES, V types to
    K's."""
    modes = ["base"]
    if spec:
        if mtp is not None:
            raise TurboSpecError("--spec-type names the drafters: leave out --mtp / --no-mtp")
        mode, drafters = spec_mode(spec, arch, draft)
        setup = replace(setup, drafters=drafters)
        modes.append(mode)
        want_mtp = mode == "mtp"
    else:
        want_mtp = mtp if mtp is not None else bool(arch.mtp_layers)
        if want_mtp:
            if not arch.mtp_layers:
                raise TurboSpecError(
                    f"{arch.name} has no MTP module (no mtp.* tensors / mtp layers in the config)")
            modes.append("mtp")
        if draft is not None:
            modes.append("draft")
    if draft is not None and setup.parallel > 1:
        raise TurboSpecError("-md with -np > 1: serve does not batch draft-model (one copy of its weights per "
                             "sequence), so fit does not plan it")
    notes = list(arch.notes)
    if arch.exact_ctx is not None and arch.exact_ctx < cap:
        cap = arch.exact_ctx
        notes.append(f"context capped at {cap}: past it this model attends in a way turbospec does not implement "
                     "yet (a sliding window or attention temperature scaling), and `run` / `serve` refuse a longer -c")
    if arch.n_experts and setup.moe_cache_mem is None:
        setup = expert_plan(arch, setup, mem, at_ctx or 4096, want_mtp, notes)
    rows = fit_table(arch, setup, mem, list(k_types or DEFAULT_KV_TYPES), list(v_types or []), modes, draft,
                     dk_type, dv_type, at_ctx, cap=cap)
    bpw = setup.weights_bpw
    return {"model": arch.name, "mem_bytes": mem, "backend": setup.backend, "setup": asdict(setup),
            "weights_bpw": bpw if bpw is not None else arch.preset_bpw, "notes": notes,
            "rows": rows}


def expert_plan(arch: Arch, setup: Setup, mem: int, ctx: int, mtp: bool, notes: list[str]) -> Setup:
    """A MoE model whose experts do not all fit `mem` next to a `ctx`-token f16 context (with MTP when planned):
    the setup with the experts' budget (`--moe-cache-mem`) set to what is left, and a note; else `setup`."""
    mode = "mtp" if mtp else "base"
    full = estimate(arch, setup, ctx, "f16", "f16", mode)
    if full.total <= mem:
        return setup
    rest = estimate(arch, replace(setup, moe_cache_mem=0), ctx, "f16", "f16", mode)
    left = mem - rest.total
    one_token = arch.experts_per_tok * (full.experts // max(1, arch.n_experts))  # a token's experts, all layers
    if left < one_token:
        notes.append(f"the routed experts ({full.experts / 2**30:.1f} GiB) do not fit, and what is left next to a "
                     f"{ctx}-token f16 context ({max(0, left) / 2**20:.0f} MiB) is less than one token's experts "
                     f"({one_token / 2**20:.0f} MiB)")
        return setup
    notes.append(f"experts: {left / 2**30:.2f} of {full.experts / 2**30:.2f} GiB kept in memory "
                 f"({100 * left / full.experts:.0f}%, sized for a {ctx}-token f16 context{' with MTP' if mtp else ''}); "
                 f"the rest are read from the file when tokens route to them: run with "
                 f"--moe-cache-mem {left >> 20}")
    return replace(setup, moe_cache_mem=left)
