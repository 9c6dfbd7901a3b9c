"""Every TURBOSPEC_* environment switch, declared and read in this module only.

Switches change which code path runs (for benchmarks and debugging), never results beyond float rounding:

| variable | effect |
|---|---|
| TURBOSPEC_MODEL | checkpoint used when no model is given (`-m`) |
| TURBOSPEC_API_KEY | `turbospec serve`: require this bearer key (as `--api-key`; used when neither key flag is given; set but empty is an error) |
| TURBOSPEC_NO_KERNEL | build no C++ kernel: torch ops only |
| TURBOSPEC_NO_FUSED | no one-call decoder layer: op-by-op path (read at import) |
| TURBOSPEC_NO_ATTN_KERNEL | packed-KV attention in torch instead of the fused C++ kernel |
| TURBOSPEC_NO_ENCODE_KERNEL | KV encoders in torch instead of C++ |
| TURBOSPEC_NO_GDN_KERNEL | Gated DeltaNet recurrence in torch instead of C++ |
| TURBOSPEC_TRITON_GDN | on a GPU: the Gated DeltaNet step in Triton (kernels/triton_deltanet.py) instead of torch's ops; opt-in until its GPU parity is settled (docs/gpu.md) |
| TURBOSPEC_NO_AVX512 | C++ kernels: the AVX2 paths instead of AVX-512 (packed-weight products, attention; read by the C++ kernels, once per process) |
| TURBOSPEC_NO_HUGEPAGES | weights and KV in ordinary 4 KB pages (read at import) |
| TURBOSPEC_SKINNY_MAX_ROWS | most rows the skinny GEMM takes per call, default 16 (read at import) |
| TURBOSPEC_PREFILL | prefill GEMMs: `auto` (default) bf16 weights in bf16 where the CPU has AVX-512 BF16 / AMX, the rest in float32 (oneDNN); `upcast`: always float32; `native`: the weight dtype, torch's default GEMM (read at import) |
| TURBOSPEC_TP_TIMEOUT | tensor parallelism: seconds a rank waits in a collective before it ends with an error, default 120 |

The test suite reads two more, in tests/ only: TURBOSPEC_TEST_THREADS (torch threads, default 2) and
TURBOSPEC_HYPOTHESIS_EXAMPLES (property-test examples for the KV codecs, default 0: the fixed cases only).

Switches marked "read at import" are checked per layer per token and are read once; the others are read when
the code path is chosen, so a test or benchmark may set them at run time.
"""

from __future__ import annotations

import os

SWITCHES = ("TURBOSPEC_MODEL", "TURBOSPEC_API_KEY", "TURBOSPEC_NO_KERNEL", "TURBOSPEC_NO_FUSED",
            "TURBOSPEC_NO_ATTN_KERNEL", "TURBOSPEC_NO_ENCODE_KERNEL", "TURBOSPEC_NO_GDN_KERNEL", "TURBOSPEC_TRITON_GDN",
            "TURBOSPEC_NO_AVX512", "TURBOSPEC_NO_HUGEPAGES", "TURBOSPEC_SKINNY_MAX_ROWS", "TURBOSPEC_PREFILL", "TURBOSPEC_TP_TIMEOUT")


def get(name: str, default: str = "") -> str:
    """The switch's value now ('' or `default` when unset)."""
    if name not in SWITCHES:
        raise KeyError(f"{name} is not a turbospec switch (see turbospec/env.py)")
    return os.environ.get(name) or default


def lookup(name: str) -> str | None:
    """The switch's raw value: None when unset, '' when set but empty (for settings where that is an error)."""
    if name not in SWITCHES:
        raise KeyError(f"{name} is not a turbospec switch (see turbospec/env.py)")
    return os.environ.get(name)


def on(name: str) -> bool:
    """True when the switch is set to a non-empty value."""
    return bool(get(name))


def all_set() -> dict[str, str]:
    """Every TURBOSPEC_* variable in the environment (for reports: they change the measured code path)."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith("TURBOSPEC_")}


# read once: these are checked per layer per token
FUSED = not on("TURBOSPEC_NO_FUSED")
HUGEPAGES = not on("TURBOSPEC_NO_HUGEPAGES")
SKINNY_MAX_ROWS = int(get("TURBOSPEC_SKINNY_MAX_ROWS", "16"))
PREFILL_MODE = get("TURBOSPEC_PREFILL", "auto")
