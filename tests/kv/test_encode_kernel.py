"""The C++ KV encoder (turbospec/kernels/encode.cpp) against the reference encoders in turbospec/kv/formats/."""

import pytest
import torch

from turbospec.kernels import encode as encoder
from turbospec.kv.formats import get_format
from turbospec.kv.kernel_args import encode_spec
from turbospec.kv.quant_cache import QuantKVCache

pytestmark = pytest.mark.skipif(encoder.load() is None, reason="encode kernel not available on this machine")

EXACT = ["f32", "f16", "bf16", "q8_0", "q4_0", "tbq4_0"]
TURBO = ["turbo2", "turbo3", "turbo4"]


def _rows(kvh, n, d, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(kvh, n, d, generator=g) * torch.exp(torch.randn(kvh, n, 1, generator=g) * 2)
    x[0, 0] = 0.0  # an all-zero vector
    x[-1, -1, : d // 2] = 0.0  # a zero block (for most formats)
    return x


def _encode_both(name, d, x, start=3):
    fmt = get_format(name)
    spec = encode_spec(fmt, d)
    assert spec is not None
    kvh, n = x.shape[:2]
    ref = fmt.encode(x)
    bufs = fmt.allocate(d, (kvh, start + n + 2))
    assert encoder.encode_into(x, spec, [bufs[f] for f in spec.fields], start)
    got = {f: bufs[f][:, start:start + n] for f in spec.fields}
    for f in spec.fields:  # untouched outside [start, start + n)
        assert not bufs[f][:, :start].any() and not bufs[f][:, start + n:].any()
    return fmt, ref, got


@pytest.mark.parametrize("name", EXACT)
@pytest.mark.parametrize("d", [40, 64, 80, 128, 192])
def test_bit_identical_to_reference(name, d):
    x = _rows(2, 5, d, seed=d)
    _, ref, got = _encode_both(name, d, x)
    assert set(ref) == set(got)
    for f in ref:
        assert torch.equal(ref[f], got[f]), f


@pytest.mark.parametrize("name", TURBO)
@pytest.mark.parametrize("d", [64, 80, 128, 192, 256])
def test_turbo_matches_reference_up_to_boundary_ties(name, d):
    x = _rows(3, 40, d, seed=d + 1)
    fmt, ref, got = _encode_both(name, d, x)
    # the FWHT and the reference's matmul round differently: a coordinate within an ulp of a boundary may
    # take the neighbouring code, and the fp16 scale may differ in its last bit
    nr = ref["norm"].float()
    ng = got["norm"].float()
    assert torch.allclose(nr, ng, rtol=2e-3, atol=0)
    same = torch.cat([(ref[f] == got[f]).flatten() for f in ref if f != "norm"]).float().mean()
    assert same > 0.995
    dr, dg = fmt.decode(ref, d), fmt.decode(got, d)
    assert torch.allclose(dr, dg, rtol=0, atol=2e-2 * float(x.abs().max()))


@pytest.mark.parametrize("name", EXACT + TURBO)
def test_non_finite_input_writes_nothing(name):
    fmt = get_format(name)
    spec = encode_spec(fmt, 64)
    x = torch.randn(2, 3, 64)
    x[1, 2, 5] = float("nan")
    bufs = fmt.allocate(64, (2, 4))
    assert not encoder.encode_into(x, spec, [bufs[f] for f in spec.fields], 0)
    assert not any(t.any() for t in bufs.values())


def test_unsupported_formats_use_the_reference():
    for name in ("tbq4_0d", "turbo4p", "turbo3p"):
        assert encode_spec(get_format(name), 64) is None


@pytest.mark.parametrize("kv", [("q8_0", "turbo3"), ("tbq4_0", "f16")])
def test_cache_store_nan_raises_the_reference_error(kv):
    cache = QuantKVCache(1, 2, 64, 8, *kv)
    k = torch.randn(2, 1, 64)
    v = torch.randn(2, 1, 64)
    k[0, 0, 0] = float("inf")
    with pytest.raises(ValueError, match="non-finite"):
        cache.store(0, k, v)
