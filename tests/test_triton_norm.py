"""The Triton RMSNorm (turbospec/kernels/triton_norm.py) against the formula of `layers.norm.rms_norm`'s torch path:
float32, bfloat16 and float16, zero-centred and plain weights, widths that are and are not powers of two; on a GPU
where there is one, else in Triton's interpreter (tests/conftest.py; it rounds to bfloat16 differently)."""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F

from turbospec.kernels import gpu
from turbospec.kernels import triton_norm as tn

if importlib.util.find_spec("triton") is None:
    pytest.skip("Triton is not installed", allow_module_level=True)

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("zero_centred", [False, True])
@pytest.mark.parametrize("shape", [(3, 256), (2, 4, 64), (1, 5120), (2, 96)])
@pytest.mark.parametrize("per_program", [1, 16])  # rows per program: 1 as on a GPU, 16 as in the interpreter
def test_rms_norm_matches_the_torch_formula(monkeypatch, dtype, zero_centred, shape, per_program):
    monkeypatch.setattr(gpu, "ON_CPU", DEV == "cpu")
    monkeypatch.setattr(tn, "INTERPRETER_ROWS", per_program)
    g = torch.Generator().manual_seed(shape[-1])
    x = (torch.randn(*shape, generator=g) * 3).to(dtype)
    w = (torch.randn(shape[-1], generator=g) * 0.1 + (0 if zero_centred else 1)).to(dtype)
    y = F.rms_norm(x.float(), (shape[-1],), None, 1e-6)
    ref = (y * (1.0 + w.float())).to(dtype) if zero_centred else w * y.to(dtype)
    got = tn.rms_norm(x.to(DEV), w.to(DEV), 1e-6, zero_centred).cpu()
    assert got.dtype == dtype and got.shape == x.shape
    tol = {torch.float32: 1e-5, torch.bfloat16: 2 ** -6, torch.float16: 2 ** -9}[dtype]
    torch.testing.assert_close(got.float(), ref.float(), rtol=tol, atol=tol)
