import json

import pytest
import torch

from turbospec.config import DEFAULT_TREE, EngineConfig, SpecConfig, parse_tree
from turbospec.demo import qwen3_config, random_qwen3_weights, write_checkpoint
from turbospec.engine import Engine
from turbospec.errors import TurboSpecError
from turbospec.kv.plan import AttentionPlan
from turbospec.model import load_model
from turbospec.sampling import SamplingParams
from turbospec.speculative import make_drafter
from turbospec.speculative.medusa import MedusaDrafter, MedusaHeads, MedusaTree, load_heads, save_heads
from turbospec.speculative.tree import DraftTree

SHAPE = {"hidden_size": 48, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 12, "vocab_size": 64}


# ---- trees ---------------------------------------------------------------------------------------------
def test_parse_tree_forms():
    assert parse_tree(None) == sorted(map(tuple, DEFAULT_TREE), key=lambda p: (len(p), p))
    assert parse_tree("[[1,0],[0]]") == [(0,), (1,), (1, 0)]  # missing prefix [1] added
    assert parse_tree("topk:2,2") == [(0,), (1,), (0, 0), (0, 1), (1, 0), (1, 1)]
    assert len(parse_tree("topk:3,2,1")) == 3 + 6 + 6
    for bad in ("[[", "[]", "[[-1]]", "[[0],[]]", "topk:0", "topk:a"):
        with pytest.raises(TurboSpecError):
            parse_tree(bad)


def test_tree_build_parents_and_tokens():
    tree = MedusaTree(parse_tree(DEFAULT_TREE))
    assert tree.paths == [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]
    assert tree.parents == [-1, -1, -1, 0, 0, 1, 3]
    assert tree.depth == 3 and tree.topk == [3, 2, 1]
    cands = [[10, 11, 12], [20, 21], [30]]
    dt = tree.build(cands)
    assert dt.tokens == [10, 11, 12, 20, 21, 20, 30]
    assert dt.children(-1) == [0, 1, 2] and dt.children(0) == [3, 4] and dt.children(3) == [6]
    assert all(q is None for q in dt.q)
    two = tree.limit(2)
    assert len(two) == 6 and two.depth == 2 and two.topk == [3, 2]
    assert tree.limit(1).build(cands).tokens == [10, 11, 12]
    # the tree's attention plan: node 6 sees the root, nodes 0 and 3 and itself
    plan = AttentionPlan.tree(5, [-1] + [p + 1 for p in dt.parents])
    assert plan.mask[7].tolist() == [True] * 5 + [True, True, False, False, True, False, False, True]
    assert plan.positions.tolist() == [5, 6, 6, 6, 7, 7, 7, 8]


def test_draft_tree_limit():
    dt = DraftTree([1, 2, 3, 4, 5], [-1, -1, 0, 2, 1], [None] * 5)
    lim = dt.limit(2, 10)
    assert lim.tokens == [1, 2, 3, 5] and lim.parents == [-1, -1, 0, 1]
    assert dt.limit(5, 3).tokens == [1, 2, 3]
    ch = DraftTree.chain([7, 8, 9])
    assert ch.limit(2, 9).tokens == [7, 8] and ch.limit(9, 1).tokens == [7]


# ---- greedy equality on a tiny random model ------------------------------------------------------------------
@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("medusa")
    cfg = qwen3_config(**SHAPE)
    w = random_qwen3_weights(cfg, seed=11, dtype=torch.float32)
    for k in w:  # peaked, repetitive distributions
        if k.endswith(("proj.weight", "embed_tokens.weight")):
            w[k] = w[k] * 12
    path = write_checkpoint(d / "target", cfg, w)
    return path


def random_heads(model, num_heads=3, shared=False, seed=0) -> MedusaHeads:
    torch.manual_seed(seed)
    heads = MedusaHeads(SHAPE["hidden_size"], SHAPE["vocab_size"], num_heads, 1, shared,
                        model.lm_head.weight.float())
    with torch.no_grad():  # non-trivial residual blocks (zero-init would be the identity)
        for blk in heads.blocks:
            blk[0].linear.weight.normal_(0, 0.3)
            blk[0].linear.bias.normal_(0, 0.3)
        if not shared:
            for h in heads.heads:
                h.weight.add_(torch.randn_like(h.weight) * 0.5)
    return heads


PROMPTS = [[(7 * i + j) % 64 for j in range(10)] * 3 for i in range(3)] + [
    [(i * i + 3 * j) % 64 for j in range(17)] for i in range(3)]
_PLAIN: dict = {}


def gen(engine, prompt, params):
    return engine.generate([prompt], params)[0]["tokens"]


def plain_greedy(target, prompt, max_tokens):
    """Non-speculative greedy output (memoised across tests: the target is the same random model)."""
    key = (tuple(prompt), max_tokens)
    if key not in _PLAIN:
        eng = Engine(target, None, EngineConfig(ctx=256, ubatch=8))
        _PLAIN[key] = gen(eng, prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    return _PLAIN[key]


def greedy_continuation(model, tokens, n):
    cache = model.new_cache(len(tokens) + n + 1)
    h = model.forward(torch.tensor(tokens), AttentionPlan.causal(0, len(tokens)), cache)
    cache.commit()
    out = []
    for _ in range(n):
        t = int(model.logits(h[-1:])[0].argmax())
        out.append(t)
        h = model.forward(torch.tensor([t]), AttentionPlan.causal(cache.length, 1), cache)
        cache.commit()
    return out


class OracleMedusa(MedusaDrafter):
    """The real Medusa drafter whose head-d top-k list has the target's true token t+2+d moved to rank
    ranks[d]: acceptance then runs through non-first branches of the tree."""

    def __init__(self, heads, target, tree, ranks):
        super().__init__(heads, target, tree)
        self.target, self.ranks = target, ranks

    def propose(self, tokens, n_max):
        tree = self.tree.limit(n_max)
        cands = self.candidates(self.h, tree.topk)
        truth = greedy_continuation(self.target, tokens, tree.depth)  # tokens[-1] is the root: truth[0] follows it
        for d, c in enumerate(cands):
            c = [t for t in c if t != truth[d]]
            c.insert(min(self.ranks[d], len(c)), truth[d])
            cands[d] = c[:tree.topk[d]]
        return tree.build(cands, "medusa")


@pytest.mark.parametrize("tree_spec,shared,n_max", [
    (None, False, 3), ("topk:3,2,2", False, 3), ("[[0],[1],[0,0],[1,0],[1,1],[0,0,0],[1,1,0]]", True, 2)])
def test_greedy_identical_to_plain(target_dir, tmp_path, tree_spec, shared, n_max):
    target = load_model(target_dir, "float32")
    heads_dir = tmp_path / "heads"
    save_heads(heads_dir, random_heads(target, shared=shared))
    sc = SpecConfig.parse("medusa", n_max=n_max, medusa=str(heads_dir), tree=tree_spec)
    drafter = make_drafter(sc, target, 260)
    assert isinstance(drafter, MedusaDrafter)
    assert (drafter.heads is None) == shared
    eng = Engine(target, None, EngineConfig(ctx=256, ubatch=8, spec=SpecConfig(n_max=n_max, adaptive=False)), drafter=drafter)
    p = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    drafts = 0
    for prompt in PROMPTS[:2] + PROMPTS[-2:]:
        assert gen(eng, prompt, p) == plain_greedy(target, prompt, 20), (tree_spec, prompt)
        st = eng.last_stats.spec
        drafts += st.drafts
        assert len(st.per_pos_drafted) <= n_max
    assert drafts > 0


@pytest.mark.parametrize("tree_spec,ranks,expect", [
    (None, [1, 0, 0], 2),  # path [1] -> [1,0]; [1,0,0] is not in the default tree
    ("topk:2,2,2", [1, 0, 1], 3),
    (None, [2, 0, 0], 1),  # [2] has no children
])
def test_oracle_candidates_accept_through_tree(target_dir, tree_spec, ranks, expect):
    target = load_model(target_dir, "float32")
    heads = random_heads(target)
    tree = MedusaTree(parse_tree(tree_spec))
    eng = Engine(target, None, EngineConfig(ctx=256, ubatch=8, spec=SpecConfig(n_max=3, adaptive=False)), drafter=OracleMedusa(heads, target, tree, ranks))
    p = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    for prompt in (PROMPTS[0], PROMPTS[-1]):
        assert gen(eng, prompt, p) == plain_greedy(target, prompt, 20)
        st = eng.last_stats.spec
        assert st.per_pos_accepted[expect - 1] >= st.drafts - 1  # the last step may be cut by max_tokens
        assert sum(st.per_pos_accepted[expect:]) == 0  # no deeper path exists in the tree


def test_sampling_mode_completes(target_dir, tmp_path):
    target = load_model(target_dir, "float32")
    save_heads(tmp_path, random_heads(target))
    drafter = make_drafter(SpecConfig.parse("medusa", n_max=3, tree="topk:2,2,1"), target, 260,
                           model_path=str(tmp_path))
    eng = Engine(target, None, EngineConfig(ctx=128, ubatch=8, spec=SpecConfig(n_max=3, adaptive=False)), drafter=drafter)
    p = SamplingParams(temperature=0.9, top_k=20, top_p=0.95, min_p=0.0, seed=3, max_tokens=20, ignore_eos=True)
    for prompt in PROMPTS[:2]:
        assert len(gen(eng, prompt, p)) == 20
    # context limit: the tree is cut to the cache rows left
    eng = Engine(target, None, EngineConfig(ctx=40, ubatch=8, spec=SpecConfig(n_max=3, adaptive=False)), drafter=drafter)
    plain = Engine(target, None, EngineConfig(ctx=40, ubatch=8))
    p = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    assert gen(eng, PROMPTS[0], p) == gen(plain, PROMPTS[0], p)


def test_load_errors(target_dir, tmp_path):
    target = load_model(target_dir, "float32")
    with pytest.raises(TurboSpecError, match="no Medusa heads"):
        make_drafter(SpecConfig.parse("medusa"), target, 100, model_path=str(tmp_path))
    heads = MedusaHeads(SHAPE["hidden_size"], 99, 2)
    save_heads(tmp_path, heads)
    with pytest.raises(TurboSpecError, match="vocab"):
        make_drafter(SpecConfig.parse("medusa"), target, 100, model_path=str(tmp_path))
    save_heads(tmp_path, MedusaHeads(SHAPE["hidden_size"], SHAPE["vocab_size"], 2))
    with pytest.raises(TurboSpecError, match="deep"):
        make_drafter(SpecConfig.parse("medusa", tree="[[0,0,0]]"), target, 100, model_path=str(tmp_path))
    with pytest.raises(TurboSpecError):
        SpecConfig.parse("medusa", tree="[[x]]")


# ---- train-heads ----------------------------------------------------------------------------------------------
TEXT = ("The quick brown fox jumps over the lazy dog. " * 2 + "def add(x, y):\n    return x + y\n\n"
        + "Speculative decoding drafts tokens and verifies them. ") * 30


@pytest.fixture(scope="module")
def byte_model(tmp_path_factory):
    """A tiny model over the 259-token byte tokenizer that write_checkpoint bundles."""
    d = tmp_path_factory.mktemp("bytes")
    cfg = qwen3_config(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=16, vocab_size=272)
    w = random_qwen3_weights(cfg, seed=1, dtype=torch.float32)
    for k in w:
        if k.endswith(("proj.weight", "embed_tokens.weight")):
            w[k] = w[k] * 20
    path = write_checkpoint(d / "m", cfg, w)
    (d / "t.txt").write_text(TEXT)
    return path, d / "t.txt"


def test_train_heads_lowers_loss_resumes_and_loads(byte_model, tmp_path):
    from training.heads import main

    model, text = byte_model
    out = tmp_path / "heads"
    js = tmp_path / "s.json"
    common = ["-m", str(model), "--text", str(text), "--out", str(out), "--seq-len", "32",
              "--batch", "2", "--lr", "3e-3", "--save-every", "4", "--no-progress", "--eval-windows", "2"]
    assert main(common + ["--steps", "4"]) == 0
    cfg = json.loads((out / "medusa_config.json").read_text())
    assert cfg["num_heads"] == 3 and cfg["trained_steps"] == 4 and cfg["vocab"] == 272
    assert main(common + ["--steps", "10", "--resume", "--json", str(js)]) == 0
    s = json.loads(js.read_text())
    assert s["start_step"] == 4 and json.loads((out / "medusa_config.json").read_text())["trained_steps"] == 10
    assert s["eval_loss_after"] < s["eval_loss_before"]
    # the saved heads load and drive greedy generation losslessly
    target = load_model(model, "float32")
    heads = load_heads(out, 32, 272)
    assert heads.num_heads == 3
    drafter = make_drafter(SpecConfig.parse("medusa", n_max=3), target, 300, model_path=str(out))
    eng = Engine(target, None, EngineConfig(ctx=256, ubatch=16, spec=SpecConfig(n_max=3, adaptive=False)), drafter=drafter)
    plain = Engine(target, None, EngineConfig(ctx=256, ubatch=16))
    prompt = list(TEXT[:60].encode())
    p = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    assert gen(eng, [t + 3 for t in prompt], p) == gen(plain, [t + 3 for t in prompt], p)


def test_train_heads_shared_head_kl(byte_model, tmp_path):
    from training.heads import train_heads

    model, text = byte_model
    s = train_heads(str(model), [str(text)], str(tmp_path), steps=8, seq_len=40, batch=2, lr=3e-3,
                    shared_head=True, loss="kl", num_heads=2, save_every=0, progress=False, eval_windows=2,
                    log=lambda m: None)
    assert s["eval_loss_after"] < s["eval_loss_before"]
    from safetensors import safe_open

    with safe_open(str(tmp_path / "medusa_heads.safetensors"), "pt") as f:
        names = set(f.keys())
    assert names == {"medusa.0.res.0.weight", "medusa.0.res.0.bias", "medusa.1.res.0.weight", "medusa.1.res.0.bias"}
    target = load_model(model, "float32")
    d = make_drafter(SpecConfig.parse("medusa", n_max=2), target, 100, model_path=str(tmp_path))
    assert d.heads is None and d.tree.depth == 2


@pytest.mark.parametrize("kernel", [True, False])
def test_hybrid_target_verifies_trees(tmp_path, kernel, monkeypatch):
    """Hybrid targets verify Medusa trees (per-node Gated DeltaNet states); greedy output stays exact."""
    from tests.hf_hybrid import build

    if not kernel:
        monkeypatch.setenv("TURBOSPEC_NO_GDN_KERNEL", "1")
    path = build("qwen3_5", tmp_path)
    target = load_model(path, "float32")
    torch.manual_seed(0)
    heads = MedusaHeads(64, 128, 2, 1, False, target.lm_head.weight.float())
    save_heads(tmp_path / "h", heads)
    drafter = make_drafter(SpecConfig.parse("medusa", n_max=2, tree="topk:3,2"), target, 100,
                           model_path=str(tmp_path / "h"))
    assert len(drafter.tree.paths) == 9
    trees = []
    propose = drafter.propose
    drafter.propose = lambda toks, n: trees.append(propose(toks, n)) or trees[-1]
    eng = Engine(target, None, EngineConfig(ctx=96, ubatch=8, spec=SpecConfig(n_max=2)), drafter=drafter)
    plain = Engine(target, None, EngineConfig(ctx=96, ubatch=8))
    p = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    for prompt in ([5, 9, 17, 33, 5, 9, 17, 33], [100, 3, 77, 3, 100]):
        assert gen(eng, prompt, p) == gen(plain, prompt, p)
    assert eng.last_stats.spec.drafts > 0
    assert any(len(t.tokens) > 2 and not t.is_chain for t in trees)  # real branching trees were verified
