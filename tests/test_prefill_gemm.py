"""Prefill products (`linear.prefill_product`): every TURBOSPEC_PREFILL mode against a float64 reference, and the
automatic choice of torch's bf16 GEMM only where the CPU has AVX-512 BF16 or AMX."""

from pathlib import Path

import pytest
import torch

from turbospec import env
from turbospec.errors import TurboSpecError
from turbospec.layers import linear


@pytest.fixture
def mode(monkeypatch):
    def set_mode(m: str) -> None:
        monkeypatch.setattr(env, "PREFILL_MODE", m)
        clear()

    def clear() -> None:
        for f in (linear._prefill_mode, linear.bf16_prefill_gemm, linear._onednn_f32):
            f.cache_clear()

    yield set_mode
    monkeypatch.undo()
    clear()


@pytest.mark.parametrize("m", ["auto", "upcast", "native"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_prefill_product_matches_float64(mode, m, dtype):
    mode(m)
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 160, generator=g).to(dtype)
    b = torch.randn(96, generator=g).to(dtype)
    x = torch.randn(2, 40, 160, generator=g).to(dtype)
    ref = (x.double() @ w.double().T + b.double()).float()
    for bias in (b, None):
        got = linear.prefill_product(x, w, bias)
        want = ref if bias is not None else (x.double() @ w.double().T).float()
        assert got.dtype == dtype and got.shape == (2, 40, 96)
        tol = 1e-4 if dtype == torch.float32 else 1e-2
        assert ((got.float() - want).abs().max() / want.abs().max()).item() < tol


def test_auto_uses_the_bf16_gemm_only_where_the_cpu_has_it(mode):
    mode("auto")
    info = Path("/proc/cpuinfo")
    flags = info.read_text().split() if info.exists() else []
    if not flags:
        pytest.skip("no /proc/cpuinfo")
    has = "avx512_bf16" in flags or "amx_tile" in flags
    assert linear.bf16_prefill_gemm() == has
    mode("upcast")
    assert not linear.bf16_prefill_gemm()
    mode("native")
    assert linear.bf16_prefill_gemm() and not linear._onednn_f32()
    assert not linear._cpu_has("_no_such_check")


def test_an_unknown_mode_is_a_one_line_error(mode):
    mode("fast")
    with pytest.raises(TurboSpecError, match="TURBOSPEC_PREFILL must be auto, upcast or native"):
        linear.prefill_product(torch.ones(20, 8), torch.ones(3, 8), None)
