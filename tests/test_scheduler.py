"""Continuous batching: the paged KV pool and kernel, and the scheduler against one-sequence-at-a-time decoding.

Every sequence's greedy output in a batch (mixed prompt lengths, arrival times, KV formats, preemption, aborts)
must equal the same request run alone through `Engine` (float32)."""

import importlib.util
import random
from pathlib import Path

import pytest
import torch

from turbospec.config import EngineConfig
from turbospec.engine.engine import Engine
from turbospec.engine.scheduler import Scheduler
from turbospec.errors import TurboSpecError
from turbospec.kernels import attention as fused
from turbospec.kv.formats import get_format
from turbospec.kv.kernel_args import attention_spec
from turbospec.kv.paged import BlockPool, OutOfBlocks, PagedSequence, pool_for
from turbospec.model.registry import load_model
from turbospec.sampling import SamplingParams
from turbospec.tokenizer import Tokenizer

TINY = Path(__file__).resolve().parents[1] / "models" / "turbospec-tiny"
HYBRID = TINY.parent / "turbospec-tiny-hybrid"
pytestmark = pytest.mark.skipif(not (TINY / "config.json").exists(), reason="no bundled model")


@pytest.fixture(scope="module")
def model():
    return load_model(str(TINY), torch.float32)


@pytest.fixture(scope="module")
def hybrid():
    return load_model(str(HYBRID), torch.float32)


def _hybrid_scheduler(m, positions, kv=None, *, max_seqs=4, step=96, snapshots=8, **kw):
    pool = pool_for(m, positions, kv, kv, layers=m.num_attn_layers)
    return Scheduler(m, pool, max_seqs=max_seqs, max_step_tokens=step, ctx=2048,
                     states=m.new_state_pool(max_seqs, snapshots), **kw)


def _solo(model, prompts, params, kv=None, tokenizer=None):
    eng = Engine(model, tokenizer, EngineConfig(ctx=2048, cache_type_k=kv, cache_type_v=kv, prefix_cache=False))
    out = []
    for p, sp in zip(prompts, params):
        chunks = list(eng.stream(p, sp))
        out.append(([t for c in chunks for t in c.tokens], "".join(c.text for c in chunks),
                    eng.last_stats.finish_reason))
    return out


def _drive(sch, arrivals):
    """Run the scheduler; arrivals[i] = (step at which request i is added, prompt, params). Returns per request
    (tokens, text, finish reason, chunks)."""
    seqs: dict[int, object] = {}
    got: dict[int, list] = {}
    step = 0
    pending = sorted(range(len(arrivals)), key=lambda i: arrivals[i][0])
    while pending or sch.has_work:
        while pending and arrivals[pending[0]][0] <= step:
            i = pending.pop(0)
            seqs[i] = sch.add(arrivals[i][1], arrivals[i][2])
            got[i] = []
        for o in sch.step():
            i = next(k for k, s in seqs.items() if s is o.seq)
            if o.chunk is not None:
                got[i].append(o.chunk)
        step += 1
    return {i: ([t for c in got[i] for t in c.tokens], "".join(c.text for c in got[i]), seqs[i].stats.finish_reason,
                got[i], seqs[i]) for i in seqs}


def _requests(seed, n, vocab=900):
    rnd = random.Random(seed)
    prompts = [[rnd.randrange(3, vocab) for _ in range(rnd.choice([2, 9, 40, 300, 700]))] for _ in range(n)]
    params = [SamplingParams(max_tokens=rnd.randrange(1, 40), temperature=0, ignore_eos=True) for _ in range(n)]
    steps = [rnd.randrange(0, 30) for _ in range(n)]
    return prompts, params, steps


# ---- the paged kernel ----------------------------------------------------------------------------------------
@pytest.mark.skipif(fused.load() is None, reason="attention kernel not available on this machine")
@pytest.mark.parametrize("name", ["f32", "bf16", "f16", "q8_0", "q4_0", "tbq4_0", "turbo3", "turbo4"])
def test_paged_kernel_equals_contiguous_attention(name):
    """Sequences scattered over shuffled blocks give exactly what the contiguous kernel gives (block = tile)."""
    g = torch.Generator().manual_seed(1)
    fmt, d, kvh, rows, block = get_format(name), 64, 2, 3, 256
    spec = attention_spec(fmt, d)
    lens = [1, 255, 256, 700]
    nblocks = sum(-(-n // block) for n in lens) + 2
    perm = torch.randperm(nblocks, generator=g).tolist()
    width = fmt.padded_dim(d)
    kbuf = fmt.allocate(d, (kvh, nblocks * block))
    vbuf = fmt.allocate(d, (kvh, nblocks * block))
    tables, qs, refs, used = [], [], [], 0
    for n in lens:
        nb = -(-n // block)
        blocks = perm[used:used + nb]
        used += nb
        k, v = torch.randn(kvh, n, d, generator=g), torch.randn(kvh, n, d, generator=g)
        kp, vp = fmt.encode(k), fmt.encode(v)
        for j, b in enumerate(blocks):
            s, e = j * block, min(n, (j + 1) * block)
            for f in kp:
                kbuf[f][:, b * block:b * block + e - s] = kp[f][:, s:e]
                vbuf[f][:, b * block:b * block + e - s] = vp[f][:, s:e]
        q = torch.randn(kvh, rows, width, generator=g) * 0.3
        m, lsum, acc = fused.partial(q, spec, [kp[f] for f in spec[2]], spec, [vp[f] for f in spec[2]], width, 0, n)
        refs.append(acc / lsum.unsqueeze(-1))
        qs.append(q)
        tables.append(blocks + [-1] * (4 - nb))
    out = fused.paged(torch.stack(qs), spec, [kbuf[f] for f in spec[2]], spec, [vbuf[f] for f in spec[2]], width,
                      torch.tensor(tables, dtype=torch.int32), torch.tensor(lens, dtype=torch.int64), block)
    for i, ref in enumerate(refs):
        assert torch.equal(out[i], ref), f"sequence {i} ({lens[i]} positions)"


@pytest.mark.skipif(fused.load() is None, reason="attention kernel not available on this machine")
@pytest.mark.parametrize("block", [4, 256])
def test_paged_kernel_masks_a_trees_other_branches(block):
    """A draft tree's rows through the paged kernel with their ancestor masks: each row attends to the committed
    positions and to its own ancestors among the tree's, as the contiguous kernel over exactly those positions does
    (to float rounding: the tiles split differently); masks of -1 give the unmasked rows bit for bit. With blocks of
    4 some of a row's tiles hold only other branches' positions."""
    from turbospec.kv.paged import _ancestor_masks

    g = torch.Generator().manual_seed(2)
    fmt, d, kvh, rows = get_format("f32"), 64, 2, 3
    spec = attention_spec(fmt, d)
    parents = [-1, 0, 0, 1, 1, 2, 5, 3, 3, 0]  # the root (the last committed token's row), then 9 drafts
    committed, n = 37, 10
    total = committed + n
    nb = -(-total // block)
    table = torch.randperm(nb + 3, generator=g)[:nb].tolist()
    kbuf, vbuf = fmt.allocate(d, (kvh, (nb + 3) * block)), fmt.allocate(d, (kvh, (nb + 3) * block))
    k, v = torch.randn(kvh, total, d, generator=g), torch.randn(kvh, total, d, generator=g)
    for j, b in enumerate(table):
        s, e = j * block, min(total, (j + 1) * block)
        kbuf[spec[2][0]][:, b * block:b * block + e - s] = k[:, s:e]
        vbuf[spec[2][0]][:, b * block:b * block + e - s] = v[:, s:e]
    q = torch.randn(n, kvh, rows, d, generator=g) * 0.3
    tables = torch.tensor([table] * n, dtype=torch.int32)
    lens = torch.tensor([committed + i + 1 for i in range(n)], dtype=torch.int64)
    masks = torch.tensor(_ancestor_masks(parents), dtype=torch.int64)
    out = fused.paged(q, spec, [kbuf[spec[2][0]]], spec, [vbuf[spec[2][0]]], d, tables, lens, block, masks)
    for i in range(n):
        seen, a = [], i
        while a >= 0:
            seen.append(committed + a)
            a = parents[a]
        idx = torch.tensor(list(range(committed)) + sorted(seen))
        m, lsum, acc = fused.partial(q[i], spec, [k[:, idx]], spec, [v[:, idx]], d, 0, len(idx))
        torch.testing.assert_close(out[i], acc / lsum.unsqueeze(-1), rtol=1e-5, atol=1e-6)
    plain = fused.paged(q, spec, [kbuf[spec[2][0]]], spec, [vbuf[spec[2][0]]], d, tables, lens, block)
    assert torch.equal(fused.paged(q, spec, [kbuf[spec[2][0]]], spec, [vbuf[spec[2][0]]], d, tables, lens, block,
                                   torch.full((n,), -1, dtype=torch.int64)), plain)
    assert not torch.allclose(out[4:], plain[4:])  # rows with other branches before them attend differently


@pytest.mark.skipif(fused.load() is None, reason="attention kernel not available on this machine")
@pytest.mark.parametrize("kv", ["f32", "bf16", "q8_0", "turbo3"])
def test_chain_rows_attend_as_the_steps_that_decode_them(kv):
    """A chain of drafts to verify (a causal segment of up to STEP_ROWS rows), beside another sequence's decode row,
    attends in the paged kernel row by row, each row over the positions up to its own: bit for bit what the
    single-token steps that decode those rows one by one give (and the same pool bytes); a longer segment (a prompt
    chunk) keeps the gathered path."""
    from turbospec.kv.paged import STEP_ROWS, PagedBatch, Segment
    from turbospec.kv.plan import AttentionPlan

    g = torch.Generator().manual_seed(0)
    kvh, h, d, n = 2, 4, 64, 4
    cast = torch.bfloat16 if kv == "bf16" else torch.float32

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(cast)

    q, k, v, qb, kb, vb = rand(h, n, d), rand(kvh, n, d), rand(kvh, n, d), rand(h, n, d), rand(kvh, n, d), \
        rand(kvh, n, d)
    outs, pools = [], []
    for together in (True, False):
        pool = BlockPool(1, kvh, d, 8, k_type=kv, v_type=kv)
        a, b = PagedSequence(pool, 2048), PagedSequence(pool, 2048)
        gc = torch.Generator().manual_seed(1)
        for s, m in ((a, 300), (b, 40)):  # committed positions: a crosses a block boundary
            s.begin(m)
            pool.store(0, torch.randn(kvh, m, d, generator=gc).to(cast), torch.randn(kvh, m, d, generator=gc).to(cast),
                       s.slots(0, m))
            s.commit()
        if together:  # one step: a's chain of n rows and b's decode row
            batch = PagedBatch(pool, [Segment(a, 0, n, AttentionPlan.causal(300, n)),
                                      Segment(b, n, 1, AttentionPlan.causal(40, 1))])
            assert not batch.others and batch.decode_only
            o = batch.attend(0, torch.cat([q, qb[:, :1]], 1), torch.cat([k, kb[:, :1]], 1),
                             torch.cat([v, vb[:, :1]], 1), 0.125)
            outs.append(o[:, :n])
            batch.commit()
        else:  # a's rows one step each
            rows = []
            for i in range(n):
                batch = PagedBatch(pool, [Segment(a, 0, 1, AttentionPlan.causal(300 + i, 1))])
                rows.append(batch.attend(0, q[:, i:i + 1], k[:, i:i + 1], v[:, i:i + 1], 0.125))
                batch.commit()
            outs.append(torch.cat(rows, 1))
        pools.append([t[0][:, a.slots(0, 300 + n)].clone() for t in (*pool.k.values(), *pool.v.values())])
    assert torch.equal(outs[0], outs[1])
    assert all(torch.equal(x, y) for x, y in zip(*pools))
    pool = BlockPool(1, kvh, d, 8, k_type=kv, v_type=kv)
    long = PagedSequence(pool, 2048)
    assert PagedBatch(pool, [Segment(long, 0, STEP_ROWS + 1, AttentionPlan.causal(0, STEP_ROWS + 1))]).others


# ---- blocks ----------------------------------------------------------------------------------------------------
def test_pool_blocks_are_allocated_freed_and_refused():
    pool = BlockPool(2, 1, 8, 3, k_type="f32", v_type="f32", block=4)
    a, b = PagedSequence(pool, 100), PagedSequence(pool, 100)
    a.begin(5)  # two blocks
    a.commit()
    assert len(a.blocks) == 2 and pool.num_free == 1
    assert b.can_grow(4) and not b.can_grow(5)
    with pytest.raises(OutOfBlocks):
        b.begin(5)
    assert pool.num_free == 1 and b.blocks == []
    a.truncate(3)
    assert len(a.blocks) == 1 and pool.num_free == 2
    a.reset()
    assert pool.num_free == 3 and a.length == 0
    with pytest.raises(TurboSpecError, match="context full"):
        PagedSequence(pool, 4).begin(5)


def test_commit_keep_moves_the_accepted_positions():
    pool = BlockPool(1, 1, 8, 4, k_type="f32", v_type="f32", block=4)
    s = PagedSequence(pool, 16)
    s.begin(3)
    slots = s.slots(0, 3)
    pool.store(0, torch.arange(24.0).view(1, 3, 8), -torch.arange(24.0).view(1, 3, 8), slots)
    s.commit()
    s.begin(4)  # a tree step of 4 nodes at positions 3..6, keep nodes 1 and 3
    vals = 100 + torch.arange(32.0).view(1, 4, 8)
    pool.store(0, vals, -vals, s.slots(3, 7))
    s.commit([1, 3])
    assert s.length == 5 and len(s.blocks) == 2
    k, v = pool.gather(0, s.slots(0, 5))
    assert torch.equal(k[0, 3], vals[0, 1]) and torch.equal(k[0, 4], vals[0, 3]) and torch.equal(v[0, 4], -vals[0, 3])
    assert torch.equal(k[0, :3], torch.arange(24.0).view(3, 8))


# ---- the scheduler against solo decoding ------------------------------------------------------------------------
@pytest.mark.parametrize("kv", [None, "q8_0", "q4_0", "tbq4_0", "turbo3", "turbo4"])
def test_batched_greedy_equals_solo(model, kv):
    prompts, params, steps = _requests(0 if kv is None else 1, 8)
    want = _solo(model, prompts, params, kv)
    pool = pool_for(model, 4096, kv, kv)
    sch = Scheduler(model, pool, max_seqs=4, max_step_tokens=96, ctx=2048)
    got = _drive(sch, list(zip(steps, prompts, params)))
    for i, w in enumerate(want):
        assert got[i][0] == w[0], f"request {i}: prompt {len(prompts[i])} tokens"
    assert pool.num_free == pool.num_blocks  # every block back


@pytest.mark.parametrize("which,kv,dtype", [
    ("dense", None, torch.float32), ("dense", "q4_0", torch.float32), ("dense", "turbo3", torch.float32),
    ("dense", None, torch.bfloat16), ("dense", "q4_0", torch.bfloat16), ("dense", "turbo3", torch.bfloat16),
    ("hybrid", "turbo3", torch.float32), ("hybrid", None, torch.bfloat16),  # gated attention, GDN layers between
])
def test_one_call_paged_decode_equals_the_general_path(which, kv, dtype, monkeypatch):
    """Decode rows over a paged pool in one kernel call per layer (`block._paged_rows`): the same pool bytes and
    logprobs as the op-by-op path (attn_in, PagedBatch.attend)."""
    from turbospec.layers import block

    m = load_model(str(TINY if which == "dense" else HYBRID), dtype)
    prompts, params, steps = _requests(3, 5)
    params = [SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2) for _ in params]
    runs, taken = [], []
    real = block._paged_rows

    def counted(attn, cache):
        taken.append(r := real(attn, cache))
        return r

    for fused_rows in (True, False):
        monkeypatch.setattr(block, "_paged_rows", counted if fused_rows else (lambda attn, cache: False))
        if which == "dense":
            sch = Scheduler(m, pool_for(m, 4096, kv, kv), max_seqs=4, max_step_tokens=96, ctx=2048)
        else:
            sch = _hybrid_scheduler(m, 4096, kv)
        pool = sch.pool
        got = _drive(sch, list(zip(steps, prompts, params)))
        runs.append(([g[0] for g in got.values()], [[c.logprobs for c in g[3]] for g in got.values()],
                     [t.clone() for t in (*pool.k.values(), *pool.v.values())]))
    assert any(taken)  # the one-call path ran
    assert runs[0][0] == runs[1][0] and runs[0][1] == runs[1][1]
    assert all(torch.equal(a, b) for a, b in zip(runs[0][2], runs[1][2]))


def test_preemption_recomputes_without_changing_outputs(model):
    rnd = random.Random(2)
    # four prompts that fill a block each, then grow past it: a 4-block pool must preempt to go on
    prompts = [[rnd.randrange(3, 900) for _ in range(250 - i)] for i in range(4)] + [[7, 8, 9]]
    params = [SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)] * 5
    want = _solo(model, prompts, params)
    pool = pool_for(model, 1024, None, None)
    sch = Scheduler(model, pool, max_seqs=6, max_step_tokens=64, ctx=1024)
    got = _drive(sch, [(0, p, sp) for p, sp in zip(prompts, params)])
    assert sch.preemptions > 0
    for i, w in enumerate(want):
        assert got[i][0] == w[0]
    assert pool.num_free == pool.num_blocks


def test_abort_frees_blocks_and_leaves_the_others_alone(model):
    prompts, params, _ = _requests(3, 3)
    params = [SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)] * 3
    want = _solo(model, prompts, params)
    pool = pool_for(model, 4096, None, None)
    sch = Scheduler(model, pool, max_seqs=3, max_step_tokens=4096, ctx=2048)
    seqs = [sch.add(p, sp) for p, sp in zip(prompts, params)]
    toks: dict[int, list[int]] = {0: [], 1: [], 2: []}
    for _ in range(5):
        for o in sch.step():
            toks[seqs.index(o.seq)] += o.chunk.tokens if o.chunk else []
    held = len(seqs[1].cache.blocks)
    assert held > 0
    sch.abort(seqs[1])
    free_before = pool.num_free
    outs = sch.step()
    for o in outs:
        if o.seq is not seqs[1] and o.chunk:
            toks[seqs.index(o.seq)] += o.chunk.tokens
    ended = [o for o in outs if o.seq is seqs[1]]
    assert ended and ended[0].finished and ended[0].chunk is None and seqs[1].stats.finish_reason == "abort"
    assert pool.num_free >= free_before + held - 2  # its blocks are back (the others may have grown by one each)
    n1 = len(toks[1])
    while sch.has_work:
        for o in sch.step():
            assert o.seq is not seqs[1]
            toks[seqs.index(o.seq)] += o.chunk.tokens if o.chunk else []
    assert len(toks[1]) == n1 < 30
    assert toks[0] == want[0][0] and toks[2] == want[2][0]
    assert pool.num_free == pool.num_blocks


def test_text_stops_and_logprobs_match_solo(model):
    tok = Tokenizer(str(TINY))
    texts = ["Once upon a time", "def add(a, b):", "The quick brown fox", "1, 2, 3, 4,"]
    prompts = [tok.encode(t) for t in texts]
    params = [SamplingParams(max_tokens=24, temperature=0),
              SamplingParams(max_tokens=24, temperature=0, stop=["\n", "  "]),
              SamplingParams(max_tokens=24, temperature=0, logprobs=2),
              SamplingParams(max_tokens=0, temperature=0, prompt_logprobs=1)]
    eng = Engine(model, tok, EngineConfig(ctx=2048, prefix_cache=False))
    want = [list(eng.stream(p, sp)) + [eng.last_stats.finish_reason] for p, sp in zip(prompts, params)]
    sch = Scheduler(model, pool_for(model, 2048, None, None), max_seqs=4, max_step_tokens=8, ctx=2048, tokenizer=tok,
                    eos=eng.eos_ids())
    got = _drive(sch, [(i, p, sp) for i, (p, sp) in enumerate(zip(prompts, params))])
    for i, w in enumerate(want):
        chunks, reason = w[:-1], w[-1]
        assert got[i][1] == "".join(c.text for c in chunks), texts[i]
        assert got[i][2] == reason
        assert [t for c in chunks for t in c.tokens] == got[i][0]
    lp_want = [lp for c in want[2][:-1] for lp in (c.logprobs or [])]
    lp_got = [lp for c in got[2][3] for lp in (c.logprobs or [])]
    assert [x.token for x in lp_got] == [x.token for x in lp_want]
    assert [x.logprob for x in lp_got] == pytest.approx([x.logprob for x in lp_want], abs=1e-5)
    pl_want, pl_got = want[3][0].prompt_logprobs, got[3][3][0].prompt_logprobs
    assert pl_got[0] is None and len(pl_got) == len(pl_want) == len(prompts[3])
    assert [x.logprob for x in pl_got[1:]] == pytest.approx([x.logprob for x in pl_want[1:]], abs=1e-5)


def test_prefix_cache_reuses_blocks_and_gives_the_cold_output(model):
    """A follow-up turn (the previous prompt + answer + more) shares the cached full blocks, copies the start of the
    previous turn's last, partly filled block, and decodes exactly what a cold run does; blocks no one holds stay
    cached and are evicted (least recently used) under pressure."""
    rnd = random.Random(5)
    first = [rnd.randrange(3, 900) for _ in range(600)]
    sp = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    pool = pool_for(model, 2048, None, None)  # 8 blocks
    sch = Scheduler(model, pool, max_seqs=4, max_step_tokens=256, ctx=2048)
    a = _drive(sch, [(0, first, sp)])[0][0]
    # 619 positions computed (the last sampled token never is): 2 full blocks and the partial third stay cached
    assert pool.num_cached == 3 and pool.num_free == pool.num_blocks
    second = first + a + [rnd.randrange(3, 900) for _ in range(100)]
    other = [rnd.randrange(3, 900) for _ in range(300)]
    want = _solo(model, [second, other], [sp, sp])
    got = _drive(sch, [(0, second, sp), (0, other, sp)])
    assert got[0][4].stats.cached_tokens == 619 and got[1][4].stats.cached_tokens == 0
    assert sch.prefix_hits == 619 and sch.prefix_queries == len(first) + len(second) + len(other)
    assert [got[0][0], got[1][0]] == [want[0][0], want[1][0]]
    again = _drive(sch, [(0, second, sp)])[0]
    assert again[4].stats.cached_tokens == len(second) - 1  # its own previous run's partial block: all but one
    assert again[0] == want[0][0]
    edited = second[:700] + [5, 6, 7] + second[700:]  # a change inside the cached partial block: its start is reused
    want_edited = _solo(model, [edited], [sp])[0][0]
    got_edited = _drive(sch, [(0, edited, sp)])[0]
    assert got_edited[4].stats.cached_tokens == 700 and got_edited[0] == want_edited
    # pressure: prompts that need every block evict the cached ones, and still decode correctly
    big = [[rnd.randrange(3, 900) for _ in range(1000)] for _ in range(2)]
    want_big = _solo(model, big, [sp, sp])
    got_big = _drive(Scheduler(model, pool, max_seqs=2, max_step_tokens=512, ctx=2048), [(0, b, sp) for b in big])
    assert [got_big[i][0] for i in range(2)] == [w[0] for w in want_big]
    assert pool.num_free == pool.num_blocks


def test_requests_that_cannot_run_get_one_line_errors(model):
    sch = Scheduler(model, pool_for(model, 512, None, None), max_seqs=2, ctx=2048)
    with pytest.raises(TurboSpecError, match="exceeds context size 512"):
        sch.add([5] * 500, SamplingParams(max_tokens=20))
    with pytest.raises(TurboSpecError, match="empty prompt"):
        sch.add([], SamplingParams())
    with pytest.raises(TurboSpecError, match="outside the vocabulary"):
        sch.add([5], SamplingParams(logit_bias={10**6: 1.0}))
    assert not sch.has_work


# ---- hybrid models: recurrent states per sequence, snapshots for the prefix cache --------------------------------
@pytest.mark.parametrize("kv", [None, "q8_0", "tbq4_0"])
def test_batched_hybrid_greedy_equals_solo(hybrid, kv):
    prompts, params, steps = _requests(4 if kv is None else 6, 8)
    want = _solo(hybrid, prompts, params, kv)
    sch = _hybrid_scheduler(hybrid, 4096, kv)
    got = _drive(sch, list(zip(steps, prompts, params)))
    for i, w in enumerate(want):
        assert got[i][0] == w[0], f"request {i}: prompt {len(prompts[i])} tokens"
    assert sch.pool.num_free == sch.pool.num_blocks and sch.states.num_free == sch.states.num_slots


def test_hybrid_preemption_recomputes_without_changing_outputs(hybrid):
    rnd = random.Random(7)
    prompts = [[rnd.randrange(3, 900) for _ in range(250 - i)] for i in range(4)] + [[7, 8, 9]]
    params = [SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)] * 5
    want = _solo(hybrid, prompts, params)
    sch = _hybrid_scheduler(hybrid, 1024, max_seqs=6, step=64)
    got = _drive(sch, [(0, p, sp) for p, sp in zip(prompts, params)])
    assert sch.preemptions > 0
    assert [got[i][0] for i in range(5)] == [w[0] for w in want]
    assert sch.states.num_free == sch.states.num_slots


def test_hybrid_prefix_resumes_from_a_snapshot_with_the_cold_output(hybrid):
    """A follow-up turn resumes where recurrent states were snapshotted — the previous turn's last computed position
    when the follow-up repeats all of it, else the previous prompt's end or a block boundary — and decodes what a
    cold run does; without snapshots (--ctx-checkpoints 0) nothing can be reused."""
    rnd = random.Random(8)
    first = [rnd.randrange(3, 900) for _ in range(600)]
    sp = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    sch = _hybrid_scheduler(hybrid, 2048)
    a = _drive(sch, [(0, first, sp)])[0][0]
    assert sch.states.num_snapshots == 3  # its newest: after 512 positions, before the prompt's last token (599),
    # and at its last computed position (619)
    second = first + a + [rnd.randrange(3, 900) for _ in range(200)]
    other = [rnd.randrange(3, 900) for _ in range(300)]
    want = _solo(hybrid, [second, other], [sp, sp])
    got = _drive(sch, [(0, second, sp), (0, other, sp)])
    assert got[0][4].stats.cached_tokens == 619 and got[1][4].stats.cached_tokens == 0
    assert sch.states.snapshot_hits == 1
    assert [got[0][0], got[1][0]] == [want[0][0], want[1][0]]
    # the previous answer edited at its end: back to the snapshot before the previous prompt's last token
    third = second + got[0][0][:-3] + [rnd.randrange(3, 900) for _ in range(50)]
    want3 = _solo(hybrid, [third], [sp])[0][0]
    got3 = _drive(sch, [(0, third, sp)])[0]
    assert got3[4].stats.cached_tokens == len(second) - 1 and got3[0] == want3
    again = _drive(sch, [(0, third, sp)])[0]  # the same prompt again: all but its last token
    assert again[4].stats.cached_tokens == len(third) - 1 and again[0] == want3
    # edited inside the first block: only a block boundary before the edit can be resumed (none here)
    edited = second[:100] + [5] + second[100:]
    assert _drive(sch, [(0, edited, sp)])[0][4].stats.cached_tokens == 0
    cold = _hybrid_scheduler(hybrid, 2048, snapshots=0)
    _drive(cold, [(0, first, sp)])
    redo = _drive(cold, [(0, second, sp)])[0]
    assert redo[4].stats.cached_tokens == 0 and redo[0] == want[0][0]


def test_state_pool_keeps_each_owners_newest_snapshots_and_the_most_recent():
    from turbospec.kv.state_pool import StatePool

    sp = StatePool(2, (3, 4), (1, 2, 2), torch.float32, slots=2, snapshots=3, per_owner=2)
    a, b = sp.acquire(), sp.acquire()
    with pytest.raises(TurboSpecError, match="no free recurrent-state slot"):
        sp.acquire()
    for key in ("a1", "a2", "a3"):  # one owner keeps its 2 newest
        sp.snapshot(key, a, owner=1)
    assert [sp.has(k) for k in ("a1", "a2", "a3")] == [False, True, True]
    sp.snapshot("b1", b, owner=2)
    sp.restore("a2", b)  # used: now the most recent, owned by no one
    sp.snapshot("b2", b, owner=2)  # the pool is full: the least recently used (a3) goes
    assert [sp.has(k) for k in ("a2", "a3", "b1", "b2")] == [True, False, True, True]
    sp.release(a)
    with pytest.raises(RuntimeError, match="released twice"):
        sp.release(a)
    assert sp.nbytes == 5 * 2 * (3 * 4 * 4 + 4 * 4)



def test_cache_mem_sizes_the_pool_after_the_recurrent_states(hybrid):
    """--cache-mem MiB: as many KV blocks as fit once the state slots and snapshots are reserved; too little is a
    one-line error."""
    eng = Engine(hybrid, None, EngineConfig(ctx=2048, cache_mem=8, ctx_checkpoints=2, cache_type_k="q8_0",
                                            cache_type_v="q8_0"))
    sch = Scheduler.for_engine(eng, 4)
    st, pool = sch.states, sch.pool
    assert (st.num_slots, st.max_snapshots, st.per_owner) == (4, 8, 2)
    assert pool.num_blocks == (8 * 2**20 - st.nbytes) // pool.bytes_per_block
    assert pool.num_blocks > 10 and pool.num_blocks * pool.bytes_per_block + st.nbytes <= 8 * 2**20
    with pytest.raises(TurboSpecError, match="leaves no room for a KV block"):
        Scheduler.for_engine(Engine(hybrid, None, EngineConfig(ctx=2048, cache_mem=1, ctx_checkpoints=8)), 8)


# ---- speculation in the batch -----------------------------------------------------------------------------------
def _spec_scheduler(m, path, spec, hybrid_model, positions=4096, max_seqs=4, step=96, adaptive=False, **cfg):
    from turbospec.config import SpecConfig
    from turbospec.speculative.registry import make_drafter, new_store

    sc = SpecConfig.parse(spec, **cfg)
    store = new_store(sc)
    pool = pool_for(m, positions, None, None, layers=m.num_attn_layers if hybrid_model else None)
    return Scheduler(m, pool, max_seqs=max_seqs, max_step_tokens=step, ctx=2048,
                     states=m.new_state_pool(max_seqs, 8) if hybrid_model else None,
                     drafters=lambda n: make_drafter(sc, m, n, model_path=str(path), store=store), n_max=sc.depth,
                     adaptive=adaptive)


@pytest.mark.parametrize("which,spec,cfg", [
    ("model", "ngram-mod", {}),
    ("model", "suffix", {"suffix_shared": True}),  # one store for all sequences: each drafts from the others too
    ("hybrid", "suffix", {"suffix_factor": 2.0, "suffix_p_min": 0.05}),  # trees over recurrent states
    ("model", "draft-mtp", {}),
    ("hybrid", "draft-mtp", {}),
    ("hybrid", "ngram,draft-mtp", {"mtp_topk": 2}),  # chains and trees in one batch
])
def test_batched_speculation_equals_plain_greedy(which, spec, cfg, request):
    """Every sequence drafts with its own drafter and its draft is verified in the step's one forward; each accepts
    its own length. Greedy outputs equal plain decoding alone, and drafts are accepted."""
    m = request.getfixturevalue(which)
    path = HYBRID if which == "hybrid" else TINY
    prompts, params, steps = _requests(0, 6)
    prompts = [p[:30] * 4 for p in prompts]  # repeats: the n-gram drafters fire too
    want = _solo(m, prompts, params)
    sch = _spec_scheduler(m, path, spec, which == "hybrid", **cfg)
    got = _drive(sch, list(zip(steps, prompts, params)))
    for i, w in enumerate(want):
        assert got[i][0] == w[0], f"request {i}"
    assert sum(got[i][4].stats.spec.accepted for i in got) > 0
    assert sch.steps < sum(p.max_tokens for p in params)  # fewer steps than tokens: several per step
    assert sch.pool.num_free == sch.pool.num_blocks


@pytest.mark.parametrize("which,spec,cfg,most", [
    ("model", "draft-mtp", {}, None),  # the bundled ranking: reduced vocabularies, their union read in one product
    ("model", "draft-mtp", {"draft_vocab": 0, "draft_k_type": "q8_0"}, None),  # the whole head; packed MTP caches
    ("hybrid", "draft-mtp", {"mtp_topk": 2}, None),  # trees
    ("hybrid", "draft-mtp", {"draft_vocab": 0}, None),
    ("model", "draft-mtp,ngram-mod", {}, None),  # chains: their MTP members together
    ("hybrid", "ngram,draft-mtp", {}, None),
    ("model", "draft-mtp", {}, 2),  # more drafters than one skinny call takes: in runs of that many rows
    ("model", "draft-mtp", {"draft_vocab": 0}, 2),
])
def test_batched_mtp_drafts_equal_each_drafters_own(which, spec, cfg, most, request, monkeypatch):
    """The MTP drafters of a batch draft together (one MTP forward per depth over every sequence, one draft-head
    product), chains of drafters member by member: every step's drafts equal those of the same drafters drafting one
    by one."""
    from turbospec import env
    from turbospec.engine import scheduler as sched
    from turbospec.model.mtp import MTPModule
    from turbospec.speculative.mtp import MTPDrafter

    m = request.getfixturevalue(which)
    path = HYBRID if which == "hybrid" else TINY
    prompts, params, steps = _requests(3, 6)
    prompts = [p[:30] * 4 for p in prompts]
    drafts: list[list] = []
    together = []
    propose_all, forward_many = sched.propose_all, MTPModule.forward_many

    def record(drafters, tokens, n_max):
        trees = propose_all(drafters, tokens, n_max)
        drafts[-1].append([(t.tokens, t.parents) for t in trees])
        return trees

    def count(self, tokens, hidden, plans, caches, counts, step=0, last_only=False):
        together.append(len(caches))
        return forward_many(self, tokens, hidden, plans, caches, counts, step, last_only)

    monkeypatch.setattr(sched, "propose_all", record)
    monkeypatch.setattr(MTPModule, "forward_many", count)
    if most is not None:
        monkeypatch.setattr(env, "SKINNY_MAX_ROWS", most)
    runs = []
    for alone in (False, True):
        if alone:
            monkeypatch.setattr(MTPDrafter, "batch_key", lambda self: None)
        drafts.append([])
        sch = _spec_scheduler(m, path, spec, which == "hybrid", **cfg)
        runs.append(_drive(sch, list(zip(steps, prompts, params))))
        if not alone:
            assert max(together) > 1  # several sequences' drafters in one forward
    assert drafts[0] == drafts[1] and sum(len(t) for step in drafts[0] for t, _ in step) > 0
    assert [runs[0][i][0] for i in range(6)] == [runs[1][i][0] for i in range(6)]


@pytest.mark.parametrize("which,kv", [("model", None), ("hybrid", None), ("hybrid", "q8_0")])
def test_mtp_forward_over_many_caches_equals_each_alone(which, kv, request):
    """`MTPModule.forward_many`: several sequences' rows, each over its own MTP cache (more rows than one fused call
    takes: in groups), give each sequence's `forward` outputs and cache contents to the bit."""
    from turbospec.kv.plan import AttentionPlan

    mtp = request.getfixturevalue(which).mtp
    g = torch.Generator().manual_seed(5)
    counts, before = [9, 9, 1, 5, 1], [3, 0, 17, 6, 2]  # rows per sequence now; positions already in its cache
    h = mtp.cfg.hidden_size
    caches = [[mtp.new_cache(64, k_type=kv, v_type=kv) for _ in counts] for _ in range(2)]
    for c0, c1, n in zip(*caches, before):  # the same history in both sets of caches
        if n:
            toks, hid = torch.randint(3, 900, (n,), generator=g), torch.randn(n, h, generator=g)
            for c in (c0, c1):
                mtp.forward(toks, hid, AttentionPlan.causal(0, n), c)
                c.commit()
    toks = torch.randint(3, 900, (sum(counts),), generator=g).tolist()
    hid = torch.randn(sum(counts), h, generator=g)
    plans = [AttentionPlan.causal(b, n) for b, n in zip(before, counts)]
    got = mtp.forward_many(toks, hid, plans, caches[0], counts, step=0)
    r = 0
    for i, n in enumerate(counts):
        want = mtp.forward(toks[r:r + n], hid[r:r + n], plans[i], caches[1][i])
        assert torch.equal(got[r:r + n], want), i
        for c in (caches[0][i], caches[1][i]):
            c.commit()
        assert caches[0][i].length == caches[1][i].length == before[i] + n
        r += n
    with torch.inference_mode():  # the next step attends over what both wrote
        one = [mtp.forward([toks[0]], hid[:1], AttentionPlan.causal(c.length, 1), c) for c in (caches[0][2], caches[1][2])]
    assert torch.equal(one[0], one[1])


@pytest.mark.parametrize("which,kv", [("model", None), ("hybrid", None), ("hybrid", "q8_0")])
def test_mtp_forward_of_last_rows_equals_the_whole(which, kv, request):
    """A drafter catching up (or fed its prompt window) reads only each sequence's last MTP row: `forward` with
    `out_rows` and `forward_many` with `last_only` give the whole forward's last rows and store the same K/V (the
    next step over the caches gives the same rows, to the bit), alone and for a batch: to the bit where one fused
    call takes the rows, within rounding for a longer chunk (the general path: products over fewer rows)."""
    from turbospec.kv.plan import AttentionPlan

    mtp = request.getfixturevalue(which).mtp
    g = torch.Generator().manual_seed(6)
    counts, before = [5, 1, 3, 40], [3, 9, 0, 4]
    h = mtp.cfg.hidden_size
    caches = [[mtp.new_cache(96, k_type=kv, v_type=kv) for _ in counts] for _ in range(3)]
    for cs in zip(*caches, before):
        n = cs[-1]
        toks, hid = torch.randint(3, 900, (n,), generator=g), torch.randn(n, h, generator=g)
        for c in cs[:-1]:
            if n:
                mtp.forward(toks, hid, AttentionPlan.causal(0, n), c)
                c.commit()
    toks = torch.randint(3, 900, (sum(counts),), generator=g).tolist()
    hid = torch.randn(sum(counts), h, generator=g)
    plans = [AttentionPlan.causal(b, n) for b, n in zip(before, counts)]
    batch = mtp.forward_many(toks[:9], hid[:9], plans[:3], caches[2][:3], counts[:3], last_only=True)
    assert batch.shape == (3, h)
    r = 0
    for i, n in enumerate(counts):
        whole = mtp.forward(toks[r:r + n], hid[r:r + n], plans[i], caches[0][i])
        last = mtp.forward(toks[r:r + n], hid[r:r + n], plans[i], caches[1][i], out_rows=1)
        assert last.shape == (1, h)
        if i < 3:
            assert torch.equal(last, whole[-1:]) and torch.equal(batch[i], whole[-1]), i
        else:  # (a chunk longer than one fused call, alone)
            torch.testing.assert_close(last, whole[-1:], rtol=1e-4, atol=1e-4)
            assert torch.equal(mtp.forward_many(toks[r:r + n], hid[r:r + n], plans[i:], caches[2][i:], [n],
                                                last_only=True), last)
        r += n
        nxt = []
        for c in (caches[0][i], caches[1][i], caches[2][i]):
            c.commit()
            assert c.length == before[i] + n
            with torch.inference_mode():  # the next step attends over what each wrote
                nxt.append(mtp.forward([toks[0]], hid[:1], AttentionPlan.causal(c.length, 1), c))
        assert torch.equal(nxt[0], nxt[1]) and torch.equal(nxt[0], nxt[2]), i


def test_draft_gate_drafts_while_drafting_steps_emit_faster():
    """--spec-adaptive in a batch: drafting until a plain step (the FIRST-th, then every PROBE-th) emits faster; then a
    drafting step every interval, the interval doubling up to PROBE_MAX while drafts do not pay; back on once they
    do."""
    from turbospec.speculative.batch_gate import FIRST, PROBE, PROBE_MAX, DraftGate

    g = DraftGate()

    def run(steps, draft_tps, plain_tps):  # a drafting step emits 8 tokens, a plain one 4
        modes = []
        for _ in range(steps):
            modes.append(d := g.draft())
            g.observe(d, 8 if d else 4, (8 / draft_tps) if d else (4 / plain_tps))
        return modes

    first = run(FIRST, 800, 1000)
    assert first == [True] * (FIRST - 1) + [False] and not g.on  # the first plain step: plain is faster
    off = run(1000, 800, 1000)
    assert g.interval == PROBE_MAX and 3 <= sum(off) <= 8  # drafting steps at 16, 32, 64, 128, 256, 256... apart
    back = run(PROBE_MAX, 1500, 1000)
    assert g.on and all(back[back.index(True) + 1:back.index(True) + PROBE - 1])
    g.observe(True, 0, 1.0)  # a step that emitted nothing (all sequences ended) teaches nothing
    assert g.on


@pytest.mark.parametrize("which", ["model", "hybrid"])
def test_batched_adaptive_speculation_equals_plain_greedy(which, request):
    """With the draft gate (--spec-adaptive), steps without drafts change no token: greedy outputs equal plain
    decoding alone, and the gate measured both kinds of step."""
    m = request.getfixturevalue(which)
    rnd = random.Random(4)
    prompts = [[rnd.randrange(3, 900) for _ in range(25)] * 3 for _ in range(3)]
    params = [SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)] * 3
    want = _solo(m, prompts, params)
    sch = _spec_scheduler(m, HYBRID if which == "hybrid" else TINY, "ngram,draft-mtp", which == "hybrid",
                          adaptive=True)
    got = _drive(sch, [(0, p, sp) for p, sp in zip(prompts, params)])
    assert [got[i][0] for i in range(3)] == [w[0] for w in want]
    assert sch.gate is not None and sch.gate.rate[True] > 0 and sch.gate.rate[False] > 0
    stats = [got[i][4].stats.spec for i in range(3)]
    assert all(st.skipped > 0 for st in stats) and sum(st.accepted for st in stats) > 0


def test_next_turn_takes_over_the_finished_turns_drafter(model):
    """A request that continues a finished one by a block or more (a conversation's next turn) takes over its
    model-free drafter, whose tables keep what the two share; another request gets a new one. Outputs equal plain
    greedy decoding."""
    rnd = random.Random(7)
    first = [rnd.randrange(3, 900) for _ in range(40)] * 8  # 320 tokens
    p = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    sch = _spec_scheduler(model, TINY, "ngram,suffix", False)
    a = sch.add(first, p)
    while sch.has_work:
        sch.step()
    second = a.tokens + [rnd.randrange(3, 900) for _ in range(10)]
    other = [rnd.randrange(3, 900) for _ in range(300)]
    b, c = sch.add(second, p), sch.add(other, p)
    while sch.has_work:
        sch.step()
    assert b.drafter is a.drafter and c.drafter is not a.drafter
    assert len(b.drafter.drafters[0]._seen) >= len(second)  # prompt lookup's table follows b's tokens now
    want = _solo(model, [second, other], [p, p])
    assert [b.tokens[b.prompt_len:], c.tokens[c.prompt_len:]] == [w[0] for w in want]
    assert len(sch._spare) == 2 and sum(len(t) for t, _ in sch._spare) <= sch.ctx


@pytest.mark.parametrize("which", ["model", "hybrid"])
def test_batched_speculation_survives_preemption(which, request):
    m = request.getfixturevalue(which)
    rnd = random.Random(10)
    prompts = [[rnd.randrange(3, 900) for _ in range(40)] * 5 for _ in range(4)]  # 200 tokens each, 4 blocks
    params = [SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)] * 4
    want = _solo(m, prompts, params)
    sch = _spec_scheduler(m, HYBRID if which == "hybrid" else TINY, "ngram,draft-mtp", which == "hybrid",
                          positions=1024, step=64, max_seqs=4)
    got = _drive(sch, [(0, p, sp) for p, sp in zip(prompts, params)])
    assert sch.preemptions > 0
    assert [got[i][0] for i in range(4)] == [w[0] for w in want]


@pytest.mark.parametrize("name,kv,triton", [("turbospec-tiny", None, False), ("turbospec-tiny", "tbq4_0", False),
                                            ("turbospec-tiny-hybrid", None, False), ("turbospec-tiny", None, True),
                                            ("turbospec-tiny-hybrid", None, True)])
def test_batched_equals_solo_without_the_cpp_kernels(monkeypatch, name, kv, triton):
    """A GPU's code path, where the C++ kernels do not run: the pool's torch paths, or (`triton`, in Triton's
    interpreter here) the Triton kernels with the decode rows of all sequences in one paged-attention launch. Three
    sequences batched give each the tokens it gets alone."""
    from turbospec import device
    from turbospec.kernels import gpu, triton_attention

    if triton and (importlib.util.find_spec("triton") is None or torch.cuda.is_available()):
        pytest.skip("the Triton kernels interpreted on the CPU: needs Triton, and a machine without a GPU")
    monkeypatch.setattr(device, "cpu_kernels", lambda: False)
    monkeypatch.setattr(gpu, "ON_CPU", triton)
    calls = []
    real = triton_attention.paged
    monkeypatch.setattr(triton_attention, "paged", lambda *a: calls.append(a[0].shape) or real(*a))
    m = load_model(str(TINY.parent / name), torch.float32)
    eng = Engine(m, None, EngineConfig(ctx=512, cache_type_k=kv, cache_type_v=kv))
    p = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = [[5, 9, 17, 33, 5, 9], [100, 3, 77, 3, 100, 3, 77, 8], list(range(40, 60))]
    solo = [eng.generate([q], p)[0]["tokens"] for q in prompts]
    sch = eng.new_scheduler(3)
    seqs = [sch.add(q, p) for q in prompts]
    while sch.has_work:
        sch.step()
    assert [s.tokens[s.prompt_len:] for s in seqs] == solo
    assert any(c[0] == 2 for c in calls) == triton  # two sequences' decode rows in one launch (the pool holds two)


def test_batched_speculation_on_the_gpu_path(monkeypatch):
    """On a GPU's code path (C++ kernels off, Triton interpreted here), verification rows attend over their
    committed positions in one Triton launch through the block table (no gather of them) and over their own rows in
    torch: batched MTP speculation gives each sequence plain greedy decoding's tokens alone."""
    from turbospec import device
    from turbospec.kernels import gpu
    from turbospec.kv.paged import PagedBatch

    if importlib.util.find_spec("triton") is None or torch.cuda.is_available():
        pytest.skip("the Triton kernels interpreted on the CPU: needs Triton, and a machine without a GPU")
    monkeypatch.setattr(device, "cpu_kernels", lambda: False)
    monkeypatch.setattr(gpu, "ON_CPU", True)
    used = []
    real = PagedBatch._segment_triton

    def counted(self, *a):
        out = real(self, *a)
        used.append(out is not None)
        return out

    monkeypatch.setattr(PagedBatch, "_segment_triton", counted)
    kv = "q8_0"  # (integer keys: the queries rounded as the kernels round them)
    m = load_model(str(TINY), torch.float32)
    rnd = random.Random(3)
    prompts = [[rnd.randrange(3, 900) for _ in range(6)] * 3 for _ in range(2)]
    params = [SamplingParams(max_tokens=6, temperature=0, ignore_eos=True) for _ in prompts]
    want = _solo(m, prompts, params, kv=kv)
    from turbospec.config import SpecConfig
    from turbospec.speculative.registry import make_drafter

    sc = SpecConfig.parse("draft-mtp")
    sch = Scheduler(m, pool_for(m, 1024, kv, kv), max_seqs=2, max_step_tokens=128, ctx=512,
                    drafters=lambda n: make_drafter(sc, m, n), n_max=sc.depth)
    got = _drive(sch, [(0, p, sp) for p, sp in zip(prompts, params)])
    assert [got[i][0] for i in range(2)] == [w[0] for w in want]
    assert sum(got[i][4].stats.spec.accepted for i in got) > 0 and any(used)
