import pytest
import torch
import torch.nn.functional as F

from turbospec.kernels.gemv import load_kernel

kernel = load_kernel()
pytestmark = pytest.mark.skipif(kernel is None, reason="AVX2 kernel not available on this machine")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 2, 3, 8, 17])
@pytest.mark.parametrize("shape", [(64, 64), (37, 67), (5, 8), (130, 3)])
def test_skinny_linear_matches_float_reference(dtype, m, shape):
    g = torch.Generator().manual_seed(m)
    out, inp = shape
    w = torch.randn(out, inp, generator=g).to(dtype)
    x = torch.randn(m, inp, generator=g).to(dtype)
    b = torch.randn(out, generator=g).to(dtype)
    ref = F.linear(x.float(), w.float(), b.float())
    for bias in (b, None):
        got = kernel.skinny_linear(x, w, bias)
        assert got.dtype == dtype and got.shape == (m, out)
        want = ref if bias is not None else F.linear(x.float(), w.float())
        tol = 1e-5 * inp if dtype == torch.float32 else 2e-2 * want.abs().max().item()
        assert (got.float() - want).abs().max().item() <= tol


def test_leading_dims_preserved():
    w = torch.randn(16, 32)
    x = torch.randn(2, 3, 32)
    assert torch.allclose(kernel.skinny_linear(x, w, None), x @ w.T, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("zero_centred", [False, True])
@pytest.mark.parametrize("rows", [21, 700])  # 700 x 96 values: rows split over threads
def test_rms_norm_kernel_matches_reference(dtype, zero_centred, rows):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(rows // 7, 7, 96, generator=g) * 3).to(dtype)
    w = torch.randn(96, generator=g).to(dtype)
    xf = F.rms_norm(x.float(), (96,), None, 1e-6)
    ref = (xf * (1 + w.float())).to(dtype) if zero_centred else w * xf.to(dtype)
    got = kernel.rms_norm(x, w, 1e-6, zero_centred)
    assert got.dtype == dtype and got.shape == x.shape
    assert (got.float() - ref.float()).abs().max().item() <= (1e-5 if dtype == torch.float32 else 1e-2)


def test_hugepage_copy_keeps_values_and_file_backed_source(tmp_path):
    """Weights move into huge-page memory; a source in a read-only file mapping (a memory-mapped checkpoint) is
    dropped from this process's pages (MADV_DONTNEED) and stays readable (the file still holds it)."""
    import mmap
    import warnings

    k = load_kernel()
    if k is None:
        pytest.skip("C++ kernels unavailable")
    w = torch.randn(300, 200)
    for src in (w, w.to(torch.bfloat16)):
        out = k.hugepage_copy(src)
        assert out.data_ptr() != src.data_ptr() and torch.equal(out, src)
    path = tmp_path / "w.bin"
    path.write_bytes(w.numpy().tobytes())
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # non-writable buffer
        mapped = torch.frombuffer(mm, dtype=torch.float32).view(300, 200)
    out = k.hugepage_copy(mapped)
    assert torch.equal(out, w) and torch.equal(mapped, w)


def test_tied_embedding_is_one_matrix(hf_models):
    from turbospec.model import load_model

    m = load_model(hf_models["qwen2"], "float32")  # tied embeddings: lm_head moved, embedding follows it
    assert m.embed is m.lm_head.weight


def test_hugepage_zeros_for_cache_buffers():
    from turbospec.kv.cache import KVCache

    k = load_kernel()
    if k is None:
        pytest.skip("C++ kernels unavailable")
    for shape, dt in (((2, 3, 4096, 64), torch.float16), ((5, 7), torch.float32), ((1, 2, 3000, 18), torch.uint8)):
        t = k.hugepage_zeros(list(shape), dt)
        assert t.shape == shape and t.dtype == dt and not t.any()
        t.fill_(1)  # writable, and all of it
        assert bool((t == 1).all())
    c = KVCache(2, 2, 64, 8192, torch.float16)
    assert c.k.shape == (2, 2, 8192, 64) and not c.k.any() and c.nbytes == 2 * 2 * 2 * 8192 * 64 * 2


@pytest.mark.parametrize("v", [1, 7, 8, 9, 100, 32000])
def test_argmax_rows_follows_torch_rules(v):
    """Lowest index on ties, the first NaN when there is one, -inf rows -> 0; any row length."""
    g = torch.Generator().manual_seed(v)
    x = torch.randint(-3, 3, (6, v), generator=g).float()  # many ties
    x[1] = float("-inf")
    if v > 3:
        x[2, v // 2] = float("nan")
        x[2, v - 1] = float("nan")
        x[3, v - 1] = float("inf")
        x[4, 0] = float("inf")
        x[4, v - 2] = float("inf")
    assert kernel.argmax_rows(x).tolist() == x.argmax(-1).tolist()


def test_greedy_sample_uses_same_argmax():
    from turbospec.sampling import SamplingParams, sample

    x = torch.randn(5000, generator=torch.Generator().manual_seed(0))
    x[4000] = x[17] = x.max() + 1
    assert sample(x, SamplingParams(temperature=0)) == 17 == int(torch.argmax(x))


def test_argmax_rows_of_many_rows_equals_argmax_of_each():
    """The scheduler's one call for all plain-greedy rows (`sampling.argmax_rows`) picks what `argmax` picks per row,
    float32 through the kernel and bfloat16 through torch."""
    from turbospec.sampling import Sampler, SamplingParams, argmax, argmax_rows

    x = torch.randint(-4, 4, (9, 3000), generator=torch.Generator().manual_seed(3)).float()
    x[2, 100] = float("nan")
    for rows in (x, x.bfloat16()):
        assert argmax_rows(rows) == [argmax(r) for r in rows]
    assert Sampler(SamplingParams(temperature=0)).plain_greedy
    assert not Sampler(SamplingParams(temperature=0, logprobs=1)).plain_greedy
    assert not Sampler(SamplingParams(temperature=0, repeat_penalty=1.2, repeat_last_n=8)).plain_greedy
    assert not Sampler(SamplingParams(temperature=0, logit_bias={3: 1.0})).plain_greedy
    assert not Sampler(SamplingParams(temperature=0.7)).plain_greedy


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 2 * 13), (4, 2 * 64), (300, 2 * 200)])
def test_silu_mul_matches_op_by_op(dtype, shape):
    """silu(g) * u rounded like F.silu then the product in the dtype: float32 within float rounding, 16-bit at
    at most two rounding steps apart on the odd value (the exp differs from torch's in the last float bit)."""
    gu = (torch.randn(*shape, generator=torch.Generator().manual_seed(1)) * 4).to(dtype)
    i = shape[1] // 2
    ref = F.silu(gu[:, :i]) * gu[:, i:]
    got = kernel.silu_mul(gu)
    assert got.dtype == dtype and got.shape == (shape[0], i)
    tol = 1e-6 if dtype == torch.float32 else 2 * (2 ** -7 if dtype == torch.bfloat16 else 2 ** -10)
    assert ((got.float() - ref.float()).abs() <= tol * ref.float().abs() + 1e-30).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rows_of_a_linear_multiply_in_place_as_a_copy_of_them(dtype):
    """`Linear.take(rows)` of a float matrix keeps only the row ids (`LinearRows`): one input row through the C++
    kernel over the rows where they lie, several through a gathered copy -- bit for bit a `Linear` over a copy of
    those rows (and bias entries), for row counts that do not fill the kernel's 4-row blocks, repeated and unsorted
    ids, and row lengths off its 8-wide vectors."""
    from turbospec.layers.linear import Linear, LinearRows

    g = torch.Generator().manual_seed(0)
    for cols in (64, 100):
        w, b = torch.randn(50, cols, generator=g).to(dtype), torch.randn(50, generator=g)
        lin = Linear(w, b)
        for ids in ([3], [0, 7, 7, 49, 2], list(range(0, 50, 3))):
            rows = torch.tensor(ids)
            view, copy = lin.take(rows), Linear(w[rows], b[rows], hugepages=False)
            assert isinstance(view, LinearRows) and view.out_features == len(ids) and view.nbytes == 8 * len(ids)
            for n in (1, 3):
                x = torch.randn(n, cols, generator=g).to(dtype if dtype != torch.float16 else torch.float32)
                assert torch.equal(view(x), copy(x))
    with pytest.raises(RuntimeError, match="row id out of range"):
        kernel.rows_linear(torch.zeros(1, 64), torch.zeros(4, 64), torch.tensor([4]), None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fused_rows_split_between_threads_equal_each_row_alone(dtype):
    """The fused layers' per-row work (norms, q/k norms and RoPE, SwiGLU, residuals) is split between threads for
    the many rows of a batched step; every row's values are exactly those it gets alone (on the calling thread)."""
    g = torch.Generator().manual_seed(0)
    rows, d, nh, nkv, hd, inter = 40, 512, 8, 2, 64, 384

    def r(*shape, s=1.0):
        return (torch.randn(*shape, generator=g) * s).to(dtype)

    x, norm, post = r(rows, d), r(d), r(d)
    w_qkv, q_norm, k_norm = r((nh + 2 * nkv) * hd, d, s=0.05), r(hd), r(hd)
    cos, sin = r(rows, hd), r(rows, hd)
    w_o, w_gu, w_dn, a = r(d, nh * hd, s=0.05), r(2 * inter, d, s=0.05), r(d, inter, s=0.05), r(rows, nh * hd)
    old, old_rows = torch.get_num_threads(), kernel.set_bf16_dot_rows(1 << 20)  # bf16: the AVX2 products at any rows
    torch.set_num_threads(2)
    try:
        qkv = kernel.attn_in(x, norm, 1e-6, False, [w_qkv], None, q_norm, k_norm, cos, sin, nh, nkv, hd, False)
        qkv1 = torch.cat([kernel.attn_in(x[i:i + 1], norm, 1e-6, False, [w_qkv], None, q_norm, k_norm, cos[i:i + 1],
                                         sin[i:i + 1], nh, nkv, hd, False) for i in range(rows)])
        out = kernel.out_mlp(x, a, None, w_o, None, post, 1e-6, False, w_gu, None, w_dn, None)
        out1 = torch.cat([kernel.out_mlp(x[i:i + 1], a[i:i + 1], None, w_o, None, post, 1e-6, False, w_gu, None, w_dn,
                                         None) for i in range(rows)])
        head = torch.randn(3000, d, generator=g).to(dtype)
        logits = kernel.skinny_linear_float(x, head, None)
        logits1 = torch.cat([kernel.skinny_linear(x[i:i + 1], head, None).float() for i in range(rows)])
        picks = kernel.argmax_rows(logits)
    finally:
        torch.set_num_threads(old)
        kernel.set_bf16_dot_rows(old_rows)
    assert torch.equal(qkv, qkv1) and torch.equal(out, out1)
    assert logits.dtype == torch.float32 and torch.equal(logits, logits1)
    assert torch.equal(kernel.skinny_linear_float(x, head, None), kernel.skinny_linear(x, head, None).float())
    assert picks.tolist() == [int(row.argmax()) for row in logits]


def test_bf16_dot_products_match_reference_and_do_not_depend_on_the_batch():
    """AVX-512 BF16 products (continuous batching's rows): near the float32 product, and each row's values the same
    whether its rows go through a 4 x 4 tile (one reduction of all 16 sums) or a narrower one."""
    if not kernel.bf16_dot():
        pytest.skip("no AVX-512 BF16 on this CPU")
    g = torch.Generator().manual_seed(0)
    w = torch.randn(37, 100, generator=g).bfloat16()  # 9 blocks of 4 weight rows and one of 1; 3 x 32 values + 4
    x = torch.randn(11, 100, generator=g).bfloat16()
    old = kernel.set_bf16_dot_rows(2)
    try:
        whole = kernel.skinny_linear_float(x, w, None)  # rows 0-3 and 4-7 in 4 x 4 tiles, 8-10 in a 4 x 3 one
        parts = torch.cat([kernel.skinny_linear_float(x[a:b], w, None) for a, b in ((0, 2), (2, 6), (6, 9), (9, 11))])
    finally:
        kernel.set_bf16_dot_rows(old)
    ref = x.float() @ w.float().T
    assert (whole - ref).abs().max().item() <= 1e-2 * ref.abs().max().item()
    assert torch.equal(whole, parts)
