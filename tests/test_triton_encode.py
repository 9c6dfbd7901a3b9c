"""The Triton KV encoder (turbospec/kernels/triton_encode.py): the same bytes as the torch reference encoders for
plain, q8_0, q4_0 and tbq4_0 (zeros, ties of the largest magnitude, negative maxima); on a GPU where there is one,
else in Triton's interpreter (which rounds bfloat16 differently: within one bf16 step there)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from turbospec.kernels import gpu
from turbospec.kernels import triton_encode as te
from turbospec.kv import kernel_args
from turbospec.kv.formats import NORM_MODES, get_format
from turbospec.kv.formats.turbo import TurboFormat
from turbospec.kv.hadamard import rotation_matrix
from turbospec.kv.quant_cache import QuantKVCache

if importlib.util.find_spec("triton") is None:
    pytest.skip("Triton is not installed", allow_module_level=True)

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def interpret(monkeypatch):
    """On the CPU: the kernels in Triton's interpreter (tests/conftest.py set TRITON_INTERPRET before Triton loaded)."""
    if DEV == "cpu":
        monkeypatch.setattr(gpu, "ON_CPU", True)


@pytest.mark.parametrize("name", ["f32", "f16", "bf16", "q8_0", "q4_0", "tbq4_0"])
@pytest.mark.parametrize("dim", [64, 256])
def test_encoder_writes_the_reference_bytes(interpret, name, dim):
    g = torch.Generator().manual_seed(dim)
    fmt = get_format(name)
    kvh, n, t = 2, 3, 10
    x = torch.randn(kvh, n, dim, generator=g) * 3
    x[0, 0, :40] = 0  # a zero block
    x[1, 1, 7] = -x[1, 1].abs().max()  # a tie of the largest magnitude, negative
    x[1, 2, 3] = 1e-3  # small values beside large ones
    ref = fmt.encode(x)
    spec = kernel_args.attention_spec(fmt, dim)
    assert te.supports(spec[0], fmt.padded_dim(dim), dim)
    bufs = {f: b.to(DEV) for f, b in fmt.allocate(dim, (kvh, t)).items()}
    te.encode_into(x.to(DEV), spec[0], [bufs[f] for f in spec[2]], 4)
    for f in spec[2]:
        got = bufs[f][:, 4:4 + n].cpu()
        if name == "bf16" and DEV == "cpu":
            torch.testing.assert_close(got.float(), ref[f].float(), rtol=2 ** -7, atol=0)
        else:
            assert torch.equal(got, ref[f]), f
        assert not bufs[f][:, :4].cpu().any() and not bufs[f][:, 4 + n:].cpu().any()  # nothing else written


def test_cache_takes_the_encoder_only_for_formats_it_writes(interpret):
    """Dithered tbq4_0d and TurboQuant-prod keep the torch encoders."""
    for name, expect in (("q8_0", True), ("tbq4_0", True), ("tbq4_0d", False), ("turbo3", True), ("turbo3p", False)):
        with torch.device(DEV):
            cache = QuantKVCache(1, 2, 64, 8, name, name)
        assert (cache._gpu_encode[0] is not None) == expect, name


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("mode", NORM_MODES)
@pytest.mark.parametrize("dim", [64, 256])
def test_turbo_encoder_matches_the_reference(interpret, bits, mode, dim):
    """turbo2/3/4 in every norm mode, 64- and 128-value blocks, more vectors than one program holds: the
    reference's fields, but for indices of coordinates within rounding of a codebook boundary (the rotation's
    products are summed in another order on a GPU)."""
    g = torch.Generator().manual_seed(bits * dim)
    fmt = TurboFormat(bits, norm_mode=mode)
    kvh, n, t = 3, 7, 12
    x = torch.randn(kvh, n, dim, generator=g)
    ref = fmt.encode(x)
    spec = kernel_args.encode_spec(fmt, dim)
    block = fmt.for_dim(dim).block_size
    turbo = (rotation_matrix(DEV, torch.float32, block), spec.bounds.to(DEV), spec.cent.to(DEV), bits,
             NORM_MODES.index(mode))
    bufs = {f: b.to(DEV) for f, b in fmt.allocate(dim, (kvh, t)).items()}
    te.encode_into(x.to(DEV), spec.kind, [bufs[f] for f in spec.fields], 3, turbo)
    got = {f: bufs[f][:, 3:3 + n].cpu() for f in spec.fields}
    if DEV == "cpu":
        assert all(torch.equal(got[f], ref[f]) for f in spec.fields)
    dec, dref = fmt.decode_rotated(got), fmt.decode_rotated(ref)
    assert (dec - dref).abs().gt(1e-3).float().mean() < 0.01  # (an index off by one moves one coordinate)
    torch.testing.assert_close(got["norm"].float(), ref["norm"].float(), rtol=2e-3, atol=0)
    assert not bufs["norm"][:, :3].cpu().any() and not bufs["norm"][:, 3 + n:].cpu().any()


@pytest.mark.parametrize("name", ["q8_0", "q4_0", "tbq4_0", "turbo3"])
def test_paged_pool_stores_at_its_slots(monkeypatch, name):
    """A paged pool on the GPU's path encodes each token straight into its slot (scattered, out of order) with the
    Triton encoder: the bytes the torch encoder writes there (turbo3: up to indices at a codebook boundary), and
    nothing elsewhere."""
    from turbospec import device
    from turbospec.kv.paged import BlockPool

    g = torch.Generator().manual_seed(5)
    k, v = torch.randn(2, 3, 64, generator=g), torch.randn(2, 3, 64, generator=g)
    slots = torch.tensor([70, 3, 41])
    calls = []
    real = te.encode_into
    monkeypatch.setattr(te, "encode_into", lambda *a: calls.append(a[-1]) or real(*a))
    pools = []
    for triton in (False, True):
        monkeypatch.setattr(gpu, "ON_CPU", triton and DEV == "cpu")
        monkeypatch.setattr(device, "cpu_kernels", lambda triton=triton: not triton)  # as on a GPU
        dev = DEV if triton else "cpu"
        with torch.device(dev):
            pool = BlockPool(2, 2, 64, 3, k_type=name, v_type=name, block=32)
        assert (pool._gpu_encode[0] is not None) == triton
        pool.store(1, k.to(dev), v.to(dev), slots.to(dev))
        pools.append(pool)
    assert len(calls) == 2 and all(torch.equal(c.cpu(), slots) for c in calls)  # K and V, through Triton
    for side in ("k", "v"):
        for f, ref in getattr(pools[0], side).items():
            got = getattr(pools[1], side)[f].cpu()
            assert not got[0].any() and not got[1][:, [i for i in range(96) if i not in (70, 3, 41)]].any()
            if name == "turbo3":
                assert (got == ref).float().mean() > 0.97, f
            else:
                assert torch.equal(got, ref), f
