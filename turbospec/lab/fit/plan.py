"""Planning: the largest context that fits a memory budget, per KV type and mode (base, MTP, draft model)."""

from __future__ import annotations

from dataclasses import asdict

from turbospec import dtypes
from turbospec.errors import TurboSpecError
from turbospec.lab.fit.arch import Arch
from turbospec.lab.fit.measure import measure_runtime_overhead
from turbospec.lab.fit.memory import (
    CPU_IMPORT_OVERHEAD,
    CPU_RUNTIME_OVERHEAD,
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
    """Largest context (a multiple of `step`, <= cap) whose estimate fits `mem`; (0, None) if none does."""
    def fits(c: int) -> Breakdown | None:
        b = estimate(arch, setup, c, k_type, v_type, mode, draft, dk_type, dv_type)
        return b if b.total <= mem else None

    if fits(step) is None:
        return 0, None
    lo, hi = 1, cap // step
    if fits(hi * step) is not None:
        return hi * step, fits(hi * step)
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
            row = {"kv_type": kt if kt == vt else f"{kt}/{vt}", "k_type": kt, "v_type": vt, "mode": mode,
                   "max_ctx": n, "breakdown": b.to_dict() if b else None}
            if at_ctx:
                a = estimate(arch, setup, at_ctx, kt, vt, mode, draft, dk_type, dv_type)
                row["at_ctx"] = {"ctx": at_ctx, "fits": a.total <= mem, **a.to_dict()}
            rows.append(row)
    return rows



def plan(arch: Arch, setup: Setup, mem: int, k_types: list[str] | None = None,
         v_types: list[str] | None = None, mtp: bool | None = None, draft: Arch | None = None,
         dk_type: str | None = None, dv_type: str | None = None, at_ctx: int | None = None,
         cap: int = 1 << 22) -> dict:
    """The fit report (JSON ready): one row per KV type x mode. Modes: base, mtp (default: when the model has
    an MTP module), draft (when a draft model is given); K types default to DEFAULT_KV_TYPES, V types to
    K's."""
    modes = ["base"]
    want_mtp = mtp if mtp is not None else bool(arch.mtp_layers) and setup.parallel == 1
    if want_mtp:
        if not arch.mtp_layers:
            raise TurboSpecError(
                f"{arch.name} has no MTP module (no mtp.* tensors / mtp layers in the config)")
        modes.append("mtp")
    if draft is not None:
        modes.append("draft")
    rows = fit_table(arch, setup, mem, list(k_types or DEFAULT_KV_TYPES), list(v_types or []), modes, draft,
                     dk_type, dv_type, at_ctx, cap=cap)
    bpw = setup.weights_bpw
    return {"model": arch.name, "mem_bytes": mem, "backend": setup.backend, "setup": asdict(setup),
            "weights_bpw": bpw if bpw is not None else arch.preset_bpw, "notes": arch.notes,
            "rows": rows}
