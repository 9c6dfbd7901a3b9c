"""Tensor parallelism (turbospec.parallel.tp) with 2 gloo processes on this CPU: logits equal the single-process
model's (float32, within 1e-5 of the logits' scale) for dense (qwen3 / qwen2 / a GQA-3 qwen3 / llama), hybrid
(Qwen3.5, Qwen3-Next) and MoE (Qwen3-MoE, Qwen3-Next-MoE, Qwen3.5-MoE with its MTP layer) checkpoints and for GGUF
files (float and Q8_0 / Q4_0 packed); greedy decoding gives the same tokens with a quantized KV cache and with MTP
drafting (the bundled models, dense and hybrid, whose MTP layers are sharded too, over the reduced draft vocabulary
and the whole one); rank 0 decides the sampled tokens (a rank drawing with another seed still emits rank 0's); a
bad split is one clear error."""

from __future__ import annotations

import datetime
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.test_dense import full_logits
from turbospec.config import EngineConfig, SpecConfig
from turbospec.errors import TurboSpecError
from turbospec.sampling import SamplingParams

ROOT = Path(__file__).resolve().parents[1]
BUNDLED = ROOT / "models" / "turbospec-tiny"
HYBRID = ROOT / "models" / "turbospec-tiny-hybrid"
IDS = torch.randint(0, 128, (40,), generator=torch.Generator().manual_seed(3))


def greedy(model, path: str, prompt: list[int], cache_type: str | None, spec: tuple[str, ...],
           draft_vocab: int = -1, seed: int | None = None) -> list[int]:
    """24 tokens, greedy (or sampled at T = 0.8 with `seed`), as `build_engine` sets an engine up (under tensor
    parallelism: rank 0 decides every step)."""
    from turbospec.engine.engine import Engine
    from turbospec.parallel import tp
    from turbospec.speculative.registry import make_drafter

    cfg = EngineConfig(model=path, ctx=256, cache_type_k=cache_type, cache_type_v=cache_type,
                       spec=SpecConfig(types=spec, draft_vocab=draft_vocab))
    drafter = make_drafter(cfg.spec, model, cfg.ctx + cfg.spec.depth + 1, model_path=path)
    engine = Engine(model, None, cfg, drafter, model_path=path)
    if tp.world()[1] > 1:
        engine.agree = tp.rank0_choice()
    params = SamplingParams(temperature=0 if seed is None else 0.8, seed=seed, max_tokens=24, ignore_eos=True)
    out: list[int] = []
    for chunk in engine.stream(prompt, params):
        out += chunk.tokens
    return out


def _choose_in_turn(self, room: int, depth: int = 0, left: int = -1) -> int:
    """Rank 0's stand-in for adaptive speculation's choice: a whole draft, a probe, a plain step and then two idle
    ones, in turn (every field the ranks agree on)."""
    self.turn = getattr(self, "turn", 0) + 1
    self.shadow = self.turn % 3 == 2
    if self.turn % 3 == 0:
        self.idle = 2
        return 0
    return 1 if self.shadow else room


def _never(self, *args) -> int:
    """Rank 1's: never draft (were its choice taken, its steps would not match rank 0's)."""
    self.shadow = False
    return 0


def _every_other(self) -> bool:
    self.turn = getattr(self, "turn", 0) + 1
    return self.turn % 2 == 1


def adaptive(model, path: str, prompt: list[int]) -> tuple[list[int], int]:
    """24 greedy tokens with adaptive MTP speculation, rank 0's controller replaced by `_choose_in_turn` and rank
    1's by `_never`: (the tokens, the drafts verified)."""
    from turbospec.engine.engine import Engine
    from turbospec.parallel import tp
    from turbospec.speculative.adaptive import Controller, StepCosts
    from turbospec.speculative.registry import make_drafter

    cfg = EngineConfig(model=path, ctx=256, spec=SpecConfig(types=("draft-mtp",), adaptive=True))
    engine = Engine(model, None, cfg, make_drafter(cfg.spec, model, 260, model_path=path), model_path=path)
    engine.agree, engine.agree_plan = tp.rank0_choice(), tp.rank0_ints(longest=4)
    engine.step_costs = StepCosts([1.0] * (cfg.spec.n_max + 1))  # (no calibration: the choice is the stand-in's)
    saved = Controller.choose
    Controller.choose = _choose_in_turn if tp.world()[0] == 0 else _never  # type: ignore[method-assign]
    try:
        out = [t for c in engine.stream(prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
               for t in c.tokens]
    finally:
        Controller.choose = saved  # type: ignore[method-assign]
    return out, engine.last_stats.spec.drafts


def batched(model, path: str, prompts: list[list[int]], seeds: list[int | None], spec: tuple[str, ...] = (),
            adaptive: bool = False) -> tuple[list[list[int]], int]:
    """The prompts' 24 tokens each from one continuous-batching scheduler (greedy, or sampled at T = 0.8 with a
    seed), all added at once: (the tokens, the drafts verified). Under tensor parallelism rank 0 decides; with
    `adaptive` rank 0's draft gate drafts every other step and rank 1's never."""
    from turbospec.engine.engine import Engine
    from turbospec.parallel import tp
    from turbospec.speculative.batch_gate import DraftGate

    cfg = EngineConfig(model=path, ctx=512, spec=SpecConfig(types=spec, adaptive=adaptive))
    sched = Engine(model, None, cfg, model_path=path).new_scheduler(len(prompts))
    rank, ranks = tp.world()
    if ranks > 1:
        sched.agree = tp.scheduler_choice(sched)
    saved = DraftGate.draft
    if adaptive and ranks > 1:
        DraftGate.draft = _every_other if rank == 0 else _never  # type: ignore[method-assign]
    try:
        seqs = [sched.add(p, SamplingParams(temperature=0 if seed is None else 0.8, seed=seed, max_tokens=24,
                                            ignore_eos=True)) for p, seed in zip(prompts, seeds)]
        out: dict = {s: [] for s in seqs}
        while sched.has_work:
            for o in sched.step():
                if o.chunk is not None:
                    out[o.seq] += o.chunk.tokens
    finally:
        DraftGate.draft = saved  # type: ignore[method-assign]
    return [out[s] for s in seqs], sum(s.stats.spec.drafts for s in seqs if s.stats.spec is not None)


def worker(rank: int, store: str, jobs: list, out: str) -> None:
    from turbospec.parallel import tp

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    results = {}
    try:
        for key, path, kind, arg in jobs:
            # the ranks' sums through gloo, or (as torchrun on one host sets it) through shared memory
            os.environ["LOCAL_WORLD_SIZE"] = "1" if key.endswith("-gloo") else "2"
            # "logits-budget": experts loaded on demand under a budget of about two of them (evictions every step)
            model = tp.load_model_tp(path, moe_cache_mem=60_000 if kind == "logits-budget" else None)
            if kind.startswith("logits"):
                results[key] = full_logits(model, IDS)
                results[key + ":bytes"] = model.weight_bytes
            elif kind == "sampled":  # each rank its own seed: rank 0's draws must be every rank's tokens
                results[key] = greedy(model, path, arg[0], None, (), -1, arg[1] + 1000 * rank)
            elif kind == "greedy-moe":  # (and how many layer steps took the one-call attention + fused experts)
                from turbospec.layers import block

                real, calls = block.moe_layer, []
                block.moe_layer = lambda *a, _real=real, _calls=calls, **k: _calls.append(1) or _real(*a, **k)
                try:
                    results[key] = (greedy(model, path, *arg), len(calls))
                finally:
                    block.moe_layer = real
            elif kind == "adaptive":
                results[key] = adaptive(model, path, arg)
            elif kind == "batch":  # (sampled rows: each rank its own seed, as above)
                prompts, seeds, *rest = arg
                results[key] = batched(model, path, prompts, [None if x is None else x + 1000 * rank for x in seeds],
                                       *rest)
            else:
                results[key] = greedy(model, path, *arg)
    finally:
        dist.destroy_process_group()
    torch.save(results, f"{out}.{rank}")


def run_ranks(tmp_path: Path, jobs: list) -> list[dict]:
    out = str(tmp_path / "result")
    mp.start_processes(worker, args=(str(tmp_path / "store"), jobs, out), nprocs=2, start_method="spawn")
    return [torch.load(f"{out}.{r}", weights_only=True) for r in range(2)]


@pytest.fixture(scope="module")
def checkpoints(hf_models, tmp_path_factory):
    """Every family's tiny checkpoint (dense from `hf_models`, hybrid, MoE) and GGUF files of two of them."""
    from tests import hf_hybrid, hf_moe
    from turbospec.model.gguf_export import export_gguf

    out = tmp_path_factory.mktemp("tp")
    paths = {n: hf_models[n] for n in ("qwen3", "qwen2", "qwen3_gqa3", "llama", "phi3", "phi3_partial")}
    paths |= {n: hf_hybrid.build(n, out) for n in ("qwen3_5", "qwen3_next", "qwen3_next_moe")}
    paths |= {"qwen3_moe": hf_moe.build("qwen3_moe", out), "qwen3_5_moe_mtp": hf_moe.build("qwen3_5_moe", out, True)}
    paths["gguf_f32"] = export_gguf(hf_models["qwen3"], out / "q.gguf", "f32")
    paths["gguf_hybrid_f32"] = export_gguf(paths["qwen3_5"], out / "h.gguf", "f32")
    paths["gguf_q8_0"] = export_gguf(HYBRID, out / "h8.gguf", "q8_0")
    paths["gguf_q4_0"] = export_gguf(BUNDLED, out / "d4.gguf", "q4_0")
    wide = hf_moe.build("qwen3_moe", out, moe_intermediate_size=256, intermediate_size=128)  # whole Q8_0 blocks per rank, >= 4 KB
    paths["gguf_moe_q8_0"] = export_gguf(wide, out / "m8.gguf", "q8_0")
    return paths


LOGITS = ("qwen3", "qwen2", "qwen3_gqa3", "llama", "phi3", "phi3_partial", "qwen3_5", "qwen3_next", "qwen3_next_moe",
          "qwen3_moe", "qwen3_5_moe_mtp", "gguf_f32", "gguf_hybrid_f32")


def test_two_ranks_equal_one_process(checkpoints, tmp_path):
    from turbospec.model import load_model

    prompt = [int(t) for t in IDS[:12]]
    jobs = [(n, str(checkpoints[n]), "logits", None) for n in LOGITS]
    jobs.append(("qwen3-gloo", str(checkpoints["qwen3"]), "logits", None))
    jobs.append(("gguf_moe_q8_0", str(checkpoints["gguf_moe_q8_0"]), "logits-budget", None))
    jobs += [("q8_0", str(checkpoints["qwen3"]), "greedy", (prompt, "q8_0", ())),
             ("mtp", str(BUNDLED), "greedy", (prompt, None, ("draft-mtp",))),
             ("mtp-full-vocab", str(BUNDLED), "greedy", (prompt, None, ("draft-mtp",), 0)),
             ("hybrid-mtp", str(HYBRID), "greedy", (prompt, "q8_0", ("draft-mtp",))),
             ("gguf-q8_0-mtp", str(checkpoints["gguf_q8_0"]), "greedy", (prompt, None, ("draft-mtp",))),
             ("gguf-q4_0", str(checkpoints["gguf_q4_0"]), "greedy", (prompt, None, ())),
             ("rank0-decides", str(BUNDLED), "sampled", (prompt, 7)),
             ("moe", str(checkpoints["qwen3_moe"]), "greedy-moe", (prompt, None, ())),
             ("gguf-moe-q8_0", str(checkpoints["gguf_moe_q8_0"]), "greedy-moe", (prompt, None, ())),
             ("hybrid-moe-mtp", str(checkpoints["qwen3_5_moe_mtp"]), "greedy-moe", (prompt, None, ("draft-mtp",)))]
    ranks = run_ranks(tmp_path, jobs)
    for n in LOGITS:
        one = load_model(checkpoints[n], "float32")
        ref = full_logits(one, IDS)
        for r in ranks:
            # float32 sums in another order (each rank's part, then the parts): dense logits differ by < 3e-7, the
            # hybrids' (whose chunked delta rule amplifies it) by up to 2e-5 at logits up to 3.3, i.e. < 1e-5 of the
            # logits' scale
            assert (r[n] - ref).abs().max().item() < 1e-5 * max(1.0, ref.abs().max().item()), n
        assert torch.equal(ranks[0][n], ranks[1][n]), n  # gathered logits: the same bits on every rank
        assert max(r[n + ":bytes"] for r in ranks) < 0.75 * one.weight_bytes, n  # each rank holds its part
    for r in ranks:
        assert (r["qwen3-gloo"] - ranks[0]["qwen3"]).abs().max().item() < 1e-5
    # packed experts of a GGUF file on demand (a rank's rows: views of the mapping; its columns: copies)
    ref = full_logits(load_model(checkpoints["gguf_moe_q8_0"], "float32"), IDS)
    for r in ranks:
        assert (r["gguf_moe_q8_0"] - ref).abs().max().item() < 1e-5 * max(1.0, ref.abs().max().item())

    def plain(path, cache_type=None):
        from turbospec.model import load_model

        return greedy(load_model(path, "float32"), str(path), prompt, cache_type, ())

    want = {"q8_0": plain(checkpoints["qwen3"], "q8_0"), "mtp": plain(BUNDLED), "hybrid-mtp": plain(HYBRID, "q8_0"),
            "gguf-q8_0-mtp": plain(checkpoints["gguf_q8_0"]), "gguf-q4_0": plain(checkpoints["gguf_q4_0"])}
    want["mtp-full-vocab"] = want["mtp"]
    want["rank0-decides"] = greedy(load_model(BUNDLED, "float32"), str(BUNDLED), prompt, None, (), seed=7)
    assert greedy(load_model(BUNDLED, "float32"), str(BUNDLED), prompt, None, (), seed=1007) != want["rank0-decides"]
    for key, tokens in want.items():
        assert len(tokens) == 24
        for r in ranks:
            assert r[key] == tokens, key  # lossless drafting, sharded MTP layers included
    # mixture-of-experts decode steps: each layer's attention in one call, then the experts' part and one sum
    for key, path, kv in (("moe", "qwen3_moe", None), ("gguf-moe-q8_0", "gguf_moe_q8_0", None),
                          ("hybrid-moe-mtp", "qwen3_5_moe_mtp", None)):
        tokens = plain(checkpoints[path], kv)
        for r in ranks:
            assert r[key][0] == tokens and r[key][1] > 0, key


def test_rank0_decides_adaptive_drafts_and_the_batch(tmp_path):
    """What a rank times or draws for itself never steers the others: with adaptive speculation rank 0's choice of
    a step (draft length, probe, idle steps after) is every rank's, though rank 1's own controller would never
    draft (without the agreement its steps would not match rank 0's); in a continuous batch every sequence's
    sampled tokens are rank 0's (rank 1 draws with other seeds) and rank 0's draft gate decides."""
    from turbospec.model import load_model

    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 128, (n,), generator=g).tolist() for n in (12, 30, 7)]
    jobs = [("adaptive", str(BUNDLED), "adaptive", prompts[0]),
            ("batch-sampled", str(BUNDLED), "batch", (prompts, [7, 8, None])),
            ("batch-adaptive", str(BUNDLED), "batch", (prompts, [None] * 3, ("draft-mtp",), True))]
    ranks = run_ranks(tmp_path, jobs)
    one = load_model(BUNDLED, "float32")
    plain = batched(one, str(BUNDLED), prompts, [None] * 3)[0]
    sampled = batched(one, str(BUNDLED), prompts, [7, 8, None])[0]
    assert batched(one, str(BUNDLED), prompts, [1007, 1008, None])[0][:2] != sampled[:2]  # rank 1's own draws
    for r in ranks:
        assert r["adaptive"][0] == plain[0] and r["batch-adaptive"][0] == plain
        assert r["batch-sampled"][0] == sampled
    for key in ("adaptive", "batch-adaptive"):
        assert ranks[0][key][1] == ranks[1][key][1] > 0, key  # rank 1 verified rank 0's drafts


def test_split_must_divide(hf_models):
    from turbospec.model.config import ModelConfig
    from turbospec.model.loader import load_config
    from turbospec.parallel.tp import shard_config

    cfg = load_config(hf_models["qwen3"])  # 4 heads, 2 KV heads, 96 wide
    local = shard_config(cfg, 2)
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size) == (2, 1, 48)
    four = shard_config(cfg, 4)  # 2 KV heads over 4 ranks: each KV head on two ranks
    assert (four.num_heads, four.num_kv_heads) == (1, 1)
    with pytest.raises(TurboSpecError, match="not a multiple of num_key_value_heads"):
        shard_config(cfg, 3)
    hybrid = shard_config(load_config(HYBRID), 2)  # 4 key / 4 value heads
    assert (hybrid.linear_dims()["num_k_heads"], hybrid.linear_dims()["num_v_heads"]) == (2, 2)
    raw = {**load_config(HYBRID).raw, "linear_num_key_heads": 1, "linear_num_value_heads": 2}
    with pytest.raises(TurboSpecError, match="does not divide linear_num_key_heads"):
        shard_config(ModelConfig.from_dict(raw), 2)


def test_stacked_gate_up_experts_split_by_halves(hf_models):
    """transformers-5's stacked `experts.gate_up_proj` [E, 2I, H]: a rank takes its rows of the gate half and the
    same rows of the up half (the tiny checkpoints store experts one by one, so no model test reaches this)."""
    from turbospec.model.loader import WeightSource, load_config
    from turbospec.parallel.tp import ShardedSource, shard_config

    cfg = load_config(hf_models["qwen3"])
    local = shard_config(cfg, 2)
    name = "model.layers.0.mlp.experts.gate_up_proj"
    for rank, want in ((0, [(0, 16), (32, 48)]), (1, [(16, 32), (48, 64)])):
        source = ShardedSource(WeightSource(hf_models["qwen3"]), rank, 2, local, cfg.num_kv_heads)
        assert source._split(name, (32, 64)) == (0, want, (64, 64))


def test_fused_qkv_split_by_heads(hf_models):
    """Phi-3's qkv_proj [q (4 heads x 16) | k (2 heads) | v (2 heads)]: a rank takes its query heads and the KV head
    they read -- over 4 ranks each KV head goes to two ranks (as KV_ROWS); the rows taken are the stored ones."""
    from turbospec.model.loader import WeightSource, load_config
    from turbospec.parallel.tp import ShardedSource, shard_config

    cfg = load_config(hf_models["phi3"])
    name = "model.layers.0.self_attn.qkv_proj.weight"
    whole = WeightSource(hf_models["phi3"]).get(name, torch.float32)
    for ranks, want in ((2, [[(0, 32), (64, 80), (96, 112)], [(32, 64), (80, 96), (112, 128)]]),
                        (4, [[(0, 16), (64, 80), (96, 112)], [(16, 32), (64, 80), (96, 112)],
                             [(32, 48), (80, 96), (112, 128)], [(48, 64), (80, 96), (112, 128)]])):
        local = shard_config(cfg, ranks)
        rows = local.q_size + 2 * local.kv_size
        for rank in range(ranks):
            source = ShardedSource(WeightSource(hf_models["phi3"]), rank, ranks, local, cfg.num_kv_heads)
            assert source._split(name, (rows, 64)) == (0, want[rank], (128, 64))
            got = source.get(name, torch.float32, (rows, 64))
            assert torch.equal(got, torch.cat([whole[a:b] for a, b in want[rank]]))


def test_a_rank_reads_its_part_only(hf_models):
    """`WeightSource.shard` along rows and columns, in one range or several: the parts put back together are the
    stored tensor."""
    from turbospec.model.loader import WeightSource

    ws = WeightSource(hf_models["qwen3"])
    for name, dim in (("model.layers.0.self_attn.q_proj.weight", 0), ("model.layers.0.mlp.down_proj.weight", 1)):
        whole = ws.get(name, torch.float32)
        n = whole.shape[dim] // 2
        parts = [ws.shard(name, dim, [(r * n, (r + 1) * n)], torch.float32, tuple(whole.shape)) for r in range(2)]
        assert all(p.shape[dim] == n for p in parts)
        assert torch.equal(torch.cat(parts, dim), whole)
        two = ws.shard(name, dim, [(0, 2), (n, n + 3)], None, tuple(whole.shape))
        assert torch.equal(two, torch.cat([whole.narrow(dim, 0, 2), whole.narrow(dim, n, 3)], dim))
    with pytest.raises(TurboSpecError, match="shape mismatch"):
        ws.shard("model.layers.0.mlp.down_proj.weight", 1, [(0, 1)], torch.float32, (1, 1))


@pytest.mark.parametrize("parallel", [1, 3])
def test_serve_under_torchrun(parallel, tmp_path):
    """`turbospec serve --tp 2` (two ranks under torchrun) on the hybrid model with MTP drafting, one request at a
    time and with continuous batching (-np 3, adaptive: rank 0's draft gate decides): rank 0 answers with the single process's greedy text (three clients
    at once with -np 3), a client that leaves mid-stream stops every rank (the next request still agrees), a server
    idle for longer than the collectives' timeout still answers, and Ctrl-C ends every rank. Slot save / restore: each
    rank writes and reads its own file; a rank's file missing, or files of two saves mixed, are one-line errors
    that change no rank's cache."""
    import signal
    import subprocess
    import sys
    import time
    from concurrent.futures import ThreadPoolExecutor

    httpx = pytest.importorskip("httpx")
    from tests.test_server_cancel import _free_port
    from turbospec.engine import build_engine

    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TURBOSPEC_TP_TIMEOUT": "8"}
    cmd = [sys.executable, "-m", "turbospec.cli", "serve", "--tp", "2", "-m", str(HYBRID), "-c", "2048", "--port",
           str(port), "--spec-type", "draft-mtp", "-np", str(parallel), "--slot-save-path", str(tmp_path)] + (
               ["--spec-adaptive"] if parallel > 1 else [])
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    prompts = ["def fib(n):", "The river", "import os\n"]

    def complete(prompt: str, cached: list | None = None) -> str:
        body = {"prompt": prompt, "max_tokens": 24, "temperature": 0}
        got = httpx.post(url + "/v1/completions", json=body, timeout=60).json()
        if cached is not None:
            cached.append(got["timings"]["cache_n"])
        return got["choices"][0]["text"]

    def slot(action: str, name: str | None = None):
        return httpx.post(f"{url}/slots/0?action={action}", json={} if name is None else {"filename": name},
                          timeout=60)

    try:
        deadline = time.time() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.time() < deadline, "server did not start"
            time.sleep(0.5)
        with ThreadPoolExecutor(3) as pool:
            first = list(pool.map(complete, prompts if parallel > 1 else prompts[:1]))
        with httpx.stream("POST", url + "/v1/completions", timeout=60,
                          json={"prompt": prompts[0], "max_tokens": 1500, "ignore_eos": True, "stream": True}) as r:
            for i, _ in enumerate(r.iter_lines()):
                if i > 4:
                    break  # the client leaves
        time.sleep(10)  # idle past TURBOSPEC_TP_TIMEOUT: the other rank waits for the next request, not a collective
        again = complete(prompts[0])
        saved = [slot("save", name).json() for name in ("a.bin", "b.bin")]
        files = sorted(p.name for p in tmp_path.iterdir())
        assert slot("erase").status_code == 200
        restored = slot("restore", "a.bin").json()
        cached: list[int] = []
        resumed = complete(prompts[0] + again + " # next", cached)  # (a hybrid resumes where the saved context ends)
        (tmp_path / "a.bin.tp1").write_bytes((tmp_path / "b.bin.tp1").read_bytes())  # rank 1's part of another save
        mixed = slot("restore", "a.bin")
        (tmp_path / "a.bin.tp1").unlink()
        missing = slot("restore", "a.bin")
        after = complete(prompts[1])
        health = httpx.get(url + "/health", timeout=5).json()
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            out = proc.communicate(timeout=60)[0]
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out = proc.communicate()[0]
            raise AssertionError("the ranks did not stop on Ctrl-C:\n" + out[-2000:]) from None
    engine = build_engine(EngineConfig(model=str(HYBRID), ctx=2048))
    want = ["".join(c.text for c in engine.stream(p, SamplingParams(temperature=0, max_tokens=24))) for p in prompts]
    assert first == want[:len(first)] and again == want[0], out[-2000:]
    assert files == ["a.bin", "a.bin.tp1", "b.bin", "b.bin.tp1"] and saved[0]["n_saved"] > 0, saved
    follow_up = "".join(c.text for c in engine.stream(prompts[0] + want[0] + " # next",
                                                      SamplingParams(temperature=0, max_tokens=24)))
    assert restored["n_restored"] == saved[0]["n_saved"] and cached[0] > 0 and resumed == follow_up
    assert mixed.status_code == 400 and "different saves" in mixed.json()["error"]["message"]
    assert missing.status_code == 404 and "rank 1: slot file 'a.bin.tp1' not found" in missing.json()["error"]["message"]
    assert after == want[1]  # the ranks still in step
    assert (health["running"], health["waiting"]) == (0, 0)
    assert "turbospec serve: model 'turbospec-tiny-hybrid'" in out and "tensor parallel 2" in out
    # Ctrl-C reaches torchrun's agent too, which reports it as its own failure (rc 1): what matters is that every
    # rank ended (communicate returned) instead of waiting on a collective


def test_bench_under_torchrun(tmp_path):
    """`torchrun ... bench`: every rank measures in step, rank 0 alone writes the report (marked with the TP size)."""
    import json
    import subprocess
    import sys

    out = tmp_path / "rep"
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
                        "-m", "turbospec.cli", "bench", "-m", str(BUNDLED), "-p", "8", "-n", "4",
                        "-r", "1", "--warmup", "0", "-t", "1", "--out", str(out), "-q"],
                       env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stderr.count("wrote ") == 1
    report = json.loads((out / "report.json").read_text())
    assert report["env"]["tensor_parallel"] == 2 and report["rows"][0]["decode_tps"] > 0


def test_a_dead_rank_ends_the_job(tmp_path):
    """Rank 1 of a torchrun server killed: the job ends (torchrun stops rank 0, reporting the failed rank) within
    seconds, no rank left waiting on a collective."""
    import signal
    import subprocess
    import sys
    import time

    httpx = pytest.importorskip("httpx")
    psutil = pytest.importorskip("psutil")
    from tests.test_server_cancel import _free_port

    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                             "--standalone", "-m", "turbospec.cli", "serve", "-m", str(BUNDLED), "-t", "1",
                             "--port", str(port)], env={**os.environ, "OMP_NUM_THREADS": "1"},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.time() + 120
        while True:
            assert proc.poll() is None, proc.communicate()[0][-3000:]
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.time() < deadline, "server did not start"
            time.sleep(0.5)
        ranks = {int(p.environ().get("RANK", -1)): p for p in psutil.Process(proc.pid).children(recursive=True)
                 if "RANK" in p.environ()}
        ranks[1].kill()
        out = proc.communicate(timeout=90)[0]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode != 0 and "rank      : 1" in out
    assert not ranks[0].is_running()


@pytest.mark.parametrize("spec, match", [(SpecConfig(types=("medusa",)), "Medusa")])
def test_what_tensor_parallelism_refuses(monkeypatch, spec, match):
    """Medusa heads (the whole LM head) are a one-line error under tensor parallelism, before anything loads."""
    from turbospec.engine.build import load_parts
    from turbospec.parallel import tp

    monkeypatch.setattr(tp, "init_from_env", lambda: (0, 2))
    monkeypatch.setattr(tp, "shard_view", lambda: (lambda cfg, ws: (cfg, ws)))
    with pytest.raises(TurboSpecError, match=match):
        load_parts(EngineConfig(model=str(BUNDLED), spec=spec))
