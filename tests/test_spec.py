import itertools
import math
from pathlib import Path

import pytest
import torch

from turbospec.config import EngineConfig, SpecConfig
from turbospec.demo import make_demo_model, qwen3_config, random_qwen3_weights, write_checkpoint
from turbospec.engine import Engine
from turbospec.model import load_model
from turbospec.sampling import Sampler, SamplingParams
from turbospec.speculative import make_drafter
from turbospec.speculative.drafter import Drafter
from turbospec.speculative.tree import DraftTree
from turbospec.speculative.verify import verify

SHAPE = {"hidden_size": 48, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 12, "vocab_size": 64}


def add_mtp(w: dict, cfg: dict, seed: int = 3) -> None:
    """Random mtp.* weights: the MTP block is a Qwen3 decoder layer plus fc and three norms."""
    layer = random_qwen3_weights({**cfg, "num_hidden_layers": 1}, seed=seed, dtype=torch.float32)
    h = cfg["hidden_size"]
    for k, v in layer.items():
        if k.startswith("model.layers.0."):
            w["mtp.layers.0." + k[len("model.layers.0."):]] = v
    g = torch.Generator().manual_seed(seed)
    w["mtp.fc.weight"] = torch.randn(h, 2 * h, generator=g) * 0.1
    for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        w[f"mtp.{n}.weight"] = torch.ones(h)


def peaked_target(out: Path) -> Path:
    """A random target with an MTP block whose larger weights give peaked, repetitive distributions that drafts
    can hit."""
    cfg = qwen3_config(**SHAPE, mtp_num_hidden_layers=1)
    w = random_qwen3_weights(cfg, seed=11, dtype=torch.float32)
    for k in w:
        if k.endswith(("proj.weight", "embed_tokens.weight")):
            w[k] = w[k] * 12
    add_mtp(w, cfg)
    return write_checkpoint(out, cfg, w)


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    d = tmp_path_factory.mktemp("spec")
    target = peaked_target(d / "target")
    other = make_demo_model(d / "other", seed=5, **SHAPE)
    return {"target": target, "other": other}


PROMPTS = [[(7 * i + j) % 64 for j in range(10)] * 3 for i in range(6)] + [
    [(i * i + 3 * j) % 64 for j in range(17)] for i in range(6)]


def run(engine, prompt, params):
    return engine.generate([prompt], params)[0]["tokens"]


SPECS = ["ngram", "ngram-mod", "suffix", "draft-mtp", "draft-model", "ngram-mod,draft-mtp", "suffix,draft-mtp",
         "draft-model:self"]


@pytest.mark.parametrize("spec", SPECS)
def test_greedy_identical_to_plain(paths, spec):
    target = load_model(paths["target"], "float32")
    plain = Engine(target, None, EngineConfig(ctx=256, ubatch=8))
    draft_path = paths["target"] if spec.endswith(":self") else paths["other"]
    sc = SpecConfig.parse(spec.split(":")[0], n_max=4, draft_model=str(draft_path), ngram_mod_n_match=3)
    eng = Engine(target, None, EngineConfig(ctx=256, ubatch=8, spec=SpecConfig(n_max=4)), drafter=make_drafter(sc, target, 260))
    p = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    total = None
    for prompt in PROMPTS:
        assert run(eng, prompt, p) == run(plain, prompt, p), (spec, prompt)
        st = eng.last_stats.spec
        if total is None:
            total = st
        else:
            total.merge(st)
    assert total.drafts > 0
    if spec.endswith(":self"):
        assert total.acceptance_rate > 0.95  # the target drafting for itself is (almost) always right
    if spec.startswith(("ngram", "suffix")):
        assert total.accepted > 0


@pytest.mark.parametrize("hybrid", [False, True])
def test_draft_model_keeps_what_the_next_request_shares(paths, hybrid):
    """A request that continues the last (a conversation's next turn) feeds the draft model only its new tokens;
    the same prompt again nothing (a hybrid draft model resumes at the checkpoint of the prompt's end); another
    prompt starts over. Drafts equal a fresh drafter's, and greedy output stays plain decoding's."""
    from pathlib import Path

    draft = paths["other"]
    if hybrid:
        draft = Path(__file__).resolve().parents[1] / "models" / "turbospec-tiny-hybrid"
        if not (draft / "config.json").exists():
            pytest.skip("no bundled hybrid")
    target = load_model(str(draft) if hybrid else paths["target"], "float32")
    sc = SpecConfig.parse("draft-model", n_max=4, draft_model=str(draft))
    eng = Engine(target, None, EngineConfig(ctx=256, spec=SpecConfig(n_max=4)), drafter=make_drafter(sc, target, 260))
    plain = Engine(target, None, EngineConfig(ctx=256))
    d = eng.drafter
    fed = []
    feed = d._feed
    d._feed = lambda toks: (fed.append(len(toks)), feed(toks))[1]
    p = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    first = PROMPTS[0] + PROMPTS[6]
    out = run(eng, first, p)
    turn2 = first + out + [5, 9, 11]
    # at most: the answer's tokens not fed while drafting and the new message; nothing; all of it (begin feeds all
    # but the prompt's last token: it comes with the first draft's root)
    for prompt, most in ((turn2, len(out) + 2), (turn2, 0), (PROMPTS[3], len(PROMPTS[3]) - 1)):
        fed.clear()
        assert run(eng, prompt, p) == run(plain, prompt, p)
        assert (2 if most else 0) <= fed[0] <= most and (prompt != PROMPTS[3] or fed[0] == most)
        fresh = make_drafter(sc, target, 260)
        fresh.begin(prompt, None)
        d.begin(prompt, None)
        assert d.propose(prompt + [7], 4).tokens == fresh.propose(prompt + [7], 4).tokens


class TopKTreeDrafter(Drafter):
    """Test drafter: a tree from the target itself -- the top-2 at depth 1, then greedy chains under both."""

    name = "tree"
    needs_hidden = False

    def __init__(self, model):
        self.model = model

    def begin(self, tokens, hidden):
        pass

    def propose(self, tokens, n_max):
        from turbospec.kv.plan import AttentionPlan

        cache = self.model.new_cache(len(tokens) + 8)
        h = self.model.forward(torch.tensor(tokens), AttentionPlan.causal(0, len(tokens)), cache)
        cache.commit()
        top2 = self.model.logits(h[-1:])[0].topk(2).indices.tolist()
        # node 0: 2nd best (wrong branch first), node 1: best, node 2: a child of node 1
        h2 = self.model.forward(torch.tensor([top2[0]]), AttentionPlan.causal(cache.length, 1), cache)
        nxt = int(self.model.logits(h2)[0].argmax())
        tree = DraftTree([top2[1], top2[0], nxt], [-1, -1, 1], [None] * 3, "tree")
        return tree.truncate(max(1, min(3, n_max)))

    def accept(self, committed, hidden, next_token):
        pass


def test_tree_verification_greedy_identical(paths):
    target = load_model(paths["target"], "float32")
    plain = Engine(target, None, EngineConfig(ctx=256, ubatch=8))
    eng = Engine(target, None, EngineConfig(ctx=256, ubatch=8, spec=SpecConfig(n_max=3, adaptive=False)), drafter=TopKTreeDrafter(target))
    p = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    for prompt in PROMPTS[:4]:
        assert run(eng, prompt, p) == run(plain, prompt, p)
        st = eng.last_stats.spec
        assert st.accepted >= 2 * (st.drafts - 1)  # the best branch (second root child + its child) is taken


def _chi2_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    n = counts.sum()
    exp = probs * n
    keep = exp > 5
    stat = float((((counts - exp) ** 2) / exp)[keep].sum())
    dof = int(keep.sum()) - 1
    # Wilson-Hilferty normal approximation of the chi-square upper tail
    z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


@pytest.mark.parametrize("kind", ["one-hot", "q-chain", "tree"])
def test_sampling_verification_preserves_target_distribution(kind):
    V, N = 6, 12000
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, V, generator=g) * 1.5
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=123)
    sampler = Sampler(params)
    p = torch.softmax(logits, -1)
    q0 = torch.softmax(torch.randn(V, generator=g), -1)
    q1 = torch.softmax(torch.randn(V, generator=g), -1)
    counts = torch.zeros(V, V)
    for _ in range(N):
        if kind == "one-hot":
            tree = DraftTree.chain([int(p[0].argmax()), 2])
        elif kind == "q-chain":
            d0 = int(torch.multinomial(q0, 1, generator=g))
            d1 = int(torch.multinomial(q1, 1, generator=g))
            tree = DraftTree.chain([d0, d1], [q0, q1])
        else:
            tree = DraftTree([1, 3, 4], [-1, -1, 1], [None] * 3)
        path, nxt = verify(tree, logits if kind != "tree" else logits[[0, 1, 2, 2]], sampler)
        out = [tree.tokens[i] for i in path] + [nxt]
        # the second token's distribution depends on the path: compare only the first two emitted tokens'
        # joint when the first came from row 0 and the second from the row after it
        if len(out) >= 2:
            counts[out[0], out[1]] += 1
        else:
            counts[out[0], V - 1] += 0  # first token only: counted in the marginal below
    # marginal of the first emitted token must be p[0] -- recompute with an independent loop
    first = torch.zeros(V)
    sampler2 = Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=7))
    for _ in range(N):
        if kind == "q-chain":
            d0 = int(torch.multinomial(q0, 1, generator=g))
            tree = DraftTree.chain([d0], [q0])
        elif kind == "one-hot":
            tree = DraftTree.chain([int(p[0].argmax())])
        else:
            tree = DraftTree([1, 3], [-1, -1], [None] * 2)
        path, nxt = verify(tree, logits[:3] if kind != "tree" else logits[[0, 1, 2]], sampler2)
        first[([tree.tokens[i] for i in path] + [nxt])[0]] += 1
    assert _chi2_p(first, p[0]) > 1e-3


@pytest.mark.parametrize("kind", ["two-from-q", "q-and-one-hot", "three-different-q"])
def test_multi_draft_rejection_sampling_preserves_target_distribution(kind):
    """Several children with draft distributions (drawn independently, each from its q) are verified by recursive
    rejection: the first emitted token is still distributed as p, and the draft is accepted more often than one
    child alone would be."""
    V, N = 6, 12000
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(2, V, generator=g) * 1.5
    p = torch.softmax(logits[0], -1)
    qs = [torch.softmax(torch.randn(V, generator=g), -1) for _ in range(3)]
    sampler = Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=11))
    first = torch.zeros(V)
    accepted = 0
    for _ in range(N):
        if kind == "two-from-q":
            draws = [(int(torch.multinomial(qs[0], 1, generator=g)), qs[0]) for _ in range(2)]
        elif kind == "q-and-one-hot":
            draws = [(int(torch.multinomial(qs[0], 1, generator=g)), qs[0]), (int(p.argmax()), None)]
        else:
            draws = [(int(torch.multinomial(q, 1, generator=g)), q) for q in qs]
        tree = DraftTree([t for t, _ in draws], [-1] * len(draws), [q for _, q in draws])
        path, nxt = verify(tree, logits[[0] + [1] * len(draws)], sampler)
        first[([tree.tokens[i] for i in path] + [nxt])[0]] += 1
        accepted += bool(path)
    assert _chi2_p(first, p) > 1e-3
    one = float(torch.minimum(p, qs[0]).sum())  # one child from q0 is accepted with probability sum min(p, q0)
    assert accepted / N > one + 0.02


def test_chi2_detects_a_wrong_sampler():
    """Negative control: always accepting the draft is not distribution-preserving, and the test sees it."""
    V, N = 6, 12000
    g = torch.Generator().manual_seed(1)
    p = torch.softmax(torch.randn(V, generator=g) * 1.5, -1)
    q = torch.softmax(torch.randn(V, generator=g), -1)
    first = torch.zeros(V)
    for _ in range(N):
        first[int(torch.multinomial(q, 1, generator=g))] += 1  # 'accept everything' emits the draft as is
    assert _chi2_p(first, p) < 1e-6


class _Copied:
    """A draft head whose `take` copies rows (as off the CPU): the drafter uses the full head and a mask for large
    vocabularies."""

    takes_in_place = False

    def __init__(self, head):
        self.head, self.out_features = head, head.out_features

    def __call__(self, x):
        return self.head(x)

    def take(self, rows):
        return self.head.take(rows)


def test_mtp_reduced_draft_vocab_is_lossless(paths):
    target = load_model(paths["target"], "float32")
    plain = Engine(target, None, EngineConfig(ctx=256, ubatch=8))
    sc = SpecConfig.parse("draft-mtp", n_max=3, draft_vocab=32)
    drafter = make_drafter(sc, target, 260)
    eng = Engine(target, None, EngineConfig(ctx=256, ubatch=8, spec=SpecConfig(n_max=3, adaptive=False)), drafter=drafter)
    p = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    for prompt in PROMPTS[:6]:
        assert run(eng, prompt, p) == run(plain, prompt, p)
        # the head scores the 32 lowest ids (no ranking beside this model) plus the request's tokens so far: their
        # rows of the full head, read in place however many (on the CPU: no copy), every id only once all are in
        assert drafter.head_ids is not None
        assert set(range(32)) | set(prompt) <= set(drafter.head_ids) < set(range(target.cfg.vocab_size))
        assert drafter.head_ids == sorted(drafter._ids)
        assert drafter.head(torch.zeros(1, target.cfg.hidden_size)).shape == (1, len(drafter.head_ids))
    # where the rows would be a copy (weights off the CPU, packed), half the vocabulary or more is the full head
    # and a mask: ids outside the set are never drafted
    vocab = target.cfg.vocab_size
    drafter.full_head = _Copied(drafter.full_head)
    drafter._add_vocab(sorted(set(range(vocab)) - drafter._ids)[:1])
    assert 2 * len(drafter._ids) >= vocab and drafter.head_ids is None
    logits = drafter.head(torch.randn(1, target.cfg.hidden_size))[0]
    inside, outside = sorted(drafter._ids), sorted(set(range(vocab)) - drafter._ids)
    assert len(outside) > 3 and torch.isfinite(logits[inside]).all() and (logits[outside] == float("-inf")).all()
    drafter._add_vocab(outside[:3])  # new ids: unmasked in place
    logits = drafter.head(torch.randn(1, target.cfg.hidden_size))[0]
    assert drafter.head_ids is None and torch.isfinite(logits[outside[:3]]).all() and (logits[outside[3:]] == float("-inf")).all()
    # a small set: the reduced head (the 4 lowest ids, the prompt's and the outputs' tokens)
    small = make_drafter(SpecConfig.parse("draft-mtp", n_max=3, draft_vocab=4), target, 260)
    eng = Engine(target, None, EngineConfig(ctx=256, ubatch=8, spec=SpecConfig(n_max=3)), drafter=small)
    prompt = [5, 9, 40, 9, 5, 40]
    out = run(eng, prompt, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert out == run(plain, prompt, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert small.head_ids is not None and set(range(4)) | set(prompt) <= set(small.head_ids) <= (
        set(range(4)) | set(prompt) | set(out))
    assert small.head(torch.zeros(1, target.cfg.hidden_size)).shape == (1, len(small.head_ids))
    # the reduced head reads the full head's rows where they lie: the drafter holds their ids, not a copy
    h = torch.randn(1, target.cfg.hidden_size)
    assert torch.equal(small.head(h), small.full_head(h)[:, small.head_ids])
    assert small._reduced_head.nbytes <= 8 * len(small.head_ids)


def test_draft_vocab_ranking_and_drafter_mapping(paths, tmp_path):
    """draft_vocab.json ranks ids by their count in the given texts; a drafter built with it drafts token ids
    (not head rows) and stays lossless."""
    import json
    import shutil

    from tokenizers import Tokenizer as HFTokenizer

    from training.draft_vocab import rank_tokens
    from turbospec.model.draft_vocab import FILE, load

    model_dir = tmp_path / "m"
    shutil.copytree(paths["target"], model_dir)
    tok = HFTokenizer.from_file(str(Path("models/turbospec-tiny") / "tokenizer.json"))
    ranked, n = rank_tokens(tok, ["def f(x):\n    return x\n", "x = x + 1\n"], 64)
    counts = dict.fromkeys(range(64), 0)
    for text in ["def f(x):\n    return x\n", "x = x + 1\n"]:
        for t in tok.encode(text).ids:
            if t < 64:
                counts[t] += 1
    assert sorted(ranked) == list(range(64)) and n == sum(len(tok.encode(t).ids) for t in
                                                          ["def f(x):\n    return x\n", "x = x + 1\n"])
    assert all(counts[a] >= counts[b] for a, b in itertools.pairwise(ranked))
    target = load_model(model_dir, "float32")
    order = list(range(target.cfg.vocab_size))[::-1]  # a ranking that puts the highest ids first
    (model_dir / FILE).write_text(json.dumps({"ranked_ids": order}))
    assert load(model_dir) == order
    drafter = make_drafter(SpecConfig.parse("draft-mtp", n_max=3, draft_vocab=16), target, 260, str(model_dir))
    plain = Engine(target, None, EngineConfig(ctx=256, ubatch=8))
    eng = Engine(target, None, EngineConfig(ctx=256, ubatch=8, spec=SpecConfig(n_max=3, adaptive=False)), drafter=drafter)
    p = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    prompt = PROMPTS[0]
    assert run(eng, prompt, p) == run(plain, prompt, p)
    assert set(order[:16]) <= set(drafter.head_ids)


@pytest.mark.parametrize("hybrid", [False, True])
def test_mtp_topk_tree_is_lossless_and_branches(paths, hybrid, tmp_path):
    """MTP drafting a top-k tree (best candidate continued, the others leaves): greedy output equals plain
    greedy decoding, on a dense and on a hybrid target (per-node Gated DeltaNet states)."""
    if hybrid:
        from tests.hf_hybrid import build, to_multimodal

        target = load_model(to_multimodal(build("qwen3_5", tmp_path), tmp_path / "mm"), "float32")  # + mtp.*
        prompts = [[5, 9, 17, 33, 5, 9, 17, 33], [100, 3, 77, 3, 100], [1, 2, 3, 4, 5, 6]]
    else:
        target = load_model(paths["target"], "float32")
        prompts = PROMPTS[:4]
    plain = Engine(target, None, EngineConfig(ctx=256, ubatch=8))
    drafter = make_drafter(SpecConfig.parse("draft-mtp", n_max=3, mtp_topk=3), target, 260)
    trees = []
    propose = drafter.propose
    drafter.propose = lambda toks, n: trees.append(propose(toks, n)) or trees[-1]
    eng = Engine(target, None, EngineConfig(ctx=256, ubatch=8, spec=SpecConfig(n_max=3, adaptive=False)), drafter=drafter)
    p = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    for prompt in prompts:
        assert run(eng, prompt, p) == run(plain, prompt, p)
    assert any(t.parents == [-1, -1, -1, 0, 0, 0, 3, 3, 3] for t in trees)  # top-3 at each of 3 depths


def test_exact_bf16_weights_are_bit_identical_or_left_alone():
    from turbospec.layers.linear import Linear, exact_bf16

    g = torch.Generator().manual_seed(0)
    w = torch.randn(40, 24, generator=g).to(torch.bfloat16).to(torch.float32)  # bf16 values held in float32
    lin = Linear(w)
    small = exact_bf16(lin)
    assert small is not lin and small.weight.dtype == torch.bfloat16
    for rows in (1, 4, 40):  # skinny kernel and the prefill GEMM
        x = torch.randn(rows, 24, generator=g)
        assert torch.equal(small(x), lin(x))
    rough = Linear(torch.randn(40, 24, generator=g))  # not bf16-representable: untouched
    assert exact_bf16(rough) is rough
    tall = torch.randn(30000, 24, generator=g).to(torch.bfloat16).to(torch.float32)  # checked in 3 row chunks
    tall[-1, 5] += 1e-4  # one value off the bf16 grid, in the last chunk
    late = Linear(tall)
    assert exact_bf16(late) is late


def test_every_spec_type_has_a_registered_drafter():
    from turbospec.config import SPEC_TYPES
    from turbospec.speculative import DRAFTERS

    assert set(SPEC_TYPES) == set(DRAFTERS)


def test_ngram_mod_pool_is_per_request_unless_shared():
    """One request's text never drafts the next request's tokens (a cross-client leak and timing channel),
    unless the pool is shared on purpose (llama.cpp's behaviour)."""
    from turbospec.speculative.ngram import NgramMod

    secret = [7, 8, 9, 10, 11, 12]
    for shared, want in ((False, []), (True, [11, 12])):
        d = NgramMod(n_match=3, n_max=4, pool_bits=10, shared=shared)
        d.begin(secret, None)  # client A's request
        d.begin([1, 2], None)  # client B's request starts
        assert d.propose([1, 2, 8, 9, 10], 4).tokens[:2] == want


# ---- adaptive speculation ---------------------------------------------------------------------------------------
def test_controller_turns_drafting_off_when_it_does_not_pay_and_probes_with_backoff():
    from turbospec.speculative.adaptive import (
        FIRST_HITS,
        FIRST_VERIFIED_DEPTH,
        PROBE_MAX,
        PROBE_MIN,
        Controller,
        StepCosts,
    )

    costs = StepCosts([1.0, 1.05, 1.1, 1.15], draft=0.02)
    ctl = Controller(costs, 3)
    for _ in range(2):  # a request's first two steps are plain: their cost at this depth is measured
        assert ctl.choose(3) == 0
        costs.observe(0, 1.0, 0.0, 0)
    for _ in range(FIRST_HITS):  # until FIRST_HITS drafts hit, the drafts asked for are probes (not verified)
        assert ctl.choose(3) == 1 and ctl.shadow
        ctl.observe(1, 1)  # ... and this one hit
    assert ctl.choose(3) == FIRST_VERIFIED_DEPTH and not ctl.shadow  # a verified draft, 1 token deep until one hits
    ctl.observe(FIRST_VERIFIED_DEPTH, FIRST_VERIFIED_DEPTH)
    assert ctl.choose(3) == 3 and not ctl.shadow  # the evidence and the prior (0.8 per position) pay for all of it
    ctl.costs = StepCosts([1.0, 1.2, 1.3, 1.4], draft=0.05)  # dearer verification: misses do not pay
    for _ in range(20):  # drafts that always miss
        ctl.observe(ctl.choose(3) or 1, 0)
    steps = [ctl.choose(3) for _ in range(PROBE_MIN)]
    assert steps[:-1] == [0] * (PROBE_MIN - 1) and steps[-1] == 1  # off, then one short probe
    ctl.observe(1, 0)  # the probe missed: the next one comes twice as late
    assert ctl.probe == 2 * PROBE_MIN
    for _ in range(12):
        for _ in range(ctl.probe):
            k = ctl.choose(3)
        ctl.observe(k, 0)
    assert ctl.probe == PROBE_MAX and ctl.off_steps > 100
    for _ in range(PROBE_MAX + 40):  # drafts that always hit (from the next probe on): back on at full length
        k = ctl.choose(3)
        if k:
            ctl.observe(k, k)
    assert ctl.choose(3) == 3 and ctl.probe == PROBE_MIN


def test_unreached_positions_drift_back_to_the_position_before():
    """Drafts whose second token missed leave that position's estimate low; while only the first position is drafted
    (and hits), the second's old evidence ages as a reached position's does, so its estimate returns towards the
    first's and deeper drafts are tried again (kept as it was, it stayed low for the rest of the request)."""
    from turbospec.speculative.adaptive import Controller, StepCosts

    ctl = Controller(StepCosts([1.0, 1.02, 1.04, 1.06], draft=0.01), 3)
    for _ in range(6):
        ctl.observe(3, 1)  # the first token hits, the second misses (the third is not reached)
    assert ctl.accept[0] > 0.9 and ctl.accept[1] < 0.3
    for _ in range(20):
        ctl.observe(1, 1)  # 1-deep drafts that hit
    a = ctl.accept
    assert a[0] > 0.95 and a[1] > 0.8 * a[0] and a[2] > 0.8 * a[1]


def test_controller_rarely_probes_where_no_draft_could_pay():
    """Where a verification row and a draft cost more than the plain step they would save (a model whose weights sit
    in the cache), even drafts that always hit would not pay: probes come every PROBE_MAX steps, hits or not."""
    from turbospec.speculative.adaptive import PROBE_MAX, Controller, StepCosts

    ctl = Controller(StepCosts([1.0, 2.2, 3.4, 4.6], draft=0.3), 3)
    assert not ctl.could_pay(3)
    probes = []
    for i in range(3 * PROBE_MAX + 10):
        k = ctl.choose(3)
        if k:
            probes.append(i)
            ctl.observe(k, k)  # every probe hits
    assert len(probes) == 3 and all(b - a >= PROBE_MAX for a, b in zip(probes, probes[1:]))
    assert ctl.off_steps >= 3 * PROBE_MAX - 8


def test_probes_cost_at_most_a_share_of_what_drafting_could_gain():
    """Probes are spaced so that their timed cost is at most PROBE_SHARE of what drafting could at best gain over the
    plain steps between them: a probe that costs 30 plain steps, where drafts could at best make decoding 2.6x as
    fast, comes ~190 steps apart from the first, where the backoff alone probes after 8, 16, 32 ...; between probes
    the steps are idle (the controller asked once per READ steps). (A request's first drafts, asked for by the prior
    before any draft hit, are probes too -- each drafts from a drafter that kept up, not one catching up on the steps
    since the last: those are not spaced.)"""
    from turbospec.speculative.adaptive import PROBE_SHARE, READ, Controller, StepCosts

    costs = StepCosts([1.0, 1.2, 1.3, 1.4], draft=0.05)  # drafts that hit would pay: probes are worth making
    ctl = Controller(costs, 3)
    costs.observe(0, 1.0, 0.0, 0)
    assert costs.probe_interval(costs.gain_bound(3)) == 8  # no probe timed yet: the backoff's
    costs.observe_probe(30.0)
    gain = costs.gain_bound(3)
    floor = costs.probe_interval(gain)
    assert abs(gain - 4 / 1.55) < 1e-6 and floor == int(30.0 / (PROBE_SHARE * (gain - 1)))
    assert costs.probe_interval(1.0) > floor  # drafts that cannot gain: probes as rare as they come
    first, probes, asked, i = [], [], 0, 0
    while i < 1000:
        if ctl.idle:  # as the engine: idle steps are taken without asking
            ctl.idle -= 1
        else:
            asked += 1
            k = ctl.choose(3)
            if ctl.shadow:
                (probes if ctl.off_steps else first).append(i)
            if k:
                ctl.observe(k, 0)  # nothing hits
        i += 1
    assert 1 <= len(first) <= 4 and first == list(range(first[0], first[0] + len(first)))  # the prior's, in a row
    assert len(probes) >= 2 and probes[0] - first[-1] >= floor
    assert all(b - a >= floor for a, b in zip(probes, probes[1:]))
    assert asked <= 1000 // READ + 2 * len(probes) + len(first) + 8


def test_calibration_times_mtp_drafts_and_probes(paths):
    """Where the MTP drafts, the start-up calibration also times a drafted token and a probe (on a scratch drafter),
    so that a process's first request does not take drafts for free; they count as one observation."""
    from turbospec.speculative.adaptive import calibrate

    target = load_model(paths["target"], "float32")
    costs = calibrate(target, 3, SpecConfig.parse("ngram-mod,draft-mtp", adaptive=True), reps=2)
    assert costs.draft > 0 and costs.probe > 0 and costs.draft_prior == 1 and costs.probe_interval(2.0) >= 8
    plain = calibrate(target, 3, SpecConfig.parse("ngram-mod", adaptive=True), reps=2)
    assert plain.draft == 0 and plain.probe == 0 and plain.draft_prior == 0
    costs.observe(2, costs.step(2), 100 * costs.draft, 0)  # the first draft of a request (catching up): not counted
    before = costs.draft
    costs.observe(2, costs.step(2), 100 * costs.draft, 0)  # one odd draft: clipped to twice, weighed as a second
    assert abs(costs.draft - 1.5 * before) < 1e-12


def test_drafters_told_several_steps_at_once_draft_as_if_told_one_by_one(paths):
    """The engine tells the drafter the steps that drafting skipped in one call (before it next drafts): the MTP's
    state and next draft equal those after the same steps told one by one."""
    target = load_model(paths["target"], "float32")
    prompt = list(range(1, 21))
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(20, 48, generator=g)
    toks = [(5 * i + 3) % 64 for i in range(24)]  # 24 plain steps: each commits one token, its hidden row
    rows = [torch.randn(1, 48, generator=g) for _ in toks]
    nxt = 9
    seen = []
    for together in (False, True):
        d = make_drafter(SpecConfig.parse("ngram-mod,draft-mtp", mtp_prompt_window=0), target, 256)
        d.begin(prompt, hidden)
        if together:
            d.accept(toks, torch.cat(rows), nxt)
        else:
            for i, (t, h) in enumerate(zip(toks, rows)):
                d.accept([t], h, toks[i + 1] if i + 1 < len(toks) else nxt)
        tree = d.propose(prompt + toks + [nxt], 3)
        seen.append((tree.tokens, tree.parents, tree.source))
    assert seen[0] == seen[1] and len(seen[0][0]) > 0


def test_adaptive_engine_takes_idle_steps_without_bookkeeping(paths, monkeypatch):
    """While drafting is off the engine neither asks the controller nor tells the drafter step by step (on a small
    model that work cost ~2% of decoding): the controller is asked about once per READ steps and the drafter told
    once per HOLD steps; the output equals plain greedy decoding."""
    from turbospec.engine.engine import HOLD
    from turbospec.speculative.adaptive import READ, Controller, StepCosts

    target = load_model(paths["target"], "float32")
    plain = Engine(target, config=EngineConfig(ctx=512))
    eng = Engine(target, config=EngineConfig(ctx=512, spec=SpecConfig.parse("draft-mtp", adaptive=True)),
                 drafter=make_drafter(SpecConfig.parse("draft-mtp"), target, 520))
    eng.step_costs = StepCosts([1.0, 3.0, 5.0, 7.0], draft=1.0)  # verification rows 2x a step each: no draft pays
    eng.step_costs.observe = lambda *args: None
    calls = {"choose": 0, "accept": 0}
    choose, accept = Controller.choose, eng.drafter.accept

    def counted_choose(self, *args):
        calls["choose"] += 1
        return choose(self, *args)

    def counted_accept(*args):
        calls["accept"] += 1
        return accept(*args)

    monkeypatch.setattr(Controller, "choose", counted_choose)
    eng.drafter.accept = counted_accept
    sp = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
    assert run(eng, PROMPTS[0], sp) == run(plain, PROMPTS[0], sp)
    st = eng.last_stats.spec
    assert st.drafts == 0 and st.skipped >= 190
    assert calls["choose"] <= 200 // READ + 4 and calls["accept"] <= 200 // HOLD + 2


def test_step_costs_follow_the_measured_times():
    from turbospec.speculative.adaptive import StepCosts

    c = StepCosts([1.0, 1.2, 1.4])  # calibrated: 1 + 0.2 per row
    assert abs(c.step(0) - 1.0) < 1e-9 and abs(c.step(2) - 1.4) < 1e-9
    assert c.plain_is_stale(0)  # no plain step timed yet
    c.observe(0, 2.0, 0.0, depth=4096)  # a plain step at a new depth sets the plain cost (no clipping)
    assert c.step(0) == 2.0 and not c.plain_is_stale(4096) and c.plain_is_stale(8192) and c.plain_is_stale(0)
    assert abs(c.row - 0.4) < 1e-9  # ... and the row's, until one is measured there, grows as the plain step's did
    for _ in range(100):  # at that depth every verification row costs 1.0 more, drafts 0.3 per token
        c.observe(0, 2.0, 0.0, 4096)
        c.observe(1, 3.0, 0.3, 4096)
        c.observe(2, 4.0, 0.6, 4096)
    assert abs(c.plain - 2.0) < 1e-6 and abs(c.row - 1.0) < 0.01 and abs(c.draft - 0.3) < 1e-6
    assert abs(c.step(2) - (2.0 + 2 * 1.3)) < 0.05
    c.observe(1, 100.0, 0.3, 4096)  # a hiccup: clipped
    assert c.step(1) < 4.0
    row = c.row
    c.observe(0, 0.5, 0.0, 0)  # a new request's short context: measured again, the row scaled with it
    assert c.step(0) == 0.5 and abs(c.row - row / 4) < 1e-9
    c.observe(1, 0.7, 0.0, 0)  # the first verification there sets the row
    assert abs(c.row - 0.2) < 1e-9


def test_controller_stops_drafting_at_depth_after_few_misses():
    """Calibrated on a short context a verification row looks nearly free; at depth it costs a quarter of a plain
    step. A request there times its plain step (the row's cost, until measured, grows as the plain step's did), tries
    its first drafts as probes (one token that a plain step checks, no verification rows), verifies one draft once
    the misses outweigh the prior, reads that row against the plain step, and stops drafting (the row cost
    extrapolated from the calibration would have kept it drafting); then it probes 16, 32, 64 steps apart (the
    first probes all missed: the interval doubled once from 8)."""
    from turbospec.speculative.adaptive import FIRST_PROBES, PROBE_MIN, Controller, StepCosts

    costs = StepCosts([1.4, 1.5, 1.6, 1.7], draft=0.2)  # ms at a 32-token context
    ctl = Controller(costs, 3)
    steps = []
    for i in range(256):
        k = ctl.choose(3, 8192)
        if ctl.shadow:  # a probe: one drafted token compared with a plain step's (as the engine does)
            costs.observe(0, 7.5, 0.0, 8192)
            steps.append((i, "probe"))
        else:
            costs.observe(k, 7.5 + 2.0 * k, 0.4 * k, 8192)  # at 8K: a plain step 7.5 ms, each row 2 ms more
            if k:
                steps.append((i, k))
        if k:
            ctl.observe(k, 0)  # nothing hits
    assert costs.plain == 7.5 and abs(costs.row - 2.0) < 1e-6
    start = [(2 + j, "probe") for j in range(FIRST_PROBES)]  # (after the two plain steps that time the depth)
    last = 2 + FIRST_PROBES
    first = 2 * PROBE_MIN
    assert steps == start + [(last, 1), (last + first, "probe"), (last + 3 * first, "probe"),
                             (last + 7 * first, "probe"), (last + 15 * first, "probe")]
    assert ctl.off_steps > 240


@pytest.mark.parametrize("spec", ["ngram-mod", "draft-mtp"])
def test_adaptive_speculation_is_lossless_and_skips_drafts_that_do_not_pay(spec):
    """The engine drafts the length its cost model and the running acceptance pick: with verification rows and drafts
    a small share of a step (as the calibration measures them on this model, held fixed here: timed on a busy
    machine they vary) it drafts (the bundled model's greedy output repeats, so n-gram drafts hit too); with
    verification made to look expensive it stops drafting (undrafted steps, a probe now and then). Outputs equal
    plain greedy decoding."""
    from pathlib import Path

    from turbospec.engine.build import build_engine
    from turbospec.speculative.adaptive import StepCosts

    path = Path(__file__).resolve().parents[1] / "models" / "turbospec-tiny"
    if not (path / "config.json").exists():
        pytest.skip("no bundled model")
    plain = build_engine(EngineConfig(model=str(path), ctx=1024))
    eng = build_engine(EngineConfig(model=str(path), ctx=1024, spec=SpecConfig.parse(spec, adaptive=True)))
    assert eng.step_costs is not None and len(eng.step_costs.verify) == 4 and eng.step_costs.verify[0] > 0
    prompt = torch.randint(3, 900, (64,), generator=torch.Generator().manual_seed(1)).tolist()
    sp = SamplingParams(max_tokens=96, temperature=0, ignore_eos=True)
    want = [t for c in plain.stream(prompt, sp) for t in c.tokens]
    eng.step_costs = StepCosts([1.0, 1.1, 1.2, 1.3], draft=0.25, probe=0.4)
    eng.step_costs.observe = lambda *args: None  # (kept as set: no online correction)
    assert [t for c in eng.stream(prompt, sp) for t in c.tokens] == want
    assert eng.last_stats.spec.drafts > 0
    eng.step_costs = StepCosts([1.0, 3.0, 5.0, 7.0], draft=1.0)  # verification rows 2x a step each
    eng.step_costs.observe = lambda *args: None  # (kept as set: no online correction)
    assert [t for c in eng.stream(prompt, sp) for t in c.tokens] == want
    st = eng.last_stats.spec
    assert st.drafts == 0 and st.skipped > 80  # no step pays for a verification; the probes are checked for free


def test_first_miss_reads_where_the_best_candidates_stopped():
    """A top-2 tree of 3 depths (best candidates a, b, c; alternatives x, y, z): the spine accepted in a row, the
    position where the best candidate was not taken and the target's token there."""
    from turbospec.speculative.adaptive import first_miss
    from turbospec.speculative.tree import DraftTree

    tree = DraftTree([10, 90, 11, 91, 12, 92], [-1, -1, 0, 0, 2, 2])  # (a, x), (b, y) under a, (c, z) under b
    ranked = [[10, 90], [11, 91], [12, 92]]
    assert first_miss(tree, [0, 2, 4], 7, ranked) == (3, -1, 7)  # all best candidates taken: no miss
    assert first_miss(tree, [0, 2], 7, ranked) == (2, 2, 7)  # c rejected, the target's token is the bonus
    assert first_miss(tree, [0, 3], 7, ranked) == (1, 1, 91)  # b rejected, its alternative y taken (ends the path)
    assert first_miss(tree, [], 90, ranked) == (0, 0, 90)
    assert first_miss(tree, [0], 5, []) == (1, -1, 5)  # no ranked candidates known: nothing to learn


def test_controller_widens_the_tree_only_where_alternatives_pay():
    """Tree width follows the second candidates' hit rate against a row's cost: cheap rows and a second candidate
    the target takes where the best one misses -> two candidates per depth; alternatives that never hit, or
    rows as costly as a plain step -> chains."""
    from turbospec.speculative.adaptive import Controller, StepCosts

    def run(alt_hits: bool, row: float) -> int:
        ctl = Controller(StepCosts([1.0, 1.0 + row, 1.0 + 2 * row, 1.0 + 3 * row], draft=0.01), 3, width_max=2)
        assert ctl.width(3, 6) == 1  # nothing seen yet: no alternative is assumed to hit
        for i in range(40):  # the best candidate misses at position 0 half the time
            ctl.observe(3, 3 if i % 2 else 0)
            if not i % 2:
                ctl.observe_alternatives(0, [5, 6], 6 if alt_hits else 7)
        return ctl.width(3, 6)

    assert run(alt_hits=True, row=0.02) == 2
    assert run(alt_hits=False, row=0.02) == 1
    assert run(alt_hits=True, row=1.0) == 1
    ctl = Controller(StepCosts([1.0, 1.02, 1.04, 1.06]), 3, width_max=2)
    ctl.shadow = True
    assert ctl.width(1, 2) == 1  # a probe drafts one token


def test_adaptive_tree_width_is_lossless_and_widens_where_rows_are_cheap():
    """`--spec-mtp-topk 2 --spec-adaptive` on the bundled model: with the calibrated costs the tree's extra rows
    do not pay (few second candidates hit) and the steps draft chains; with rows made nearly free it drafts trees.
    Outputs equal plain greedy decoding either way."""
    from pathlib import Path

    from turbospec.engine.build import build_engine
    from turbospec.speculative.adaptive import StepCosts

    path = Path(__file__).resolve().parents[1] / "models" / "turbospec-tiny"
    if not (path / "config.json").exists():
        pytest.skip("no bundled model")
    plain = build_engine(EngineConfig(model=str(path), ctx=1024))
    eng = build_engine(EngineConfig(model=str(path), ctx=1024, spec=SpecConfig.parse("draft-mtp", mtp_topk=2,
                                                                                    adaptive=True)))
    prompt = torch.randint(3, 900, (48,), generator=torch.Generator().manual_seed(2)).tolist()
    sp = SamplingParams(max_tokens=96, temperature=0, ignore_eos=True)
    want = [t for c in plain.stream(prompt, sp) for t in c.tokens]
    eng.step_costs = StepCosts([1.0, 1.0001, 1.0002, 1.0003], draft=1e-4)  # a row: 1e-4 of a plain step
    eng.step_costs.observe = lambda *args: None
    assert [t for c in eng.stream(prompt, sp) for t in c.tokens] == want
    assert eng.last_stats.spec.trees > 0
    eng.step_costs = StepCosts([1.0, 1.5, 2.0, 2.5], draft=1e-4)  # a row: half a plain step
    eng.step_costs.observe = lambda *args: None
    assert [t for c in eng.stream(prompt, sp) for t in c.tokens] == want
    assert eng.last_stats.spec.trees == 0 and eng.last_stats.spec.drafts > 0


def test_mtp_catches_up_on_a_long_run_from_the_last_pairs_only(paths):
    """When another drafter of a chain drafted (here: 40 tokens accepted without the MTP drafting), the MTP feeds
    only the last CATCH_UP (hidden, token) pairs when it drafts next, at their true positions."""
    from turbospec.speculative.mtp import CATCH_UP

    target = load_model(paths["target"], "float32")
    d = make_drafter(SpecConfig.parse("draft-mtp", mtp_prompt_window=0), target, 256)
    prompt = list(range(1, 21))
    g = torch.Generator().manual_seed(0)
    d.begin(prompt, torch.randn(20, 48, generator=g))
    assert d.next_pos == 19  # (h_19, root) waits for the root
    run = [(5 * i) % 64 for i in range(40)]  # root + 39 accepted drafts
    d.accept(run, torch.randn(40, 48, generator=g), 7)
    assert len(d.pending_tokens) == CATCH_UP
    assert d.next_pos == 19 + 40 - CATCH_UP  # the first pair still waiting sits at its true position
    assert d.cache.length == 19  # nothing fed yet
    tree = d.propose(prompt + run + [7], 3)
    assert len(tree) == 3 and d.cache.length == 19 + CATCH_UP + 1


def test_mtp_begin_reads_the_window_rows_in_place(paths):
    """`begin` with the hidden rows of the prompt's window only (what the engine hands it after a long cached prompt)
    drafts as with the whole prompt's rows, and allocates nothing the size of the prompt: it once padded the rows
    with zeros to the whole prompt (at 262K positions of a 5120-wide model, gigabytes per request)."""
    from torch.profiler import ProfilerActivity, profile

    target = load_model(paths["target"], "float32")
    spec = SpecConfig.parse("draft-mtp", mtp_prompt_window=64)
    n, width = 6000, target.cfg.hidden_size
    prompt = [(7 * i + i // 64) % 61 + 3 for i in range(n)]
    hidden = torch.randn(n, width, generator=torch.Generator().manual_seed(0))
    trees = []
    for rows in (hidden, hidden[-65:].clone()):
        d = make_drafter(spec, target, n + 16)
        d.sampling(SamplingParams(temperature=0))
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            d.begin(prompt, rows)
        assert max(e.cpu_memory_usage for e in prof.events()) < n * width * 4 / 8
        assert d.next_pos == n - 1 and d.cache.length == 64
        tree = d.propose(prompt + [5], 3)
        trees.append(tree.tokens)
    assert trees[0] == trees[1] and len(trees[0]) == 3


def test_mtp_drafts_at_depth_build_no_rotary_tables(paths, monkeypatch):
    """The MTP reads the target's rotary tables: when a long prompt comes from the cache (nothing fed the MTP during
    prefill) its first drafts at depth build no tables (a table of its own, built for 4096 positions, was rebuilt for
    the whole context inside those drafts: 48 + 121 ms at 64K, which the adaptive cost model took for the drafts' cost
    and stopped drafting)."""
    from turbospec.layers.rope import Rope

    target = load_model(paths["target"], "float32")
    spec = SpecConfig.parse("draft-mtp")
    eng = Engine(target, config=EngineConfig(ctx=5200, spec=spec), drafter=make_drafter(spec, target, 5210))
    prompt = [(7 * i + i // 64) % 61 + 3 for i in range(5000)]
    sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    drafter, eng.drafter = eng.drafter, None
    run(eng, prompt, sp)  # plain: the prompt's KV is cached, the MTP has seen none of it
    eng.drafter = drafter
    builds = []
    build = Rope._build
    monkeypatch.setattr(Rope, "_build", lambda self, n: (builds.append(n), build(self, n)))
    run(eng, prompt, sp)
    assert eng.reused_tokens > 4096 and eng.last_stats.spec.drafts > 0 and builds == []


def test_mtp_sampled_drafts_carry_the_distribution_they_were_drawn_from(paths):
    """At T > 0 the MTP draws its drafts and hands their distribution over the whole vocabulary (reduced head rows
    mapped back to token ids) to the verifier; greedy requests keep argmax drafts without q."""
    target = load_model(paths["target"], "float32")
    sc = SpecConfig.parse("draft-mtp", n_max=3, draft_vocab=16, mtp_topk=2)
    d = make_drafter(sc, target, 256)
    prompt = list(range(1, 21))
    d.sampling(SamplingParams(temperature=0.9, top_k=0, top_p=1.0, min_p=0.0, seed=5))
    d.begin(prompt, torch.randn(20, 48, generator=torch.Generator().manual_seed(1)))
    tree = d.propose(prompt + [3], 3)
    assert len(tree) == 6
    for tok, q in zip(tree.tokens, tree.q):
        assert q is not None and q.shape == (64,) and abs(float(q.sum()) - 1) < 1e-5 and float(q[tok]) > 0
        assert set(torch.nonzero(q).flatten().tolist()) <= set(d.head_ids)
    d.sampling(SamplingParams(temperature=0))
    d.begin(prompt, torch.randn(20, 48, generator=torch.Generator().manual_seed(1)))
    assert all(q is None for q in d.propose(prompt + [3], 3).q)


def test_engines_interleaved_token_by_token_decode_as_alone(paths):
    """benchmarks/spec_speedup.py --lockstep: engines on one model decode the same request at once, each asked for
    its next token in turn -- each engine's tokens are those it makes alone (plain, always-drafting and adaptive
    MTP: nothing of one engine's request leaks into another's), and every engine gets decode time."""
    from benchmarks.spec_speedup import run_lockstep

    target = load_model(paths["target"], "float32")
    spec = SpecConfig.parse("draft-mtp", n_max=3)
    adaptive = SpecConfig.parse("draft-mtp", n_max=3, adaptive=True)

    def engine(cfg):
        drafter = make_drafter(cfg, target, 264) if cfg is not None else None
        return Engine(target, config=EngineConfig(ctx=256, spec=cfg or SpecConfig()), drafter=drafter)

    runs = [(engine(None), None), (engine(spec), spec), (engine(adaptive), adaptive)]
    prompt = PROMPTS[0]
    got = run_lockstep(target, prompt, runs, 40)
    outs = [eng.cached_tokens[len(prompt):] for eng, _ in runs]
    alone = run(engine(None), prompt, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    assert all(out == alone[:len(out)] for out in outs) and all(len(out) >= 39 for out in outs)
    assert all(r["decode_tps"] > 0 for r in got)
    assert got[1]["drafts"] > 0  # (the always-drafting engine drafted: its tokens above went through verification)


def test_probes_that_hit_re_measure_a_row_cost_pushed_up():
    """A run of slow verifications (the machine busy) pushed the running row cost far above the calibrated one, so
    far that no draft could pay; with drafting off nothing verifies, so nothing measured it again and drafting
    stayed off, request after request. Where drafting would pay at the calibrated row cost, a request's first drafts
    are probes; once FIRST_HITS of them hit, the next step verifies a 1-token draft whose time sets the row cost
    again, and drafting resumes at full length."""
    from turbospec.speculative.adaptive import FIRST_HITS, Controller, StepCosts

    costs = StepCosts([1.0, 1.1, 1.2, 1.3], draft=0.2, probe=0.3)  # calibrated: a row costs 0.1
    costs.observe(0, 1.0, 0.0, 0)
    for _ in range(40):
        costs.observe(1, 2.1, 0.2, 0)  # verifications on a busy machine: a row costs 1.1
    assert costs.row > 1.0 and not Controller(costs, 3).could_pay(3)
    ctl = Controller(costs, 3)  # the next request: its rows cost what was calibrated
    steps = []
    for _ in range(64):
        k = ctl.choose(3, 0)
        steps.append((k, ctl.shadow))
        if ctl.shadow:
            costs.observe(0, 1.0, 0.0, 0)
        else:
            costs.observe(k, 1.0 + 0.1 * k, 0.2 * k, 0)
        if k:
            ctl.observe(k, k)  # every drafted token hits
    drafts = [s for s in steps if s[0]]
    assert drafts[:FIRST_HITS + 1] == [(1, True)] * FIRST_HITS + [(1, False)]  # verified: the row measured again
    assert abs(costs.row - 0.1) < 1e-6 and steps[-1] == (3, False)
    costs.row = 0.5
    costs.recheck()
    costs.observe(1, 2.0, 0.2, 0)  # a recheck's slow verification: one such step does not push the row further up
    assert costs.row == 0.5


def test_verified_drafts_that_miss_in_a_row_become_probes_until_one_hits():
    """The random prompt after 3K of random context: its first tokens are drafted (a run of hits), then nothing.
    The running estimate, remembering ~7 drafts, keeps asking for verified drafts through several misses before it
    falls to the break-even; after MISS_STREAK verified misses in a row the drafts it asks for are probes (a draft
    checked against a plain step, no verification rows), and a probe that hits makes the next draft a verified one
    again."""
    from turbospec.speculative import adaptive as ad
    from turbospec.speculative.adaptive import Controller, StepCosts

    def run(n: int = 120) -> list[tuple[int, str, int]]:
        costs = StepCosts([3.7, 4.4, 5.1, 5.8], draft=0.55, probe=0.6)  # ms: ~3K on the bundled model
        ctl = Controller(costs, 3)
        steps = []
        for i in range(n):
            k = ctl.choose(3, 3072, n - i)
            if k:
                accepted = k if i < 12 or i >= 17 else 0  # drafts hit in steps 0-11 and from 17 on, none between
                steps.append((i, "probe" if ctl.shadow else "verified", accepted))
                ctl.observe(k, accepted)
            rows = 0 if ctl.shadow else k  # (a probe's target step is a plain one)
            costs.observe(rows, 3.7 + 0.7 * rows, 0.55 * rows, 3072)
        return steps

    steps = run()
    between = [kind for i, kind, _ in steps if 12 <= i < 17]
    assert between == ["verified"] * ad.MISS_STREAK + ["probe"] * (5 - ad.MISS_STREAK)  # the run of hits ended: two
    later = [kind for i, kind, _ in steps if i >= 17]  # verified misses, then probes while nothing hits
    assert later[0] == "probe" and set(later[1:]) == {"verified"}  # a probe hit: verified drafts again
    streak = ad.MISS_STREAK
    try:  # without the rule, verified drafts go on missing while the estimate falls
        ad.MISS_STREAK = 10 ** 9
        assert [kind for i, kind, _ in run() if 12 <= i < 17] == ["verified"] * 5
    finally:
        ad.MISS_STREAK = streak


def test_verified_drafts_are_one_token_deep_until_a_verified_token_is_accepted():
    """The explain prompt after 6K of random context: its first two tokens are drafted by chance (the first probes
    hit, FIRST_HITS of them), and nothing after. The estimate then asks for 3-deep drafts: each verified one that
    missed cost 3 rows. A request's verified drafts are FIRST_VERIFIED_DEPTH deep until one of their tokens is
    accepted -- where drafts keep hitting, the first verified one is accepted and the next goes deep."""
    from turbospec.speculative import adaptive as ad
    from turbospec.speculative.adaptive import Controller, StepCosts

    def run(hits: int, n: int = 128) -> list[str | int]:
        costs = StepCosts([5.5, 5.5 + 0.9, 5.5 + 1.8, 5.5 + 2.7], draft=0.6, probe=0.8)  # ms: 6K, bundled model
        ctl = Controller(costs, 3)
        steps: list[str | int] = []
        for i in range(n):
            k = ctl.choose(3, 6144, n - i)
            if k:
                steps.append("probe" if ctl.shadow else k)
                ctl.observe(k, k if len(steps) <= hits else 0)  # the request's first `hits` drafts hit, none after
            rows = 0 if ctl.shadow else k  # (a probe's target step is a plain one)
            costs.observe(rows, 5.5 + 0.9 * rows, 0.6 * rows, 6144)
        return steps

    assert ad.FIRST_VERIFIED_DEPTH == 1 and ad.FIRST_HITS == 2
    chance = run(2)
    assert chance[:2] == ["probe"] * 2 and [k for k in chance if k != "probe"] == [1] * ad.MISS_STREAK
    hitting = run(10 ** 9)
    assert hitting[:4] == ["probe", "probe", 1, 3] and set(hitting[3:]) <= {3, "probe"}
    depth = ad.FIRST_VERIFIED_DEPTH
    try:  # without the rule, the first verified drafts after the chance hits are 3 and 2 deep
        ad.FIRST_VERIFIED_DEPTH = 10 ** 9
        assert sum(k for k in run(2) if k != "probe") > ad.MISS_STREAK
    finally:
        ad.FIRST_VERIFIED_DEPTH = depth


def test_one_chance_hit_among_the_first_probes_verifies_no_draft():
    """After a random 4K context the explain prompt's first token is drafted by chance, and nothing after it: one hit
    and two misses among the first FIRST_PROBES probes leave an estimate (0.43, mostly the prior) at which verified
    drafts would pay, and each verified one missed. Up to FIRST_PROBES_HIT probes are made instead, and drafting
    stops as soon as a plain step is expected to beat a draft (no 3% margin kept it on at 0.28): no verification
    rows at all. The first probes having turned nothing on, the interval starts doubled (16, then 32, 64), and no
    probe is made with fewer than PROBE_MIN tokens left in the request."""
    from turbospec.speculative import adaptive as ad
    from turbospec.speculative.adaptive import PROBE_MIN, Controller, StepCosts

    assert ad.FIRST_PROBES_HIT > ad.FIRST_PROBES
    costs = StepCosts([4.4, 4.4 + 0.75, 4.4 + 1.5, 4.4 + 2.25], draft=0.6, probe=0.8)  # ms: 4K on the bundled model
    ctl = Controller(costs, 3)
    n = 124
    steps, hit = [], True  # the first drafted token hits, none after it
    for i in range(n):
        k = ctl.choose(3, 4096, n - i)
        if k:
            steps.append((i, "probe" if ctl.shadow else k))
            ctl.observe(k, int(hit))
            hit = False
        rows = 0 if ctl.shadow else k  # (a probe's target step is a plain one)
        costs.observe(rows, 4.4 + 0.75 * rows, 0.6 * rows, 4096)
    assert {kind for _, kind in steps} == {"probe"} and ctl.accept[0] < 0.3
    first = [i for i, _ in steps[:ad.FIRST_PROBES_HIT]]
    assert first == list(range(first[0], first[0] + ad.FIRST_PROBES_HIT))
    last = first[-1]
    assert [i for i, _ in steps[ad.FIRST_PROBES_HIT:]] == [last + 2 * PROBE_MIN, last + 6 * PROBE_MIN]
    assert n - (last + 14 * PROBE_MIN) < PROBE_MIN  # (the next one's turn came with too few tokens left)
