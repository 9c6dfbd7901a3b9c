"""Tests for the KV-cache format codecs (turbospec.kv.formats and helpers)."""

from __future__ import annotations

import math
import os
import time

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from turbospec.kv.bitpack import pack_bits, unpack_bits
from turbospec.kv.formats import (
    FORMATS,
    NORM_MODES,
    KVFormat,
    Packed,
    Q4_0Format,
    Q8_0Format,
    TBQ4Format,
    TurboFormat,
    TurboProdFormat,
    get_format,
    qjl_matrix,
    qjl_scale,
    rotate,
    round_half_away,
    unrotate,
)
from turbospec.kv.formats.turbo import _codebook
from turbospec.kv.hadamard import hadamard_matrix, rot_block_for, rotation_matrix, rotation_signs
from turbospec.kv.lloyd_max import GAUSSIAN_LLOYD_MAX, beta_coordinate_pdf, codebook_mse, lloyd_max_codebook

# Deterministic by default (no flaky CI, no .hypothesis database); TURBOSPEC_HYPOTHESIS_EXAMPLES=500
# runs a longer randomized search.
_H_EXAMPLES = int(os.environ.get("TURBOSPEC_HYPOTHESIS_EXAMPLES", "0"))
HSET = settings(max_examples=_H_EXAMPLES or 25, derandomize=not _H_EXAMPLES, database=None, deadline=None,
                suppress_health_check=[HealthCheck.too_slow])

BPV_TABLE = {
    "f32": 32.0, "f16": 16.0, "bf16": 16.0, "q8_0": 8.5, "q4_0": 4.5, "tbq4_0": 4.25, "tbq4_0d": 4.25,
    "turbo4": 4.125, "turbo3": 3.125, "turbo2": 2.125, "turbo4p": 4.25, "turbo3p": 3.25, "turbo2p": 2.25,
}
# turbo* at head sizes that are a multiple of 64 but not of 128 use 64-value rotation blocks (one norm,
# and for turbo*p one gamma, per 64 values instead of per 128)
BPV_TABLE_64 = {"turbo4": 4.25, "turbo3": 3.25, "turbo2": 2.25, "turbo4p": 4.5, "turbo3p": 3.5, "turbo2p": 2.5}
HEAD_SIZES = (64, 80, 96, 128, 192, 256)
GGUF_TYPES = {"q8_0": GGMLQuantizationType.Q8_0, "q4_0": GGMLQuantizationType.Q4_0}
PAPER_MSE = {1: 0.363, 2: 0.118, 3: 0.0345, 4: 0.0095}


@pytest.fixture(autouse=True, scope="module")
def _single_thread():
    """One intra-op thread: on small shared CPUs, OpenMP barriers make 2 threads slower than 1 here."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(*shape, seed=0, scale=1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=_gen(seed)) * scale


def _unit(n, d=128, seed=0) -> torch.Tensor:
    x = _randn(n, d, seed=seed)
    return x / torch.linalg.vector_norm(x, dim=-1, keepdim=True)


# ------------------------------------------------------------------------------------------------------
# registry, sizes, storage spec


def test_registry_names_and_types():
    assert set(FORMATS) == set(BPV_TABLE)
    for name, fmt in FORMATS.items():
        assert isinstance(fmt, KVFormat)
        assert fmt.name == name
        assert get_format(name) is fmt
        assert fmt.rotated == name.startswith("turbo")


@pytest.mark.parametrize("bad", ["q4_1", "", "TURBO3", "turbo3_0", None])
def test_unknown_format_error(bad):
    with pytest.raises(ValueError) as err:
        get_format(bad)
    msg = str(err.value)
    assert "\n" not in msg
    assert "unknown KV format" in msg
    for name in FORMATS:
        assert name in msg


@pytest.mark.parametrize("name", sorted(BPV_TABLE))
@pytest.mark.parametrize("dim", HEAD_SIZES)
def test_bits_and_bytes_table(name, dim):
    fmt = get_format(name)
    assert fmt.bits_per_value == BPV_TABLE[name]
    assert isinstance(fmt.bits_per_value, float)
    small = name in BPV_TABLE_64 and dim in (64, 192)
    block = 64 if small else fmt.block_size
    assert fmt.for_dim(dim).block_size == block
    assert fmt.for_dim(dim).bits_per_value == (BPV_TABLE_64[name] if small else BPV_TABLE[name])
    padded = -(-dim // block) * block
    expected = padded * fmt.for_dim(dim).bits_per_value / 8
    assert expected == int(expected)
    assert fmt.bytes_per_vector(dim) == int(expected)
    spec = fmt.storage_spec(dim)
    assert sum(math.prod(s) * dt.itemsize for s, dt in spec.values()) == fmt.bytes_per_vector(dim)
    # encode output matches the spec, with arbitrary leading dims
    x = _randn(2, 3, dim, seed=dim)
    p = fmt.encode(x)
    assert isinstance(p, Packed) and p.dim == dim
    assert set(p) == set(spec)
    for field, (shape, dtype) in spec.items():
        assert p[field].shape == (2, 3, *shape), field
        assert p[field].dtype == dtype, field
    y = fmt.decode(p)
    assert y.shape == x.shape and y.dtype == torch.float32


def test_concrete_block_sizes():
    assert get_format("q8_0").block_size == 32
    assert get_format("q4_0").block_size == 32
    assert get_format("tbq4_0").block_size == 64
    for name in ("turbo2", "turbo3", "turbo4", "turbo3p"):
        assert get_format(name).block_size == 128
    assert get_format("turbo4").bytes_per_vector(128) == 66  # fp16 norm + 64 B of nibbles
    assert get_format("turbo3").bytes_per_vector(128) == 50  # norm + 32 B low bits + 16 B high bits


@pytest.mark.parametrize("dim", [0, -3])
def test_bad_head_size(dim):
    with pytest.raises(ValueError):
        get_format("q8_0").storage_spec(dim)


@pytest.mark.parametrize("name", sorted(BPV_TABLE))
def test_shapes_leading_dims_and_dtypes(name):
    fmt = get_format(name)
    # no leading dims, empty batch, and non-float32 inputs
    v = _randn(96, seed=1)
    p = fmt.encode(v)
    assert fmt.decode(p).shape == (96,)
    empty = fmt.encode(torch.zeros(0, 4, 96))
    assert fmt.decode(empty).shape == (0, 4, 96)
    ref = fmt.decode(fmt.encode(v))
    for dt in (torch.float64, torch.float16, torch.bfloat16):
        out = fmt.decode(fmt.encode(v.to(dt).to(torch.float32)))
        assert torch.equal(fmt.decode(fmt.encode(v.to(dt))), out)
    assert torch.isfinite(ref).all()


@pytest.mark.parametrize("name", ["f16", "q8_0", "q4_0", "tbq4_0d", "turbo3", "turbo3p"])
def test_preallocated_buffers_like_a_cache(name):
    fmt = get_format(name)
    dim, heads, max_tokens = 80, 2, 7
    buf = fmt.allocate(dim, (heads, max_tokens))
    assert fmt.decode(buf).abs().max() == 0  # zero buffers decode to zeros
    x = _randn(heads, 5, dim, seed=3)
    for t in range(5):  # write one token at a time
        p = fmt.encode(x[:, t])
        for field, tensor in p.items():
            buf[field][:, t] = tensor
    view = {k: v[:, :5] for k, v in buf.items()}  # a plain dict: pass dim explicitly
    got = fmt.decode(view, dim=dim)
    assert torch.equal(got, fmt.decode(fmt.encode(x)))
    assert fmt.decode(view).shape[-1] == fmt.padded_dim(dim)


def test_padding_is_zero_padding():
    x = _randn(6, 80, seed=4)
    xp = torch.nn.functional.pad(x, (0, 16))
    for name in ("q8_0", "q4_0", "tbq4_0"):
        fmt = get_format(name)
        p, pp = fmt.encode(x), fmt.encode(xp)
        for k in p:
            assert torch.equal(p[k], pp[k])
        assert torch.equal(fmt.decode(p), fmt.decode(pp)[:, :80])
    fmt = get_format("turbo4")
    p, pp = fmt.encode(x), fmt.encode(torch.nn.functional.pad(x, (0, 48)))
    for k in p:
        assert torch.equal(p[k], pp[k])
    with pytest.raises(ValueError):
        fmt.decode(p, dim=200)


# ------------------------------------------------------------------------------------------------------
# ggml q8_0 / q4_0 bit-exactness


def _assert_gguf_exact(name: str, x: np.ndarray):
    fmt = get_format(name)
    qtype = GGUF_TYPES[name]
    x = np.ascontiguousarray(x, dtype=np.float32)
    ref = gguf_quantize(x, qtype)
    p = fmt.encode(torch.from_numpy(x))
    raw = fmt.to_ggml_bytes(p).numpy()
    assert raw.shape == ref.shape
    mismatch = np.argwhere(raw != ref)
    assert mismatch.size == 0, f"{name}: first mismatching byte at {mismatch[:3].tolist()}"
    deq = gguf_dequantize(ref, qtype)
    ours = fmt.decode(p).numpy()
    assert np.array_equal(ours, deq)
    back = fmt.decode(fmt.from_ggml_bytes(torch.from_numpy(ref)))
    assert np.array_equal(back.numpy(), deq)


def _edge_case_rows() -> np.ndarray:
    rows = []
    rows.append(np.zeros(32))  # all-zero block
    e = np.zeros(32)
    e[5] = 1.0
    rows.append(e)  # single positive value
    rows.append(-e)  # single negative value
    t = np.linspace(-1, 1, 32)
    t[0], t[31] = -2.0, 2.0  # tie in magnitude: first index wins
    rows.append(t)
    rows.append(-t)
    rows.append(np.full(32, 3.0))
    rows.append(np.full(32, -3.0))
    # exact .5 ties of x/d for q8_0 (d = 127/127 = 1)
    h = np.arange(32) - 15.5
    h[0] = 127.0
    rows.append(h)
    rows.append(-h)
    # values landing on x/d + 8.5 == integer boundaries for q4_0 (d = -1)
    g = np.arange(32) % 17 - 8.0 + 0.5
    g[3] = 8.0
    rows.append(g)
    rows.append(np.arange(32) * 1e-6)  # fp16 d underflows to a subnormal / zero
    rows.append(np.arange(32) * 1e-9)
    rows.append(np.arange(32) * 1e-30)  # tiny but with a normal float32 d
    rows.append((np.arange(32) - 16) * 3e4)  # large
    rows.append(np.array([65504.0 * 8] + [1.0] * 31))  # largest q4_0 d that fits fp16
    rows.append(np.nextafter(np.float32(0.5), np.float32(0)) * np.sign(np.arange(32) - 15.5))
    return np.stack(rows).astype(np.float32)


@pytest.mark.parametrize("name", ["q8_0", "q4_0"])
def test_gguf_bit_exact_edge_cases(name):
    rows = _edge_case_rows()
    if name == "q8_0":
        rows = rows[np.abs(rows).max(axis=1) < 65504 * 127]
    _assert_gguf_exact(name, rows)
    # several blocks per row, and a 3-d tensor
    _assert_gguf_exact(name, rows[: len(rows) // 4 * 4].reshape(-1, 128))
    _assert_gguf_exact(name, rows[:12].reshape(3, 2, 64))


@pytest.mark.parametrize("name", ["q8_0", "q4_0"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gguf_bit_exact_random(name, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((300, 128)) * np.exp(rng.uniform(-8, 8, (300, 1)))
    x[::7, :32] = 0
    x[1::5] = np.round(x[1::5] * 4) / 4  # many exact ties
    x[2::9] = rng.standard_t(2, (x[2::9].shape)).clip(-1e4, 1e4)  # heavy tails / outliers
    _assert_gguf_exact(name, x)


@st.composite
def _ggml_arrays(draw):
    n_rows = draw(st.integers(1, 4))
    n_blocks = draw(st.integers(1, 3))
    vals = draw(st.lists(st.floats(-1, 1, width=32, allow_subnormal=False),
                         min_size=n_rows * n_blocks * 32, max_size=n_rows * n_blocks * 32))
    exps = draw(st.lists(st.integers(-30, 4), min_size=n_rows * n_blocks, max_size=n_rows * n_blocks))
    x = np.array(vals, dtype=np.float64).reshape(n_rows * n_blocks, 32)
    x = x * (10.0 ** np.array(exps, dtype=np.float64))[:, None]
    return x.astype(np.float32).reshape(n_rows, n_blocks * 32)


@HSET
@given(_ggml_arrays())
def test_gguf_bit_exact_hypothesis(x):
    _assert_gguf_exact("q8_0", x)
    _assert_gguf_exact("q4_0", x)


def test_q4_0_nibble_order():
    # block max -8 gives d = 1: codes q = x + 8; low nibbles = first 16 values, high = last 16
    x = torch.cat([torch.full((16,), -8.0), torch.arange(16, dtype=torch.float32) - 8]).view(1, 32)
    p = get_format("q4_0").encode(x)
    assert p["d"].item() == 1.0
    expected = torch.arange(16, dtype=torch.uint8) << 4  # low nibble 0 (= -8 + 8), high nibble i
    assert torch.equal(p["qs"][0, 0], expected)


def test_round_half_away():
    v = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 0.49999997, -0.49999997, 0.0, 3.7, -3.7])
    assert round_half_away(v).tolist() == [1, 2, 3, -1, -2, -3, 0, 0, 0, 4, -4]


# ------------------------------------------------------------------------------------------------------
# round-trip error bounds


def _half_err(d: torch.Tensor) -> torch.Tensor:
    """Upper bound on |d - fp16(d)|: half an ulp, or half the subnormal spacing."""
    return torch.maximum(d.abs() * 2.0**-11, torch.full_like(d, 2.0**-25))


@st.composite
def _kv_tensors(draw):
    rows = draw(st.integers(1, 3))
    dim = draw(st.sampled_from([32, 64, 80, 96, 128, 136]))
    scale = 10.0 ** draw(st.integers(-3, 3))
    seed = draw(st.integers(0, 2**31 - 1))
    heavy = draw(st.booleans())
    g = _gen(seed)
    x = torch.randn(rows, dim, generator=g) * scale
    if heavy:  # a few large outliers
        x = x * (1 + 30 * (torch.rand(rows, dim, generator=g) < 0.03))
    return x


@HSET
@given(_kv_tensors())
def test_plain_formats_roundtrip(x):
    assert torch.equal(get_format("f32").decode(get_format("f32").encode(x)), x)
    for name, dt in (("f16", torch.float16), ("bf16", torch.bfloat16)):
        fmt = get_format(name)
        if not torch.isfinite(x.to(dt)).all():  # beyond the float16 range
            with pytest.raises(ValueError, match="too large"):
                fmt.encode(x)
            continue
        assert torch.equal(fmt.decode(fmt.encode(x)), x.to(dt).float())


@HSET
@given(_kv_tensors())
def test_block_formats_elementwise_error_bounds(x):
    dim = x.shape[-1]
    for name in ("q8_0", "q4_0", "tbq4_0", "tbq4_0d"):
        fmt = get_format(name)
        bs = fmt.block_size
        xp = torch.nn.functional.pad(x, (0, fmt.padded_dim(dim) - dim)).view(x.shape[0], -1, bs)
        amax = xp.abs().amax(-1)
        if name == "q8_0":
            d = amax / 127
            bound = d / 2 + 127 * _half_err(d)
        elif name == "q4_0":
            d = amax / 8
            bound = d + 16 * _half_err(d)  # the clamp at code 15 costs up to one step
        else:
            d = amax / 7
            step = d + _half_err(d)
            bound = (step if name == "tbq4_0d" else step / 2) + 8 * _half_err(d)
        err = (fmt.decode(fmt.encode(x)) - x).abs()
        err = torch.nn.functional.pad(err, (0, fmt.padded_dim(dim) - dim)).view_as(xp)
        assert (err <= bound.unsqueeze(-1) * (1 + 1e-5)).all(), name


REL_MSE_BOUND = {  # mean over Gaussian vectors of ||x - x~||^2 / ||x||^2 (measured values in the docs)
    "q8_0": 4e-5, "q4_0": 0.009, "tbq4_0": 0.013, "tbq4_0d": 0.026,
    "turbo4": 0.0097, "turbo3": 0.035, "turbo2": 0.118,
    "turbo4p": 0.020, "turbo3p": 0.067, "turbo2p": 0.21,
}


@pytest.mark.parametrize("name", sorted(REL_MSE_BOUND))
def test_relative_mse_gaussian(name):
    fmt = get_format(name)
    x = _randn(4000, 128, seed=11)
    y = fmt.decode(fmt.encode(x))
    rel = (((y - x) ** 2).sum(-1) / (x**2).sum(-1)).mean().item()
    assert rel < REL_MSE_BOUND[name]
    assert rel > REL_MSE_BOUND[name] * 0.6  # and the bound is not vacuous


@HSET
@given(_kv_tensors())
def test_turbo_worst_case_relative_error(x):
    # any vector, not only Gaussian ones: the rotated unit vector has |coordinates| <= 1, so the
    # per-vector error is bounded by the codebook's cell widths; loose bounds per bit width
    x = x / max(1.0, x.norm(dim=-1).max().item() / 1e4)  # keep the fp16 norm in range
    for name, bound in (("turbo4", 0.06), ("turbo3", 0.15), ("turbo2", 0.45)):
        fmt = get_format(name)
        y = fmt.decode(fmt.encode(x))
        rel = ((y - x) ** 2).sum(-1) / (x**2).sum(-1)
        assert (rel < bound).all(), (name, rel.max().item())


def test_turbo_scale_equivariance_and_determinism():
    fmt = get_format("turbo3")
    x = _randn(50, 128, seed=5)
    p1, p2 = fmt.encode(x), fmt.encode(x * 4.0)  # power of two: exact
    assert torch.equal(p1["qs"], p2["qs"]) and torch.equal(p1["qh"], p2["qh"])
    assert torch.equal(p1["norm"] * 4, p2["norm"])
    assert all(torch.equal(p1[k], fmt.encode(x)[k]) for k in p1)


def test_norm_modes():
    x = _randn(2000, 128, seed=8)
    errs = {}
    for mode in NORM_MODES:
        fmt = TurboFormat(3, norm_mode=mode)
        y = fmt.decode(fmt.encode(x))
        errs[mode] = ((y - x) ** 2).sum(-1).mean().item()
        if mode == "corrected":  # the decoded block keeps the norm of x (up to fp16)
            torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1), rtol=2e-3, atol=0)
    assert errs["lsq"] <= min(errs.values())  # least-squares scale: lowest MSE (the default)
    assert get_format("turbo3").norm_mode == "lsq"
    with pytest.raises(ValueError):
        TurboFormat(3, norm_mode="bogus")


# ------------------------------------------------------------------------------------------------------
# tbq4_0 specifics


def test_tbq4_codes_and_dither():
    x = _randn(500, 128, seed=6)
    plain, dith = get_format("tbq4_0"), get_format("tbq4_0d")
    codes = unpack_bits(plain.encode(x)["qs"], 4)
    assert codes.min() >= 1 and codes.max() <= 15  # |x/S| <= 7: code -8 (nibble 0) unused
    dcodes = unpack_bits(dith.encode(x)["qs"], 4)
    assert dcodes.min() >= 0 and dcodes.max() <= 15
    # dither is a deterministic, batch-independent function of each vector
    assert torch.equal(dith.encode(x)["qs"], dith.encode(x)["qs"])
    assert torch.equal(dith.encode(x[7:8])["qs"], dith.encode(x)["qs"][7:8])
    # stochastic rounding: about twice the MSE of round-to-nearest (S^2/6 vs S^2/12)
    e0 = ((plain.decode(plain.encode(x)) - x) ** 2).mean()
    e1 = ((dith.decode(dith.encode(x)) - x) ** 2).mean()
    assert 1.6 < (e1 / e0).item() < 2.4
    other_seed = TBQ4Format(dither=True, seed=123)
    assert not torch.equal(other_seed.encode(x)["qs"], dith.encode(x)["qs"])


def test_tbq4_dither_is_unbiased():
    # blocks with S = 1 (absmax 7) whose other values sit at k + 0.3: round-to-nearest always errs by -0.3,
    # the dithered rounding errs by 0 on average
    n = 4000
    g = _gen(9)
    k = torch.randint(-6, 6, (n, 63), generator=g).float()
    x = k + 0.3 + torch.rand(n, 63, generator=g) * 1e-3
    x = torch.cat([torch.full((n, 1), 7.0), x], dim=1)
    for name, expect in (("tbq4_0", -0.3), ("tbq4_0d", 0.0)):
        fmt = get_format(name)
        err = (fmt.decode(fmt.encode(x)) - x)[:, 1:]
        se = err.std() / math.sqrt(err.numel())
        assert abs(err.mean().item() - expect) < max(4 * se.item(), 2e-3), name


# ------------------------------------------------------------------------------------------------------
# rotation


def test_hadamard_matrix():
    h = hadamard_matrix(128)
    assert torch.equal(h @ h.T, 128 * torch.eye(128, dtype=torch.float64))
    assert torch.equal(hadamard_matrix(2), torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64))
    with pytest.raises(ValueError):
        hadamard_matrix(96)


def test_rotation_is_fixed_and_orthonormal():
    s1, s2 = rotation_signs()
    assert set(s1.tolist()) == {-1.0, 1.0} and set(s2.tolist()) == {-1.0, 1.0}
    assert torch.equal(s1, rotation_signs()[0])
    r = rotation_matrix(dtype=torch.float64)
    torch.testing.assert_close(r @ r.T, torch.eye(128, dtype=torch.float64), atol=1e-12, rtol=0)
    # y = D2 H D1 x / sqrt(n), per 128-value block (64-value blocks for a 64-value vector)
    for n in (128, 64):
        s1, s2 = rotation_signs(n)
        x = _randn(3, n, seed=2).double()
        ref = (s2 * ((s1 * x) @ hadamard_matrix(n).T)) / math.sqrt(n)
        torch.testing.assert_close(rotate(x), ref, atol=1e-12, rtol=0)


@pytest.mark.parametrize("dim", HEAD_SIZES)
def test_rotate_unrotate(dim):
    x = _randn(4, 5, dim, seed=dim)
    y = rotate(x)
    block = 64 if dim in (64, 192) else 128  # 64-value blocks where 64 divides the head size and 128 does not
    assert rot_block_for(dim) == block
    assert y.shape == (4, 5, -(-dim // block) * block) and y.dtype == torch.float32
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(unrotate(y, dim), x, rtol=1e-5, atol=1e-5)
    q = _randn(4, 5, dim, seed=dim + 1)
    torch.testing.assert_close((rotate(q) * y).sum(-1), (q * x).sum(-1), rtol=1e-4, atol=1e-4)
    assert rotate(x.half()).dtype == torch.float16
    with pytest.raises(ValueError):
        unrotate(torch.zeros(3, 100))


@pytest.mark.parametrize("name", ["turbo4", "turbo3", "turbo2", "turbo4p", "turbo3p", "turbo2p"])
@pytest.mark.parametrize("dim", [64, 80, 128, 192, 256])
def test_rotated_domain_inner_products(name, dim):
    fmt = get_format(name)
    k = _randn(64, dim, seed=20)
    q = _randn(64, dim, seed=21)
    p = fmt.encode(k)
    kr = fmt.decode_rotated(p)
    assert kr.shape == (64, fmt.padded_dim(dim))
    lhs = (rotate(q) * kr).sum(-1)
    rhs = (q * fmt.decode(p)).sum(-1)
    torch.testing.assert_close(lhs, rhs, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(unrotate(kr, dim), fmt.decode(p), rtol=0, atol=1e-5)


def test_decode_rotated_only_for_rotated_formats():
    fmt = get_format("q8_0")
    with pytest.raises(TypeError):
        fmt.decode_rotated(fmt.encode(torch.ones(2, 32)))


# ------------------------------------------------------------------------------------------------------
# Lloyd-Max codebooks and the TurboQuant paper's distortion numbers


def test_beta_pdf_normalized():
    x = np.linspace(-1, 1, 200_001)
    for d in (16, 128):
        assert abs(np.trapezoid(beta_coordinate_pdf(x, d), x) - 1) < 1e-6
        var = np.trapezoid(x * x * beta_coordinate_pdf(x, d), x)
        assert abs(var - 1 / d) < 1e-6


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_lloyd_max_fixed_point(bits):
    c, b = lloyd_max_codebook(bits, 128)
    n = 1 << bits
    assert c.shape == (n,) and b.shape == (n - 1,)
    assert np.all(np.diff(c) > 0)
    np.testing.assert_allclose(c, -c[::-1], atol=1e-15)
    np.testing.assert_allclose(b, 0.5 * (c[1:] + c[:-1]), atol=1e-15)
    # centroid condition, checked with an independent integration (Simpson-like fine grid per cell)
    edges = np.concatenate([[-1.0], b, [1.0]])
    for i in range(n):
        t = np.linspace(edges[i], edges[i + 1], 100_001)
        f = beta_coordinate_pdf(t, 128)
        mean = np.trapezoid(t * f, t) / np.trapezoid(f, t)
        assert abs(mean - c[i]) < 1e-7 * 8
    # close to the Gaussian Lloyd-Max levels scaled by 1/sqrt(d) (the Beta law is nearly N(0, 1/d))
    gauss = np.array(GAUSSIAN_LLOYD_MAX[bits]) / math.sqrt(128)
    np.testing.assert_allclose(c[n // 2:], gauss, rtol=0.02)


def test_codebooks_match_llama_cpp_ports():
    c3, _ = lloyd_max_codebook(3)
    np.testing.assert_allclose(c3[4:], [0.021460, 0.065717, 0.117832, 0.190685], rtol=0.015)
    c2, _ = lloyd_max_codebook(2)
    np.testing.assert_allclose(c2[2:], [0.039994, 0.133462], rtol=0.005)
    c4, _ = lloyd_max_codebook(4)
    assert abs(c4[-1] - 0.2402) < 0.004  # the corrected outer 4-bit level (PR #197), not 0.1739


@pytest.mark.parametrize("d", [128, 64])
@pytest.mark.parametrize("bits", [3, 4])
def test_three_and_four_bit_codebooks_lie_on_an_int8_grid(bits, d):
    """turbo3/turbo4's centroids are integer codes times one unit (their keys are scored with int8 products), the
    boundaries their midpoints, and the move costs almost no distortion; 1 and 2 bits keep the Lloyd-Max codebook."""
    cent, bounds = (t.double().numpy() for t in _codebook(bits, torch.device("cpu"), d))
    unit = np.float32(np.abs(cent).max()) / np.float32(127)
    codes = np.rint(cent / unit)
    assert codes.max() == 127 and codes.min() == -127
    np.testing.assert_allclose(cent, codes * unit, rtol=1e-6)
    np.testing.assert_allclose(bounds, 0.5 * (cent[1:] + cent[:-1]), rtol=1e-6)
    lm = lloyd_max_codebook(bits, d)[0]
    assert 0 < np.abs(cent - lm).max() <= 0.51 * unit
    # measured: 4 bits +0.10% (d = 128), +0.20% (d = 64); 3 bits +0.05%, +0.04%
    assert codebook_mse(cent, d) / codebook_mse(lm, d) - 1 < 5e-3
    for other in (1, 2):
        np.testing.assert_allclose(_codebook(other, torch.device("cpu"), d)[0].double().numpy(),
                                   lloyd_max_codebook(other, d)[0], rtol=1e-6)


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_paper_distortion(bits):
    # TurboQuant_mse on random unit vectors, d = 128, no norm correction
    u = _unit(4000, seed=30 + bits)
    fmt = TurboFormat(bits, norm_mode="plain")
    mse = ((fmt.decode(fmt.encode(u)) - u) ** 2).sum(-1).mean().item()
    assert abs(mse / PAPER_MSE[bits] - 1) < 0.05, mse
    analytic = codebook_mse(lloyd_max_codebook(bits)[0], 128)
    assert abs(mse / analytic - 1) < 0.02
    assert abs(analytic / PAPER_MSE[bits] - 1) < 0.05
    assert mse < math.sqrt(3) * math.pi / 2 * 4.0**-bits  # the paper's upper bound
    assert mse > 4.0**-bits  # and its lower bound


def test_generic_turbo_bits():
    for bits in (1, 2, 3, 4):
        fmt = TurboFormat(bits)
        assert fmt.bytes_per_vector(128) == 2 + 16 * bits
        idx_fields = {k for k in fmt.storage_spec(128) if k != "norm"}
        assert idx_fields == ({"qs", "qh"} if bits == 3 else {"qs"})
    with pytest.raises(ValueError):
        TurboFormat(5)


# ------------------------------------------------------------------------------------------------------
# TurboQuant_prod (QJL)


def test_qjl_matrix_and_scale():
    s = qjl_matrix().double()
    torch.testing.assert_close(s @ s.T, 128 * torch.eye(128, dtype=torch.float64), atol=1e-3, rtol=0)
    assert abs(qjl_scale("orthogonal") / qjl_scale("gaussian") - 1) < 0.003
    assert qjl_scale("gaussian") == math.sqrt(math.pi / 2) / 128
    assert qjl_matrix(kind="gaussian").std().item() == pytest.approx(1.0, abs=0.02)


def test_qjl_inner_products_unbiased():
    n = 100_000
    x = _unit(n, seed=40)
    z = _unit(n, seed=41)
    prod, mse = get_format("turbo3p"), get_format("turbo3")
    xp = prod.decode(prod.encode(x))
    xm = mse.decode(mse.encode(x))
    for y in (x, 0.6 * x + 0.8 * z):  # y correlated with x (with y = x the MSE code is biased by -D_mse)
        base = (y * x).sum(-1)
        e = (y * xp).sum(-1) - base
        se = e.std().item() / math.sqrt(n)
        assert abs(e.mean().item()) < 3 * se, (e.mean().item(), se)
        em = (y * xm).sum(-1) - base
        sem = em.std().item() / math.sqrt(n)
        assert em.mean().item() < -10 * sem  # the plain MSE quantizer shrinks inner products
    # independent query: both are unbiased by symmetry, the QJL estimate has the larger variance
    e_ind = (z * xp).sum(-1) - (z * x).sum(-1)
    assert abs(e_ind.mean().item()) < 3 * e_ind.std().item() / math.sqrt(n)


def test_qjl_variants_bits():
    x = _unit(3000, seed=42)
    prev = None
    for bits in (2, 3, 4, 5):
        fmt = TurboProdFormat(bits)
        assert fmt.bytes_per_vector(128) == 4 + 16 * bits
        mse = ((fmt.decode(fmt.encode(x)) - x) ** 2).sum(-1).mean().item()
        # better than the (bits-1)-bit MSE code alone, worse than the plain bits-bit MSE code:
        # QJL buys unbiased inner products, not distortion
        assert mse < PAPER_MSE[bits - 1]
        if bits <= 4:
            assert mse > PAPER_MSE[bits]
        assert prev is None or mse < prev
        prev = mse
    gauss = TurboProdFormat(3, qjl="gaussian")
    assert gauss.bytes_per_vector(128) == 52
    mse_g = ((gauss.decode(gauss.encode(x)) - x) ** 2).sum(-1).mean().item()
    assert 0.15 < mse_g < 0.22  # ~ (pi/2) * D_mse(2 bits): the paper's Gaussian S is noisier
    with pytest.raises(ValueError):
        TurboProdFormat(3, qjl="dense")


# ------------------------------------------------------------------------------------------------------
# non-finite input, overflow, zero blocks


@pytest.mark.parametrize("name", sorted(BPV_TABLE))
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_raises(name, bad):
    fmt = get_format(name)
    x = _randn(3, 96, seed=7)
    x[1, 50] = bad
    with pytest.raises(ValueError, match="non-finite values in KV"):
        fmt.encode(x)


def test_check_finite_can_be_disabled():
    x = _randn(2, 64, seed=7)
    x[0, 3] = float("nan")
    fmt = Q8_0Format(check_finite=False)
    p = fmt.encode(x)
    y = fmt.decode(p)
    assert torch.isfinite(y[1]).all()  # the clean row is unaffected
    assert not Q4_0Format(check_finite=False).check_finite


@pytest.mark.parametrize("name, big", [("f16", 1e5), ("q8_0", 1e7 * 127), ("q4_0", 1e6), ("tbq4_0", 1e6),
                                       ("turbo3", 1e6), ("turbo3p", 1e6)])
def test_fp16_overflow_raises(name, big):
    x = torch.zeros(1, 128)
    x[0, 0] = big
    with pytest.raises(ValueError, match="too large"):
        get_format(name).encode(x)


@pytest.mark.parametrize("name", sorted(BPV_TABLE))
def test_zero_blocks_decode_to_zero(name):
    fmt = get_format(name)
    x = _randn(4, 256, seed=12)
    x[0] = 0.0  # all-zero vector
    x[1, 128:] = 0.0  # zero second half (one 128-block, two 64-blocks, four 32-blocks)
    x[2, :] = -0.0
    y = fmt.decode(fmt.encode(x))
    assert torch.isfinite(y).all()
    assert torch.equal(y[0], torch.zeros(256))
    assert torch.equal(y[1, 128:], torch.zeros(128))
    assert (y[2] == 0).all()


# ------------------------------------------------------------------------------------------------------
# bit packing and speed


@HSET
@given(st.sampled_from([1, 2, 4, 8]), st.integers(0, 2**31 - 1), st.integers(1, 3))
def test_pack_unpack_roundtrip(bits, seed, rows):
    codes = torch.randint(0, 1 << bits, (rows, 128), generator=_gen(seed), dtype=torch.uint8)
    packed = pack_bits(codes, bits)
    assert packed.shape == (rows, 128 * bits // 8) and packed.dtype == torch.uint8
    assert torch.equal(unpack_bits(packed, bits), codes)


def test_pack_rejects_bad_sizes():
    with pytest.raises(ValueError):
        pack_bits(torch.zeros(3, dtype=torch.uint8), 4)
    with pytest.raises(ValueError):
        pack_bits(torch.zeros(8, dtype=torch.uint8), 3)


@pytest.mark.parametrize("name", ["q4_0", "tbq4_0d", "turbo4", "turbo3p"])
def test_vectorized_speed(name):
    # [32768, 128] should take well under a second each way (a Python loop over blocks would take
    # minutes); the bound is loose because the test machines are shared
    fmt = get_format(name)
    x = _randn(32768, 128, seed=13)
    fmt.decode(fmt.encode(x[:64]))  # warm-up (codebooks, matrices)
    t0 = time.perf_counter()
    p = fmt.encode(x)
    t1 = time.perf_counter()
    fmt.decode(p)
    t2 = time.perf_counter()
    assert t1 - t0 < 3.0 and t2 - t1 < 3.0, (t1 - t0, t2 - t1)
