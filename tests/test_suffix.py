"""The suffix drafter: matches, continuation trees, per-request vs shared stores, and lossless decoding."""

import random

import pytest
import torch

from turbospec.config import EngineConfig, SpecConfig
from turbospec.engine import Engine
from turbospec.errors import TurboSpecError
from turbospec.model import load_model
from turbospec.sampling import SamplingParams
from turbospec.speculative import make_drafter
from turbospec.speculative.suffix import SuffixDrafter, SuffixIndex, SuffixStore

from .test_spec import peaked_target


def test_matches_are_longest_first_and_extend_backwards():
    idx = SuffixIndex(2)
    text = [1, 2, 3, 4, 9, 5, 2, 3, 4, 7, 0, 3, 4, 8]
    idx.extend(text)
    # pattern ...1 2 3 4: the first occurrence matches 4 tokens, the second 3 (5 != 1), the third 2
    got = idx.matches([6, 1, 2, 3, 4])
    assert got[0] == (4, 4) and (3, 9) in got and (2, 13) in got
    assert idx.follow(4, 3) == [9, 5, 2]
    assert idx.matches([6, 1, 2, 3, 4], before=9) == [(4, 4)]  # occurrences ending at or after `before` are skipped
    assert idx.matches([5, 6]) == []


def test_documents_do_not_run_into_each_other():
    idx = SuffixIndex(2)
    idx.add([1, 2, 3])
    idx.add([4, 5, 6])
    assert idx.matches([2, 3]) == []  # [2, 3] ends document 1: nothing follows it
    assert idx.matches([3, 4]) == []  # never across the boundary
    assert idx.follow(idx.matches([4, 5])[0][1], 5) == [6]


def test_draft_length_grows_with_the_match():
    d = SuffixDrafter(n_max=24, factor=1.0, p_min=0.1, n_min=2)
    body = list(range(10, 60))
    ctx = body + [99] + body[:3]
    d.begin(ctx, None)
    assert d.propose(ctx, 24).tokens == body[3:6]  # 3 matched tokens: 3 drafted
    ctx = body + [99] + body[:20]
    assert d.propose(ctx, 24).tokens == body[20:40]  # 20 matched: 20 drafted
    assert d.propose(ctx, 5).tokens == body[20:25]  # the engine's room caps it
    assert len(d.propose([7, 8, 9], 24)) == 0  # no match


def test_disagreeing_continuations_make_a_tree_weighted_by_count():
    d = SuffixDrafter(n_max=8, factor=4.0, p_min=0.2, n_min=2)
    ctx = [1, 2, 5, 6, 0, 1, 2, 5, 7, 0, 1, 2, 8, 9, 0, 1, 2, 5, 6, 3, 0, 1, 2]
    tree = d.propose(ctx, 8)
    # the three longest matches (0 1 2) go on with 5 7 / 8 9 / 5 6 3: 5 first (2 of 3), 8 at the root too
    assert tree.tokens[0] == 5 and tree.parents[0] == -1 and 8 in tree.tokens
    assert tree.parents[tree.tokens.index(8)] == -1
    assert all(p < i for i, p in enumerate(tree.parents))  # parents first
    # runs 5 7 / 5 7 / 5 6 / 8: 5 (3/4), 7 (2/4) under it, then 6 and 8 (1/4 each)
    runs = [[5, 7], [5, 7], [5, 6], [8]]
    tree = d._tree(runs, 8)
    assert tree.tokens[:2] == [5, 7] and tree.parents[:2] == [-1, 0]
    assert {(tree.tokens[i], tree.parents[i]) for i in range(2, 4)} == {(6, 0), (8, -1)}
    assert SuffixDrafter(p_min=0.3)._tree(runs, 8).tokens == [5, 7]  # 1/4 of the runs: below p_min
    assert d._tree(runs, 1).tokens == [5]


def test_requests_share_text_only_through_a_shared_store():
    secret = list(range(20, 40))
    for store in (None, SuffixStore(1000)):
        d = SuffixDrafter(store=store)
        d.begin(secret, None)
        d.finish(secret)  # client A's request ends
        d.begin([1, 2], None)  # client B's
        got = d.propose([1, 2, 25, 26, 27], 8).tokens
        assert got == ([] if store is None else [28, 29, 30])


def test_shared_store_drops_the_oldest_requests():
    store = SuffixStore(max_tokens=100)
    for i in range(10):
        store.add([1000 + i] + list(range(i * 50, i * 50 + 39)))
    assert len(store.index) <= 100 + len(store.docs)
    d = SuffixDrafter(store=store)
    assert d.propose([9 * 50, 9 * 50 + 1], 4).tokens == [9 * 50 + 2, 9 * 50 + 3]
    assert d.propose([0, 1], 4).tokens == []  # the first request is gone


def test_config_checks_and_caps():
    sc = SpecConfig.parse("suffix,draft-mtp", n_max=3, suffix_n_max=16)
    assert sc.depth == 16 and sc.cap("draft-mtp") == 3
    assert SpecConfig.parse("ngram-mod", n_max=3, ngram_mod_n_max=12).depth == 12  # its own flag, not n-max
    assert SpecConfig.parse("ngram,draft-mtp", n_max=5).depth == 5
    for bad in ({"suffix_n_max": 0}, {"suffix_factor": 0}, {"suffix_p_min": 1.5}):
        with pytest.raises(TurboSpecError):
            SpecConfig.parse("suffix", **bad)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return peaked_target(tmp_path_factory.mktemp("suffix") / "target")


def _prompts():
    rnd = random.Random(4)
    out = []
    for _ in range(5):
        body = [rnd.randrange(64) for _ in range(14)]
        out.append(body + [rnd.randrange(64)] + body[:4])  # an 'edit': the body again, drafts from the first copy
    return out


@pytest.mark.parametrize("spec", ["suffix", "suffix,draft-mtp"])
def test_greedy_identical_to_plain_with_long_drafts_and_trees(target, spec):
    model = load_model(target, "float32")
    plain = Engine(model, None, EngineConfig(ctx=256, ubatch=8))
    sc = SpecConfig.parse(spec, n_max=3, suffix_n_max=12, suffix_factor=2.0, suffix_p_min=0.05)
    eng = Engine(model, None, EngineConfig(ctx=256, ubatch=8, spec=sc), drafter=make_drafter(sc, model, 270))
    p = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    accepted = deep = 0
    for prompt in _prompts():
        assert eng.generate([prompt], p)[0]["tokens"] == plain.generate([prompt], p)[0]["tokens"]
        st = eng.last_stats.spec
        accepted += st.by_source.get("suffix", [0, 0, 0])[2]
        deep += sum(st.per_pos_drafted[3:])
    assert accepted > 0 and deep > 0  # drafts deeper than --spec-draft-n-max were proposed


def test_a_repeated_request_is_drafted_from_the_first_with_a_shared_store(target):
    model = load_model(target, "float32")
    sc = SpecConfig.parse("suffix", suffix_shared=True, suffix_n_max=16)
    eng = Engine(model, None, EngineConfig(ctx=256, ubatch=8, spec=sc), drafter=make_drafter(sc, model, 272))
    p = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompt = [3, 9, 27, 17, 51, 25, 11, 33]
    first = eng.generate([prompt], p)[0]["tokens"]
    st1 = eng.last_stats.spec
    assert eng.generate([prompt], p)[0]["tokens"] == first
    st2 = eng.last_stats.spec
    assert st2.accepted > st1.accepted and st2.accepted >= 30  # the first output drafts nearly all of the second


def test_bundled_model_in_bf16_with_suffix_trees_is_plain_decoding():
    """The bundled model in its own dtype: suffix drafts (chains up to 24 deep and trees) leave greedy output equal to
    plain decoding (tree rows are verified with the single-step attention arithmetic)."""
    import json
    from pathlib import Path

    from turbospec.tokenizer import Tokenizer

    root = Path(__file__).resolve().parents[1]
    path = root / "models" / "turbospec-tiny"
    if not (path / "config.json").exists():
        pytest.skip("no bundled model")
    model, tok = load_model(str(path), "bfloat16"), Tokenizer(path)
    rows = [json.loads(x) for x in (root / "turbospec/data/eval/code.jsonl").read_text().splitlines()]
    text = next(r["text"] for r in rows if r["path"] == "compileall.py")
    body = tok.decode(tok.encode(text[text.find("\ndef ") + 1:], add_special=False)[:400])
    body = body[:body.rfind("\n") + 1]
    head = "".join(body.replace("name", "label").splitlines(keepends=True)[:2])
    prompt = tok.encode(f"# compileall.py\n{body}\n\n# compileall.py, with `name` renamed to `label`:\n{head}")
    p = SamplingParams(temperature=0, max_tokens=256, ignore_eos=True)
    plain = Engine(model, tok, EngineConfig(ctx=len(prompt) + 300)).generate([prompt], p)[0]["tokens"]
    sc = SpecConfig.parse("suffix")
    eng = Engine(model, tok, EngineConfig(ctx=len(prompt) + 300, spec=sc), drafter=make_drafter(sc, model, 1024))
    trees = []
    verify = eng.verify_step
    eng.verify_step = lambda root, tree, sampler: (trees.append(tree.is_chain), verify(root, tree, sampler))[1]
    assert eng.generate([prompt], p)[0]["tokens"] == plain
    assert False in trees and eng.last_stats.spec.accepted > 50


def test_merge_shares_prefixes_and_orders_by_depth():
    from turbospec.speculative.tree import DraftTree, merge

    a = DraftTree.chain([5, 6, 7, 8], source="suffix")
    b = DraftTree.chain([5, 9, 3], source="mtp")
    m = merge([a, DraftTree(), b])
    assert m.source == "suffix+mtp"
    paths = set()
    for i in range(len(m)):
        path, n = [], i
        while n >= 0:
            path.insert(0, m.tokens[n])
            n = m.parents[n]
        paths.add(tuple(path))
    assert {(5, 6, 7, 8), (5, 9, 3)} <= paths and len(m) == 6  # 5 once
    assert [m.depth(i) for i in range(len(m))] == sorted(m.depth(i) for i in range(len(m)))
    assert m.limit(9, 3).tokens[:1] == [5] and set(m.limit(9, 3).tokens[1:]) == {6, 9}  # both trees' first levels
    assert merge([a]) is a and len(merge([DraftTree()])) == 0


@pytest.mark.parametrize("spec", ["suffix,draft-mtp", "ngram,suffix,draft-mtp"])
def test_merged_drafts_are_lossless(target, spec):
    model = load_model(target, "float32")
    plain = Engine(model, None, EngineConfig(ctx=256, ubatch=8))
    sc = SpecConfig.parse(spec, n_max=3, suffix_n_max=12, merge=True)
    eng = Engine(model, None, EngineConfig(ctx=256, ubatch=8, spec=sc), drafter=make_drafter(sc, model, 270))
    p = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    merged = 0
    for prompt in _prompts():
        assert eng.generate([prompt], p)[0]["tokens"] == plain.generate([prompt], p)[0]["tokens"]
        merged += sum(v[0] for k, v in eng.last_stats.spec.by_source.items() if "+" in k)
    assert merged > 0  # steps where both drafted and were verified together


def test_drafts_are_cut_to_the_rows_of_the_one_call_layer(target):
    """A verification step holds at most the rows the fused decoder layer takes (16 in float32): deeper drafts are
    cut there, and the output is still plain decoding."""
    from turbospec.layers.linear import skinny_rows
    from turbospec.speculative.drafter import Drafter
    from turbospec.speculative.tree import DraftTree

    class Deep(Drafter):
        name, needs_hidden = "deep", False

        def propose(self, tokens, n_max):
            return DraftTree.chain([tokens[-1]] * n_max, source=self.name)

    model = load_model(target, "float32")
    plain = Engine(model, None, EngineConfig(ctx=256, ubatch=8))
    eng = Engine(model, None, EngineConfig(ctx=256, ubatch=8, spec=SpecConfig.parse("suffix", suffix_n_max=40)),
                 drafter=Deep())
    p = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    prompt = [3, 4, 5, 6, 7, 8]
    assert eng.generate([prompt], p)[0]["tokens"] == plain.generate([prompt], p)[0]["tokens"]
    assert len(eng.last_stats.spec.per_pos_drafted) == eng.step_rows - 1 == skinny_rows(torch.float32) - 1
