"""Tests for turbospec.lab.fit: byte counts against turbospec's own objects, the 27B preset (cross-checked
against the recurrent-state size llama.cpp logs), GGUF/safetensors readers, the command line, and the
verification: predicted peak within 10% of the measured peak RSS of `turbospec run` subprocesses on small
models."""

from __future__ import annotations

import json

import pytest

from turbospec.cli.main import build_parser
from turbospec.demo import make_demo_model
from turbospec.errors import TurboSpecError
from turbospec.kernels.gemv import load_kernel
from turbospec.lab.fit import (
    DEFAULT_KV_TYPES,
    Setup,
    arch_from_gguf,
    estimate,
    fit_table,
    kv_bytes_per_token,
    load_arch,
    max_context,
    measure_peak_rss,
    measure_runtime_overhead,
    parse_mem,
)

MiB, GiB = 2**20, 2**30
SMALL = {"hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 8000}
MEDIUM = {"hidden_size": 384, "intermediate_size": 1024, "num_hidden_layers": 4, "num_attention_heads": 6,
          "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 24000, "tie_word_embeddings": False}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("fit")
    return {"small": make_demo_model(root / "small", **SMALL),
            "medium": make_demo_model(root / "medium", **MEDIUM)}


def test_parse_mem():
    assert parse_mem("24GiB") == 24 * GiB
    assert parse_mem("24 GB") == 24 * 10**9
    assert parse_mem("512MiB") == 512 * MiB
    assert parse_mem("1.5KiB") == 1536
    assert parse_mem("1000") == 1000
    with pytest.raises(TurboSpecError):
        parse_mem("lots")


def test_kv_bytes_match_the_caches():
    import torch

    from turbospec.kv.cache import KVCache
    from turbospec.kv.quant_cache import QuantKVCache

    assert kv_bytes_per_token(3, 2, 64, "f32", "f32") * 32 == KVCache(3, 2, 64, 32, torch.float32).nbytes
    for k, v in (("q8_0", "q8_0"), ("tbq4_0", "turbo3"), ("turbo2", "q4_0"), ("f16", "turbo4")):
        assert kv_bytes_per_token(3, 2, 128, k, v) * 16 == QuantKVCache(3, 2, 128, 16, k, v).nbytes
    with pytest.raises(TurboSpecError):
        kv_bytes_per_token(1, 1, 64, "nope", "f16")


def test_weights_from_headers_match_the_loaded_model(models):
    from turbospec.model import load_model

    arch = load_arch(models["medium"])
    b = estimate(arch, Setup(), 256, "f32", "f32")
    norms = 4 * (2 * 384 + 2 * 64) + 384  # RMSNorm vectors: counted here, not in DenseModel.weight_bytes
    assert b.weights == load_model(models["medium"], "float32").weight_bytes + 4 * norms
    assert arch.trunk_params() == arch.trunk_params_counted  # config arithmetic agrees with the file


def test_qwen36_27b_preset_and_the_seed_example():
    arch = load_arch(preset="qwen3.6-27b")
    assert (arch.n_attn, arch.n_gdn, arch.n_kv_heads, arch.head_dim) == (16, 48, 4, 256)
    assert 26.5e9 < arch.trunk_params() < 27.5e9
    cuda = Setup(backend="cuda")
    b = estimate(arch, cuda, 262144, "tbq4_0", "tbq4_0")
    # llama.cpp logs S (f32) 144 MiB + R 5.62 MiB per sequence for a 64-layer Qwen3.6
    assert b.recurrent_state == 144 * MiB + int(5.625 * MiB)
    assert b.attention_kv == 262144 * 16 * 4 * 2 * 136  # 256 dims of tbq4_0 = 136 bytes
    assert b.total < 24 * GiB
    m = estimate(arch, cuda, 262144, "tbq4_0", "tbq4_0", "mtp")
    assert b.total < m.total < 24 * GiB and m.mtp_weights > 0 and m.mtp_kv > 0 and m.mtp_compute > 0
    assert estimate(arch, cuda, 262144, "f16", "f16").total > 24 * GiB
    n_base, _ = max_context(arch, cuda, 24 * GiB, "tbq4_0", "tbq4_0")
    n_mtp, bm = max_context(arch, cuda, 24 * GiB, "tbq4_0", "tbq4_0", "mtp")
    assert 262144 <= n_mtp < n_base and bm.total <= 24 * GiB


def test_max_context_is_the_boundary(models):
    arch = load_arch(models["small"])
    s = Setup()
    mem = 400 * MiB
    for kt in ("f32", "q8_0", "turbo3"):
        n, b = max_context(arch, s, mem, kt, kt)
        assert b.total <= mem < estimate(arch, s, n + 256, kt, kt).total
    assert max_context(arch, s, 100 * MiB, "f16", "f16") == (0, None)
    rows = fit_table(arch, s, mem, list(DEFAULT_KV_TYPES), [], ["base"])
    ctx = [r["max_ctx"] for r in rows]
    assert ctx[DEFAULT_KV_TYPES.index("turbo2")] > ctx[DEFAULT_KV_TYPES.index("q8_0")] > ctx[0]


def test_context_capped_where_the_model_stops_being_exact(hf_models, tmp_path):
    """A model that attends differently past some position (Phi-3's sliding window here: 64 positions) is planned
    up to that position, from its checkpoint and from its GGUF file alike, with a note; `run` refuses more."""
    from turbospec.lab.fit import plan
    from turbospec.model.gguf_export import export_gguf

    src = hf_models["phi3_partial"]
    for model in (src, export_gguf(src, tmp_path / "p.gguf", "f32")):
        arch = load_arch(str(model))
        info = plan(arch, Setup(), 8 * GiB, ["f16"], [], None)
        assert arch.exact_ctx == 64 and [r["max_ctx"] for r in info["rows"]] == [64]
        assert any("context capped at 64" in n for n in info["notes"])
    assert load_arch(str(hf_models["phi3"])).exact_ctx is None


def test_gguf_reader(tmp_path):
    gguf = pytest.importorskip("gguf")
    import numpy as np

    path = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(str(path), "qwen3")
    w.add_block_count(2)
    w.add_embedding_length(64)
    w.add_feed_forward_length(128)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_key_length(16)
    w.add_context_length(4096)
    w.add_token_list([f"t{i}" for i in range(100)])
    w.add_tensor("token_embd.weight", np.zeros((100, 64), dtype=np.float16))
    for i in range(2):
        w.add_tensor(f"blk.{i}.attn_q.weight", np.zeros((64, 64), dtype=np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    arch = arch_from_gguf(path)
    assert (arch.n_layers, arch.hidden, arch.n_kv_heads, arch.head_dim, arch.vocab) == (2, 64, 2, 16, 100)
    assert arch.trunk_bytes == (100 * 64 + 2 * 64 * 64) * 2
    b = estimate(arch, Setup(backend="cuda"), 1024, "q8_0", "q8_0")
    assert b.weights == arch.trunk_bytes
    assert b.attention_kv == 1024 * kv_bytes_per_token(2, 2, 16, "q8_0", "q8_0")


def test_cli_json_and_table(models, capsys):
    ap = build_parser()
    a = ap.parse_args(["fit", "-m", str(models["small"]), "--mem", "600MiB", "-ctk", "f16,turbo3", "-c",
                       "8192", "--json"])
    assert a.func(a) == 0
    d = json.loads(capsys.readouterr().out)
    assert [r["kv_type"] for r in d["rows"]] == ["f16", "turbo3"]
    assert all(r["at_ctx"]["fits"] for r in d["rows"])
    a = ap.parse_args(["fit", "--preset", "qwen3.6-27b", "--mem", "24GiB", "--backend", "cuda", "-ctk",
                       "tbq4_0", "-c", "262144"])
    assert a.func(a) == 0
    out = capsys.readouterr().out
    assert "tbq4_0" in out and "mtp" in out and "fits" in out
    a = ap.parse_args(["fit", "-m", str(models["small"]), "--mem", "1GiB", "--mtp"])
    with pytest.raises(TurboSpecError):
        a.func(a)


def test_predicted_peak_within_10_percent_of_measured(models, tmp_path):
    """The verification: `turbospec run` subprocesses (600-token prompt, so a full ubatch is computed) on
    small models; the CPU baseline is measured here too, on a minimal model, not assumed."""
    imported, runtime = measure_runtime_overhead()
    setup_kw = {"runtime_overhead": runtime, "import_overhead": imported}
    prompt = tmp_path / "p.txt"
    prompt.write_text(("The quick brown fox jumps over the lazy dog. " * 14)[:600])
    cases = [("small", 16384, 256, "q8_0"), ("medium", 8192, 512, "f32")]
    for name, ctx, ub, kt in cases:
        extra = [] if kt == "f32" else ["-ctk", kt, "-ctv", kt]
        measured = measure_peak_rss(models[name], ctx, ub, prompt, extra)
        pred = estimate(load_arch(models[name]), Setup(ubatch=ub, **setup_kw), ctx, kt, kt).total
        assert abs(pred - measured) / measured < 0.10, (name, ctx, kt, pred / MiB, measured / MiB)


def test_hybrid_counts_match_hybrid_cache():
    import torch

    from turbospec.kv.hybrid_cache import HybridCache
    from turbospec.lab.fit import arch_from_config

    cfg = {"model_type": "qwen3_5_text", "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 8,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 128,
           "full_attention_interval": 4, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
           "linear_key_head_dim": 8, "linear_value_head_dim": 12, "linear_conv_kernel_dim": 4}
    arch = arch_from_config(cfg)
    assert (arch.n_attn, arch.n_gdn) == (2, 6)
    cache = HybridCache(arch.n_attn, arch.n_kv_heads, arch.head_dim, arch.n_gdn,
                        (arch.conv_kernel - 1, arch.conv_dim),
                        (arch.gdn_v_heads, arch.gdn_k_dim, arch.gdn_v_dim),
                        300, torch.float32, max_checkpoints=3)
    b = estimate(arch, Setup(n_max=3), 300, "f32", "f32", "base")
    assert b.attention_kv == cache.attention_kv_bytes
    assert b.recurrent_state == cache.nbytes - cache.attention_kv_bytes == 4 * cache.recurrent_state_bytes
    s = estimate(arch, Setup(n_max=3), 300, "f32", "f32", "draft")
    # HybridCache.scratch_bytes counts the N new rows of each stashed conv window; the window also holds the
    # K-1 rows of the committed conv state ([K-1+N, C], see gdn_stash), which fit counts too
    window_head = arch.n_gdn * (arch.conv_kernel - 1) * arch.conv_dim * 4
    assert s.spec_state_copies == cache.scratch_bytes(4) + window_head
    c = estimate(arch, Setup(n_max=3, spec_state="checkpoint"), 300, "f32", "f32", "draft")
    assert c.spec_state_copies < s.spec_state_copies


def test_cpu_mtp_counts_prompt_window_rows_and_draft_head():
    """CPU MTP mode: the trunk hands the drafter only its prompt window's hidden rows (auto: 64..256
    positions + 1), and a float32 run of a 16-bit checkpoint holds a bf16 copy of the lm_head as the draft
    head."""
    arch = load_arch(preset="qwen3.6-27b")
    for ctx, rows in ((100, 65), (1000, 251), (100000, 257)):
        b = estimate(arch, Setup(dtype="float32"), ctx, "f16", "f16", "mtp")
        assert b.spec_hidden_rows == rows * arch.hidden * 4
        assert b.draft_head == arch.vocab * arch.hidden * 2
    assert estimate(arch, Setup(dtype="bfloat16"), 1000, "f16", "f16", "mtp").draft_head == 0
    assert estimate(arch, Setup(dtype="float32"), 1000, "f16", "f16").draft_head == 0


@pytest.mark.skipif(load_kernel() is None, reason="packed weights need the AVX2 kernel")
@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "q4_k"])
def test_packed_weight_bytes_match_the_loaded_model(models, fmt):
    """`--weights` in fit: every matrix whose rows are whole blocks packed, the rest (q4_k: 384-wide rows) in the
    dtype, exactly as the loader packs them; the bundled hybrid (MTP block included) within 1%."""
    from pathlib import Path

    from turbospec.model import load_model

    arch = load_arch(models["medium"])
    b = estimate(arch, Setup(weights=fmt), 256, "f32", "f32")
    norms = 4 * (2 * 384 + 2 * 64) + 384
    assert b.weights == load_model(models["medium"], "float32", fmt).weight_bytes + 4 * norms
    hybrid = Path(__file__).resolve().parents[2] / "models" / "turbospec-tiny-hybrid"
    m = load_model(hybrid, "bfloat16", fmt)
    e = estimate(load_arch(hybrid), Setup(dtype="bfloat16", weights=fmt), 256, "bf16", "bf16", "mtp")
    assert abs(e.weights + e.mtp_weights - m.weight_bytes - m.mtp.nbytes) / (e.weights + e.mtp_weights) < 0.01


def test_gguf_packed_matrices_counted_as_stored(tmp_path):
    """A GGUF file on the CPU: Q8_0 matrices at their file bytes, F16 ones in the run dtype."""
    gguf = pytest.importorskip("gguf")
    import numpy as np

    path = tmp_path / "q.gguf"
    w = gguf.GGUFWriter(str(path), "qwen3")
    for add, v in ((w.add_block_count, 1), (w.add_embedding_length, 64), (w.add_feed_forward_length, 128),
                   (w.add_head_count, 4), (w.add_head_count_kv, 2), (w.add_key_length, 16)):
        add(v)
    w.add_tensor("token_embd.weight", np.zeros((100, 64), dtype=np.float16))
    q8 = gguf.quants.quantize(np.ones((64, 64), dtype=np.float32), gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("blk.0.attn_q.weight", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    arch = arch_from_gguf(path)
    assert estimate(arch, Setup(dtype="float32"), 64, "f32", "f32").weights == 100 * 64 * 4 + 64 * 2 * 34
    assert estimate(arch, Setup(dtype="bfloat16"), 64, "f32", "f32").weights == 100 * 64 * 2 + 64 * 2 * 34
    # --weights on a GGUF file packs only its float matrices; the Q8_0 one stays as stored
    assert estimate(arch, Setup(dtype="bfloat16", weights="q4_0"), 64, "f32", "f32").weights == \
        100 * 64 * 18 // 32 + 64 * 2 * 34


def test_parallel_counts_the_shared_pool_and_every_sequences_states():
    """serve -np N: the KV pool's whole blocks and, on a hybrid, N state slots + their snapshots + the states of a
    step in flight, per sequence the bytes of the engine's own StatePool."""
    from pathlib import Path

    import torch

    from turbospec.kv.paged import pool_for
    from turbospec.model.registry import load_model

    path = Path(__file__).resolve().parents[2] / "models" / "turbospec-tiny-hybrid"
    if not (path / "config.json").exists():
        pytest.skip("no bundled hybrid model")
    arch, m = load_arch(str(path)), load_model(str(path), torch.float32)
    one = estimate(arch, Setup(ctx_checkpoints=0), 1000, "q8_0", "q8_0")
    par = estimate(arch, Setup(parallel=4, ctx_checkpoints=3), 1000, "q8_0", "q8_0")
    state = m.new_state_pool(1, 0).state_bytes
    assert one.recurrent_state == state
    assert par.recurrent_state == 4 * (2 + 3) * state
    assert par.attention_kv == pool_for(m, 1000, "q8_0", "q8_0", layers=m.num_attn_layers).nbytes  # 4 blocks
    with pytest.raises(TurboSpecError, match="draft-model"):
        estimate(arch, Setup(parallel=2), 1000, "q8_0", "q8_0", mode="draft")


def test_parallel_speculation_counts_every_sequences_drafter():
    """serve -np N with drafts: each sequence's MTP cache (together the pool's positions, plus a chain each), prompt
    window rows and chain of recurrent states, the logits of every sequence's verified rows; a draft model is not
    batched (refused)."""
    arch = load_arch(preset="qwen3.6-27b")
    one = estimate(arch, Setup(dtype="bfloat16", n_max=3), 65536, "q8_0", "q8_0", "mtp")
    four = estimate(arch, Setup(dtype="bfloat16", n_max=3, parallel=4, ctx_checkpoints=0), 65536, "q8_0", "q8_0",
                    "mtp")
    per_pos = kv_bytes_per_token(arch.mtp_layers, arch.n_kv_heads, arch.head_dim, "q8_0", "q8_0")
    assert one.mtp_kv == (65536 + 4) * per_pos and four.mtp_kv == (65536 + 4 * 4) * per_pos
    assert four.spec_hidden_rows == 4 * one.spec_hidden_rows and four.spec_state_copies == 4 * one.spec_state_copies
    plain = estimate(arch, Setup(dtype="bfloat16", parallel=4, ctx_checkpoints=0), 65536, "q8_0", "q8_0")
    assert four.activations - plain.activations == (16 - 4) * arch.vocab * 4 * 2  # 4 x (1 + n_max) logits rows
    assert plain.drafter_tables == four.drafter_tables == 0


def test_model_free_drafters_tables_are_counted():
    """The n-gram tables fit counts per context token bound what the drafters hold (tracemalloc) on tokens that
    never repeat, their worst case, and are not far above it; --spec-type rows carry them."""
    import random
    import tracemalloc

    from turbospec.lab.fit.memory import NGRAM_MOD_POOL, TABLE_BYTES_PER_TOKEN
    from turbospec.speculative.ngram import NgramMod, PromptLookup
    from turbospec.speculative.suffix import SuffixDrafter

    n = 30000
    rnd = random.Random(0)
    tokens = [rnd.randrange(3, 150000) for _ in range(n)]
    for name, make in (("ngram", PromptLookup), ("suffix", SuffixDrafter), ("ngram-mod", NgramMod)):
        tracemalloc.start()
        d = make()
        d.begin(list(tokens), None)
        held = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
        assert 0.6 * TABLE_BYTES_PER_TOKEN[name] * n < held <= TABLE_BYTES_PER_TOKEN[name] * n, name
        del d
    arch = load_arch(preset="qwen3.6-27b")
    b = estimate(arch, Setup(drafters=("ngram", "ngram-mod"), parallel=2), 4096, "f16", "f16", "ngram")
    # two sequences: their tables, as many again kept for a next turn, ngram-mod's pool per sequence and kept drafter
    assert b.drafter_tables == 2 * (TABLE_BYTES_PER_TOKEN["ngram"] + TABLE_BYTES_PER_TOKEN["ngram-mod"]) * 4096 + \
        4 * NGRAM_MOD_POOL
    assert b.mtp_weights == b.mtp_kv == 0 and b.spec_state_copies > 0
    with pytest.raises(TurboSpecError, match="unknown mode"):
        estimate(arch, Setup(), 4096, "f16", "f16", "medusa")


def test_cli_spec_type_rows(models, capsys):
    ap = build_parser()
    a = ap.parse_args(["fit", "-m", str(models["small"]), "--mem", "1GiB", "-ctk", "q8_0", "-np", "4", "-c", "8192",
                       "--spec-type", "ngram,suffix", "--json"])
    assert a.func(a) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [r["mode"] for r in rows] == ["base", "ngram+suffix"]
    assert rows[1]["breakdown"]["drafter_tables"] > 0 and rows[1]["max_ctx"] < rows[0]["max_ctx"]
    for bad, msg in ((["--spec-type", "draft-mtp"], "no MTP module"), (["--spec-type", "medusa"], "fit plans"),
                     (["--spec-type", "ngram", "--mtp"], "leave out")):
        a = ap.parse_args(["fit", "-m", str(models["small"]), "--mem", "1GiB", *bad])
        with pytest.raises(TurboSpecError, match=msg):
            a.func(a)
