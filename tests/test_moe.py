"""Mixture-of-experts models (Qwen3-MoE, Qwen3.5-MoE): exactness against transformers, the expert cache's budget,
batched rows equal to single rows, speculation on a MoE target (its MTP layer MoE too), packed experts."""

import pytest
import torch

from tests.hf_moe import VARIANTS, batched_equals_single, build, moe_layers, prefill_then_decode, run
from tests.hf_tiny import hf_logits
from turbospec.config import EngineConfig, SpecConfig
from turbospec.engine import Engine
from turbospec.errors import TurboSpecError
from turbospec.layers.moe import ExpertCache, MoE
from turbospec.model import load_model
from turbospec.model.config import ModelConfig
from turbospec.sampling import SamplingParams
from turbospec.weights import is_packed

TOL = 1e-4


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    out = tmp_path_factory.mktemp("moe")
    paths = {name: build(name, out) for name in VARIANTS}
    paths["qwen3_5_moe_mtp"] = build("qwen3_5_moe", out, mtp=True)
    return paths


@pytest.fixture(scope="module")
def refs(ckpts):
    ids = torch.randint(0, 128, (48,), generator=torch.Generator().manual_seed(1))
    return ids, {name: hf_logits(ckpts[name], ids) for name in VARIANTS}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_matches_transformers(ckpts, refs, name):
    """Whole-prompt forward, and chunked prefill followed by decode, equal transformers' logits."""
    ids, ref = refs
    model = load_model(ckpts[name], "float32")
    cfg = model.cfg
    expected = [cfg.moe_layer(i) for i in range(cfg.num_layers)]
    assert [isinstance(layer.mlp, MoE) for layer in model.layers] == expected and any(expected)
    if name == "qwen3_moe":
        assert expected == [True, False, True, True]  # mlp_only_layers [1]
    if name == "qwen3_moe_sparse":
        assert expected == [False, True, False, True] and not moe_layers(model)[0].norm_topk
    r = ref[name]
    assert r.abs().max() > 0.5
    assert (run(model, ids, model.new_cache(128)) - r).abs().max().item() < TOL
    assert (prefill_then_decode(model, ids) - r).abs().max().item() < TOL


@pytest.mark.parametrize("name", ["qwen3_moe", "qwen3_5_moe"])
def test_expert_budget_same_logits_and_counts(ckpts, refs, name):
    """A budget of 2/3 of the experts (8 per layer, 3-4 MoE layers): experts load when routed to and leave least
    recently used first; the logits are the same as with every expert loaded. (In bfloat16: converted experts,
    counted by their bytes; float32 ones would be views of the checkpoint's mapping, counted by the 2 MiB units of
    the file they lie in, more than this tiny model's budget: test_budget_counts_the_folios_mapped_experts_lie_in.)"""
    ids, _ = refs
    full = load_model(ckpts[name], "bfloat16")
    n_moe = len(moe_layers(full))
    assert full.experts.stats.misses == n_moe * 8 and full.experts.budget is None  # all loaded at start
    one = moe_layers(full)[0].expert_bytes
    budget = n_moe * 8 * 2 // 3 * one
    small = load_model(ckpts[name], "bfloat16", moe_cache_mem=budget)
    assert small.experts.used == 0 and small.experts.stats.misses == 0
    a, b = prefill_then_decode(full, ids), prefill_then_decode(small, ids)
    assert torch.equal(a, b)
    s = small.experts.stats
    assert s.evictions > 0 and s.hits > 0 and small.experts.used <= budget
    assert s.loaded_bytes == s.misses * one
    assert 0 < s.hit_rate < 1
    # full: every lookup after loading hits
    assert full.experts.stats.hits == s.hits + s.misses


def test_budget_zero_still_runs(ckpts, refs):
    ids, ref = refs
    model = load_model(ckpts["qwen3_moe"], "float32", moe_cache_mem=0)
    assert (run(model, ids, model.new_cache(64)) - ref["qwen3_moe"]).abs().max().item() < TOL
    assert model.experts.stats.hits == 0 and len(model.experts.entries) <= 1


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", ["qwen3_moe", "qwen3_5_moe"])
def test_batched_rows_equal_single_rows(ckpts, name, dtype):
    """Verification rows (several tokens in one forward, grouped by expert) equal the single-token steps bit for
    bit: speculation stays lossless on MoE models."""
    assert batched_equals_single(load_model(ckpts[name], dtype), 5)


@pytest.mark.parametrize("spec", ["draft-mtp", "ngram-mod,draft-mtp"])
def test_speculation_lossless_with_moe_mtp(ckpts, spec):
    from turbospec.speculative import make_drafter

    model = load_model(ckpts["qwen3_5_moe_mtp"], "float32")
    assert model.mtp is not None and isinstance(model.mtp.layers[0].mlp, MoE)
    assert model.mtp.layers[0].mlp.layer < 0  # its own expert-cache keys
    plain = Engine(model, None, EngineConfig(ctx=128, ubatch=8))
    sc = SpecConfig.parse(spec, n_max=3, ngram_mod_n_match=3)
    eng = Engine(model, None, EngineConfig(ctx=128, ubatch=8, spec=sc), drafter=make_drafter(sc, model, 140))
    p = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    drafts = 0
    for i in range(3):
        prompt = [(7 * i + j) % 128 for j in range(8)] * 2
        assert eng.generate([prompt], p)[0]["tokens"] == plain.generate([prompt], p)[0]["tokens"]
        drafts += eng.last_stats.spec.drafts
    assert drafts > 0


def test_packed_experts_from_float_checkpoint(ckpts, refs):
    """--weights q8_0 packs every expert (loaded on demand too) and stays close to the float model."""
    ids, ref = refs
    for budget in (None, 1 << 14):
        model = load_model(ckpts["qwen3_moe"], "float32", weights="q8_0", moe_cache_mem=budget)
        got = run(model, ids, model.new_cache(64))
        mlp = moe_layers(model)[0].expert(3)
        assert all(is_packed(lin.weight) for lin in (*mlp.gate_up.parts, mlp.down))
        r = ref["qwen3_moe"]
        assert (got - r).abs().mean().item() < 0.05  # (a row whose router flips an expert differs more)
        assert (got.argmax(-1) == r.argmax(-1)).float().mean() > 0.9


def test_engine_config_and_cli_flag(ckpts):
    from turbospec.cli.main import build_parser
    from turbospec.engine.build import load_parts

    a = build_parser().parse_args(["run", "-m", str(ckpts["qwen3_moe"]), "--moe-cache-mem", "1", "-p", "x"])
    from turbospec.cli.args import engine_config

    cfg = engine_config(a)
    assert cfg.moe_cache_mem == 1
    _, model, _ = load_parts(cfg)
    assert model.experts.budget == 1 << 20
    with pytest.raises(TurboSpecError, match="moe-cache-mem"):
        EngineConfig(moe_cache_mem=-1)


def test_cache_lru_order():
    from turbospec.layers.moe import expert_mlp

    w = torch.zeros(4, 8)
    c = ExpertCache(budget=3 * (2 * w.numel() * 4 + w.numel() * 4))
    for key in [(0, 0), (0, 1), (0, 2), (0, 0), (0, 3)]:  # (0, 1) is least recently used when (0, 3) comes
        c.get(key, lambda: expert_mlp(w, w, w.T.contiguous()))
    assert list(c.entries) == [(0, 2), (0, 0), (0, 3)]
    assert (c.stats.hits, c.stats.misses, c.stats.evictions) == (1, 4, 1)


def test_budget_counts_the_folios_mapped_experts_lie_in(tmp_path):
    """Experts that are views of a file mapping cost the page-cache folios they lie in (a fault maps a folio
    whole), each folio once however many cached experts share it; a folio is given back with the last of them.
    A matrix outside the mapping (a tensor-parallel rank's copied columns) costs its own bytes."""
    import warnings

    import numpy as np

    from turbospec.layers.moe import FOLIO, expert_mlp
    from turbospec.weights import file_mapping

    f = tmp_path / "experts.bin"
    f.write_bytes(bytes(4 * FOLIO))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # (a read-only map)
        t = torch.from_numpy(np.memmap(f, dtype=np.float32, mode="r"))
    mapped = file_mapping(t)
    assert mapped is not None
    def at(byte: int) -> torch.Tensor:  # a 4 KB matrix at a byte offset of the file
        return t[byte // 4:byte // 4 + 1024].view(16, 64)

    def expert(*offsets, down=None):
        return lambda: expert_mlp(at(offsets[0]), at(offsets[1]), down if down is not None else at(offsets[2]))

    c = ExpertCache(budget=2 * FOLIO)
    c.get((0, 0), expert(0, 4096, 8192), mapped)  # folio 0
    c.get((0, 1), expert(12288, 16384, 20480), mapped)  # folio 0 again: nothing more
    assert (c.used, len(c.folios)) == (FOLIO, 1)
    c.get((0, 2), expert(FOLIO, FOLIO + 4096, FOLIO + 8192), mapped)  # folio 1
    assert c.used == 2 * FOLIO and c.stats.evictions == 0
    c.get((0, 3), expert(2 * FOLIO, 3 * FOLIO, 3 * FOLIO + 4096), mapped)  # folios 2 and 3: all three others go
    assert list(c.entries) == [(0, 3)] and c.used == 2 * FOLIO and c.stats.evictions == 3
    assert sorted(c.folios) == [mapped[0] + 2 * FOLIO, mapped[0] + 3 * FOLIO]
    c.get((0, 4), expert(2 * FOLIO + 8192, 2 * FOLIO + 12288, down=torch.zeros(64, 16)), mapped)
    assert c.used == 2 * FOLIO + 4096 - FOLIO and list(c.entries) == [(0, 4)]  # (0, 3) had to go for the copy
    c.clear()
    assert (c.used, len(c.folios)) == (0, 0)


@pytest.mark.parametrize("change, match", [
    ({"num_experts": 4, "moe_intermediate_size": 8, "num_experts_per_tok": 5}, "num_experts_per_tok"),
    ({"num_experts": 4, "moe_intermediate_size": 0}, "moe_intermediate_size"),
    ({"num_experts": 4, "moe_intermediate_size": 8, "mlp_only_layers": "1"}, "mlp_only_layers"),
])
def test_bad_moe_config_is_one_line_error(change, match):
    d = {"model_type": "qwen3_moe", "vocab_size": 16, "hidden_size": 8, "intermediate_size": 8,
         "num_hidden_layers": 1, "num_attention_heads": 2, "head_dim": 4, **change}
    with pytest.raises(TurboSpecError, match=match):
        ModelConfig.from_dict(d)


def test_multimodal_moe_config_reads_text_part():
    inner = {"vocab_size": 16, "hidden_size": 16, "intermediate_size": 8, "num_hidden_layers": 2,
             "num_attention_heads": 2, "head_dim": 8, "num_experts": 4, "num_experts_per_tok": 2,
             "moe_intermediate_size": 8, "shared_expert_intermediate_size": 8}
    cfg = ModelConfig.from_dict({"model_type": "qwen3_5_moe", "text_config": inner, "tie_word_embeddings": True})
    assert cfg.arch == "qwen3_5_moe_text" and cfg.tie_word_embeddings
    assert cfg.moe() == {"experts": 4, "top_k": 2, "inter": 8, "shared_inter": 8, "norm_topk": True}
    assert all(cfg.moe_layer(i) for i in range(2))


@pytest.mark.parametrize("name", ["qwen3_moe", "qwen3_5_moe"])
def test_continuous_batching_equals_solo(ckpts, name):
    """Several sequences' rows in one forward (experts grouped over all of them) decode what each decodes alone."""
    import random

    from tests.test_scheduler import _drive, _solo
    from turbospec.engine.scheduler import Scheduler
    from turbospec.kv.paged import pool_for

    model = load_model(ckpts[name], "float32", moe_cache_mem=1 << 15)  # experts coming and going as well
    rnd = random.Random(3)
    prompts = [[rnd.randrange(0, 128) for _ in range(n)] for n in (5, 40, 17, 300)]
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in (20, 7, 25, 12)]
    want = _solo(model, prompts, params)
    hybrid = name == "qwen3_5_moe"
    pool = pool_for(model, 2048, None, None, layers=model.num_attn_layers if hybrid else None)
    sch = Scheduler(model, pool, max_seqs=4, max_step_tokens=64, ctx=2048,
                    states=model.new_state_pool(4, 4) if hybrid else None)
    got = _drive(sch, [(s, p, sp) for s, p, sp in zip((0, 0, 3, 5), prompts, params)])
    assert [got[i][0] for i in range(4)] == [w[0] for w in want]


def test_stats_and_bench_report_the_expert_cache(ckpts):
    """The decode phase's expert lookups reach GenStats (and `turbospec run`'s stats line) and bench's rows."""
    from turbospec.lab.bench import run_local
    from turbospec.lab.workload import BenchOptions

    model = load_model(ckpts["qwen3_moe"], "float32", moe_cache_mem=1 << 16)
    eng = Engine(model, None, EngineConfig(ctx=128))
    eng.generate([[1, 2, 3, 4]], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    x = eng.last_stats.experts
    assert x is not None and x.tokens == 9 and x.hits + x.misses == 9 * 3 * 2  # 3 MoE layers, top-2
    assert x.loaded_bytes == x.misses * moe_layers(model)[0].expert_bytes and "experts hit" in eng.last_stats.line()
    from tests.hf_tiny import build as build_dense

    dense = Engine(load_model(build_dense("qwen3", ckpts["qwen3_moe"].parent), "float32"), None, EngineConfig(ctx=64))
    dense.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert dense.last_stats.experts is None and "experts" not in dense.last_stats.line()
    cfg = EngineConfig(model=str(ckpts["qwen3_moe"]), ctx=256, moe_cache_mem=0)
    rows = run_local(cfg, BenchOptions(n_prompt=8, n_gen=6, repetitions=1, warmup=0, quiet=True))["rows"]
    assert rows[0]["expert_hit_rate"] == 0.0 and rows[0]["expert_loaded_mib_per_tok"] > 0
    assert rows[0]["disk_mib_per_tok"] >= 0


@pytest.mark.parametrize("weights", ["auto", "q8_0"])
def test_fit_counts_the_experts_as_loaded(ckpts, weights):
    from turbospec.lab.fit import Setup, estimate, load_arch

    arch = load_arch(str(ckpts["qwen3_5_moe_mtp"]))
    assert (arch.n_experts, arch.experts_per_tok, arch.moe_layers, arch.mtp_moe) == (8, 2, 4, True)
    assert arch.trunk_params() == arch.trunk_params_counted and arch.mtp_params() == arch.mtp_params_counted
    model = load_model(ckpts["qwen3_5_moe_mtp"], "float32", weights=weights)
    per = moe_layers(model)[0].expert_bytes
    b = estimate(arch, Setup(weights=weights), 256, "f16", "f16", "mtp")
    assert b.experts == (4 + 1) * 8 * per and b.experts_on_disk == 0
    budget = estimate(arch, Setup(weights=weights, moe_cache_mem=3 * per), 256, "f16", "f16", "mtp")
    assert budget.experts == 3 * per and budget.experts_on_disk == 37 * per
    assert budget.total < b.total and budget.weights == b.weights


def test_fit_plans_experts_on_disk_when_they_do_not_fit(ckpts, capsys):
    from turbospec.cli.main import main
    from turbospec.lab.fit import Setup, estimate, load_arch, plan

    arch = load_arch(str(ckpts["qwen3_5_moe_mtp"]))
    full = estimate(arch, Setup(), 4096, "f16", "f16", "mtp")
    mem = full.total - full.experts // 2  # half the experts fit
    info = plan(arch, Setup(), mem, ["f16"])
    assert any("--moe-cache-mem" in n for n in info["notes"])
    for row in info["rows"]:
        assert row["max_ctx"] >= 4096 and row["breakdown"]["total"] <= mem
        assert 0 < row["breakdown"]["experts_on_disk"] < full.experts
    assert plan(arch, Setup(), 100 * full.total, ["f16"])["notes"] == []  # fits: nothing to plan
    assert main(["fit", "-m", str(ckpts["qwen3_5_moe_mtp"]), "--mem", str(mem), "-ctk", "f16"]) == 0
    out = capsys.readouterr().out
    assert "experts on disk" in out and "--moe-cache-mem" in out


def test_loading_every_expert_stops_when_memory_runs_out(ckpts, monkeypatch, caplog):
    """No budget and memory running out while the experts load: the cache keeps what it has as its budget (one
    warning) and the model still computes the same logits."""
    import turbospec.layers.moe as moe_mod

    ids = torch.randint(0, 128, (20,), generator=torch.Generator().manual_seed(2))
    full = load_model(ckpts["qwen3_moe"], "bfloat16")  # (converted experts: counted by their bytes)
    want = run(full, ids, full.new_cache(32))
    monkeypatch.setattr(moe_mod, "_meminfo", lambda: (1 << 30, 16 << 30))  # 1 GiB available of 16
    with caplog.at_level("WARNING", logger="turbospec"):
        low = load_model(ckpts["qwen3_moe"], "bfloat16")
    assert low.experts.budget == low.experts.used == 15 * moe_layers(low)[0].expert_bytes  # checked at the 16th
    assert sum("memory is running out" in r.message for r in caplog.records) == 1
    assert torch.equal(run(low, ids, low.new_cache(32)), want)
    assert low.experts.stats.evictions > 0


def test_qwen3_5_moe_config_without_intermediate_size():
    """transformers' Qwen3.5-MoE config has no intermediate_size (every layer is MoE)."""
    inner = {"model_type": "qwen3_5_moe_text", "vocab_size": 16, "hidden_size": 16, "num_hidden_layers": 2,
             "num_attention_heads": 2, "head_dim": 8, "num_experts": 4, "num_experts_per_tok": 2,
             "moe_intermediate_size": 8, "shared_expert_intermediate_size": 12}
    assert ModelConfig.from_dict(inner).intermediate_size == 12
    with pytest.raises(TurboSpecError, match="intermediate_size"):
        ModelConfig.from_dict({**inner, "model_type": "qwen3"})


@pytest.mark.parametrize("weights", ["q8_0", "q4_0"])
@pytest.mark.parametrize("name", ["qwen3_moe", "qwen3_5_moe"])
def test_packed_experts_one_kernel_call(ckpts, name, weights):
    """Packed experts go through `moe_experts` (every routed expert of the step, and the shared expert when it has
    their shapes, in two parallel passes): verification rows equal single rows bit for bit, and the result is the
    per-expert path's up to the rounding of intermediates."""
    model = load_model(ckpts[name], "bfloat16", weights=weights)
    moe = moe_layers(model)[0]
    assert moe.fused()
    assert batched_equals_single(model, 6)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    fused = moe(x)
    moe._fused = False
    plain = moe(x)
    assert (fused.float() - plain.float()).abs().max() < 0.02 * plain.float().abs().max()


def test_shared_expert_joins_the_kernel_call_when_shapes_match():
    from turbospec.layers.attention import MLP
    from turbospec.layers.linear import Linear
    from turbospec.weights import quantize

    g = torch.Generator().manual_seed(8)
    h, inter, e = 64, 32, 4

    def q(*shape):
        return quantize(torch.randn(*shape, generator=g) * 0.1, "q8_0")

    experts = [(q(inter, h), q(inter, h), q(h, inter)) for _ in range(e)]
    shared = MLP(Linear(q(2 * inter, h)), Linear(q(h, inter)))
    moe = MoE(torch.randn(e, h, generator=g), e, lambda i: experts[i], 2, True, shared,
              torch.randn(1, h, generator=g), ExpertCache(), 0)
    assert moe.fused() and moe._shared_as_expert(experts[0][0], experts[0][2]) is not None
    x = torch.randn(3, h, generator=g)
    fused = moe(x)
    moe._fused = False
    plain = moe(x)
    assert (fused - plain).abs().max() < 1e-5 * max(1.0, plain.abs().max().item())
