"""Fast checks of the bundled-model training pipeline (toy corpus, tiny config, 2 steps)."""

import json
import os
import random

import pytest

pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

from training.corpus import (  # noqa: E402 -- after the torch skip
    CorpusError,
    find_docs_dir,
    is_heldout,
    load_corpus,
    make_retrieval_example,
)

CODE = '''def add(a, b):
    """Return the sum."""
    return a + b


class Point:
    def __init__(self, x, y):
        self.x = x
        self.y = y

    def norm(self):
        return (self.x ** 2 + self.y ** 2) ** 0.5
'''

PROSE = """Lists
=====

Lists are mutable sequences, typically used to store collections of homogeneous items.
The :func:`sorted` built-in returns a new sorted list from the items in *iterable*.
"""


@pytest.fixture()
def toy_dirs(tmp_path):
    code = tmp_path / "code"
    docs = tmp_path / "docs"
    for i in range(24):
        d = code / f"pkg{i % 3}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"mod{i}.py").write_text(CODE.replace("add", f"add{i}") * 3)
    (code / "test").mkdir()
    (code / "test" / "test_x.py").write_text("assert False\n")
    docs.mkdir()
    for i in range(12):
        (docs / f"page{i}.rst.txt").write_text(PROSE * 4 + f"\nPage {i}.\n")
    return str(code), str(docs)


def test_split_is_deterministic_and_disjoint(toy_dirs):
    code, docs = toy_dirs
    a = load_corpus(code_dir=code, docs_dir=docs, percent=20)
    b = load_corpus(code_dir=code, docs_dir=docs, percent=20)
    assert [d.path for d in a.heldout] == [d.path for d in b.heldout]
    assert {d.path for d in a.train}.isdisjoint({d.path for d in a.heldout})
    assert all(not p.path.startswith("test") for p in a.train + a.heldout)
    for d in a.heldout:
        assert is_heldout(d.kind, d.path, 20)
    # the hash split holds out ~percent of many paths
    frac = sum(is_heldout("code", f"m{i}.py") for i in range(4000)) / 4000
    assert 0.045 < frac < 0.08


def test_missing_docs_gives_clear_error(tmp_path):
    with pytest.raises(CorpusError, match="python3.11-doc"):
        find_docs_dir(str(tmp_path / "nope"))


def test_two_training_steps_and_export(toy_dirs, tmp_path):
    from training.evaluate import load_exported
    from training.tokenizer import load_tokenizer
    from training.train import main

    code, docs = toy_dirs
    run = tmp_path / "run"
    out = tmp_path / "export"
    torch.manual_seed(0)
    _model, meta = main([
        "--run", str(run), "--code-dir", code, "--docs-dir", docs, "--vocab", "400",
        "--hidden", "32", "--layers", "4", "--heads", "2", "--kv-heads", "1", "--head-dim", "16",
        "--intermediate", "64", "--linear-heads", "2", "--linear-head-dim", "16",
        "--time-budget-min", "0", "--max-steps", "2", "--warmup-steps", "1", "--p-retrieval", "0.5",
        "--curriculum", "[[0, 64, 2], [0.5, 128, 1]]", "--no-progress", "--threads", "1",
        "--export", str(out),
    ])
    assert meta["step"] == 2 and meta["done"]
    assert os.path.exists(run / "ckpt.pt")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["mtp_num_hidden_layers"] == 1 and cfg["model_type"] == "qwen3_5_text"
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert f.get_tensor("mtp.fc.weight").shape == (32, 64)
    for k in ("mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.norm.weight",
              "mtp.layers.0.self_attn.q_proj.weight", "mtp.layers.0.mlp.down_proj.weight",
              "mtp.layers.0.input_layernorm.weight"):
        assert k in keys
    m2 = load_exported(str(out))
    x = torch.randint(0, 300, (1, 16))
    loss, _, _ = m2(x)
    assert torch.isfinite(loss)
    tok = load_tokenizer(str(out))
    ex = make_retrieval_example(tok, [CODE, PROSE], random.Random(0), 200)
    assert ex["value"] in ex["answer"] and ex["prompt"].endswith("Answer:")
    assert ex["n_prompt_tokens"] <= 200


def test_shipped_eval_data_is_small_and_complete():
    from training.evaldata import default_eval_dir, load_jsonl

    d = default_eval_dir()
    total = sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d))
    assert total <= 2 * 2**20
    cases = load_jsonl(os.path.join(d, "retrieval.jsonl"))
    assert {c["target_tokens"] for c in cases} >= {1024, 2048, 4096, 8192}
    for c in cases:
        assert c["value"] in c["answer"] and c["value"] in c["prompt"]
        assert c["n_prompt_tokens"] <= c["target_tokens"]
    assert load_jsonl(os.path.join(d, "code.jsonl")) and load_jsonl(os.path.join(d, "prose.jsonl"))


@pytest.mark.parametrize("split_digits", [False, True])
def test_multi_fact_documents(toy_dirs, tmp_path, split_digits):
    """Every question of a multi-fact training document is answerable from its body, questions are distinct,
    and only the tokens that spell the values carry the answer weight (also with one token per digit)."""
    import numpy as np

    from training.data import BatchSampler
    from training.tokenizer import train_tokenizer

    code, docs = toy_dirs
    corpus = load_corpus(code_dir=code, docs_dir=docs, percent=20)
    tok = train_tokenizer(corpus.texts(), 600, split_digits=split_digits)
    streams = {"code": np.arange(5000, dtype=np.int32) % 500, "prose": np.arange(5000, dtype=np.int32) % 400}
    s = BatchSampler(tok, corpus, streams, seed=3, p_retrieval=1.0, answer_weight=3.0, max_facts=8)
    for length in (300, 700, 1000):
        ids, w = s._multi_doc(length)
        assert len(ids) == len(w) and ids[-1] == tok.token_to_id("<|endoftext|>")
        text = tok.decode(ids.tolist())
        body, *qas = text.split("\nQuestion: ")
        assert 1 <= len(qas) <= 8
        questions = [qa.split("\nAnswer: ")[0] for qa in qas]
        assert len(set(questions)) == len(questions)
        weighted = tok.decode([int(t) for t, x in zip(ids, w) if x > 1])
        for qa in qas:
            answer = qa.split("\nAnswer: ")[1].split("<|endoftext|>")[0].strip()
            assert answer in body  # the needle sentence (or its number line) states the value
            value = answer.split()[-1].rstrip(".").lstrip("$")
            assert value in weighted
        assert set(np.unique(w).tolist()) <= {1.0, 3.0}
    assert s.questions >= 3


def test_split_digits_tokenizer(toy_dirs, tmp_path):
    """--split-digits: every digit is one token, so a number is spelled alike after `account` and `Account`; the
    saved tokenizer round-trips text with numbers."""
    from training.tokenizer import load_tokenizer, save_tokenizer, train_tokenizer

    code, docs = toy_dirs
    texts = load_corpus(code_dir=code, docs_dir=docs, percent=20).texts() + ["Account 70 balance: 20,724,930"] * 50
    merged = train_tokenizer(texts, 600)
    assert any(len(merged.id_to_token(i).lstrip("\u0120")) > 1 and merged.id_to_token(i).lstrip("\u0120").isdigit()
               for i in merged.encode("Account 70 balance: 20,724,930").ids)  # without the flag digits merge
    save_tokenizer(train_tokenizer(texts, 600, split_digits=True), str(tmp_path / "tok"))
    tok = load_tokenizer(str(tmp_path / "tok"))
    text = "Account 70 balance: 20,724,930\nWhat is the balance of account 70?"
    pieces = [tok.id_to_token(i).lstrip("\u0120") for i in tok.encode(text).ids]
    assert all(len(p) == 1 for p in pieces if any(c.isdigit() for c in p))
    assert tok.decode(tok.encode(text).ids) == text
    seventy = tok.encode(" 70").ids
    assert tok.encode("Account 70").ids[-2:] == tok.encode("account 70").ids[-2:] == seventy[-2:]


def test_split_digits_refuses_a_run_with_a_merged_tokenizer(toy_dirs, tmp_path):
    """--split-digits on a run directory whose cached tokenizer merges digits stops with a one-line error."""
    from training.tokenizer import save_tokenizer, train_tokenizer
    from training.train import parse_args, prepare

    code, docs = toy_dirs
    texts = load_corpus(code_dir=code, docs_dir=docs, percent=20).texts() + ["70 70 70"] * 50
    save_tokenizer(train_tokenizer(texts, 600), str(tmp_path / "run" / "tokenizer"))
    args = parse_args(["--run", str(tmp_path / "run"), "--code-dir", code, "--docs-dir", docs, "--split-digits"])
    with pytest.raises(SystemExit, match="merges digits"):
        prepare(args)


def test_repeat_and_symbol_sequences(toy_dirs):
    """p_repeat tiles a real-text window; p_symbols repeats random digit tokens (both copy-only targets)."""
    import numpy as np

    from training.data import BatchSampler
    from training.tokenizer import train_tokenizer

    code, docs = toy_dirs
    corpus = load_corpus(code_dir=code, docs_dir=docs, percent=20)
    tok = train_tokenizer(corpus.texts() + ["12 345 6789 2024 17 99"] * 20, 600)
    ids = np.asarray(tok.encode(" ".join(corpus.texts()) + " 12 345 6789 17 99").ids, dtype=np.int32)
    s = BatchSampler(tok, corpus, {"code": ids, "prose": ids}, seed=5, p_retrieval=0.0)
    s.p_repeat = 1.0
    x, w = s.sample(64)
    assert len(x) == 65 and (w == 1).all()
    period = next(p for p in range(16, 34) if (x[p:] == x[:-p]).all())
    assert period <= 33
    s.p_repeat, s.p_symbols = 0.0, 1.0
    x, _ = s.sample(64)
    assert (x[33:] == x[:32]).all()
    assert all(tok.id_to_token(int(i)).lstrip("\u0120").isdigit() for i in x)


def test_symbol_episodes_and_frequent_pool(toy_dirs):
    """Short copy episodes back to back over the most frequent tokens; the pool widens on set_symbols."""
    import numpy as np

    from training.data import BatchSampler
    from training.tokenizer import train_tokenizer

    code, docs = toy_dirs
    corpus = load_corpus(code_dir=code, docs_dir=docs, percent=20)
    tok = train_tokenizer(corpus.texts(), 600)
    ids = np.asarray(tok.encode(" ".join(corpus.texts())).ids, dtype=np.int32)
    s = BatchSampler(tok, corpus, {"code": ids, "prose": ids}, seed=3, p_retrieval=0.0)
    s.p_symbols, s.symbol_pool, s.symbol_episodes = 1.0, "frequent", (4, 6)
    s.set_symbols(8)
    x, w = s.sample(127)
    assert len(x) == 128 and (w == 1).all()
    counts = np.bincount(ids, minlength=tok.get_vocab_size())
    top8 = set(np.argsort(-counts)[:8].tolist())
    assert set(x.tolist()) <= top8
    i, episodes = 0, 0
    while i + 12 <= len(x):  # walk the episodes: each is a half of 4..6 symbols and the same half again
        half = next(h for h in (4, 5, 6) if (x[i:i + h] == x[i + h:i + 2 * h]).all())
        i, episodes = i + 2 * half, episodes + 1
    assert episodes >= 10
    s.set_symbols(64)
    x, _ = s.sample(511)
    assert len(set(x.tolist())) > 8
    assert not any(tok.id_to_token(int(t)).startswith("<|") for t in x)


def test_copy_probe_reports_both_copies():
    from training.evaluate import copy_probe
    from training.model import TrunkWithMTP, build_config

    class Tok:
        def encode(self, t):
            return type("E", (), {"ids": [ord(c) % 90 for c in t]})()

    cfg = build_config("qwen3", 96, hidden=32, layers=2, heads=2, kv_heads=1, head_dim=16, intermediate=64)
    cfg._attn_implementation = "sdpa"
    model = TrunkWithMTP(cfg, "qwen3").eval()
    r = copy_probe(model, Tok(), ["abcdefghij" * 20, "short"], window=50)
    assert r["windows"] == 1 and 0.0 <= r["first_copy_top1"] <= 1.0 and 0.0 <= r["second_copy_top1"] <= 1.0


def test_fact_family_weights():
    """Uniform families by default (the shipped eval cases' generator is unchanged); weights shift the mix of
    multi-fact documents; --fact-families names families and rejects unknown ones."""
    from collections import Counter

    from training.corpus import FAMILIES, _needle, distinct_needles
    from training.train import _family_weights, main

    a, b = random.Random(5), random.Random(5)
    assert [_needle(a)["value"] for _ in range(50)] == [_needle(b, None)["value"] for _ in range(50)]
    rng = random.Random(0)
    uniform = Counter(n["family"] for _ in range(600) for n in distinct_needles(rng, 3))
    rng = random.Random(0)
    heavy = Counter(n["family"] for _ in range(600) for n in distinct_needles(rng, 3, (1, 1, 4, 1, 1)))
    assert set(uniform) == set(heavy) == set(FAMILIES)
    assert heavy["account"] > 1.5 * uniform["account"]
    assert heavy["passkey"] < uniform["passkey"]
    assert _family_weights("account=3,budget=1.5") == (1.0, 1.0, 3.0, 1.5, 1.0)
    for bad in ("acount=3", "account=x", "account=-1", "account"):
        with pytest.raises(SystemExit, match="NAME=WEIGHT"):
            _family_weights(bad)
    with pytest.raises(SystemExit, match="above 0"):
        _family_weights("passkey=0,secret=0,account=0,budget=0,code=0")
    with pytest.raises(SystemExit, match="--max-facts 2"):
        main(["--key-weight", "4", "--run", "/nonexistent/never-created"])


def test_key_weight_marks_the_restated_key(toy_dirs):
    """With --key-weight the answer tokens that restate an account number / project get that weight, and nothing
    else does; the default (1.0) leaves the weights as before."""
    import numpy as np

    from training.data import BatchSampler
    from training.tokenizer import train_tokenizer

    code, docs = toy_dirs
    corpus = load_corpus(code_dir=code, docs_dir=docs, percent=20)
    tok = train_tokenizer(corpus.texts(), 600)
    streams = {"code": np.arange(5000, dtype=np.int32) % 500, "prose": np.arange(5000, dtype=np.int32) % 400}
    s = BatchSampler(tok, corpus, streams, seed=1, p_retrieval=1.0, answer_weight=3.0, max_facts=4)
    s.family_weights = (0.0, 0.0, 1.0, 1.0, 0.0)  # accounts and budgets only: every fact has a key
    s.key_weight = 7.0
    keys = 0
    for length in (400, 800):
        ids, w = s._multi_doc(length)
        text = tok.decode(ids.tolist())
        answers = [qa.split("\nAnswer: ")[1] for qa in text.split("\nQuestion: ")[1:]]
        # `Account N balance: ...` -> N; `The approved budget for project P is ...` -> P
        restated = [a.split()[1 if a.startswith("Account") else 5] for a in answers]
        keyed = tok.decode([int(t) for t, x in zip(ids, w) if x == 7.0])
        for k in restated:
            assert k.strip() in keyed
        assert keyed.replace(" ", "") == "".join(k.strip() for k in restated).replace(" ", "")
        keys += len(restated)
    assert keys >= 2
    s.key_weight = 1.0
    _ids, w = s._multi_doc(400)
    assert set(np.unique(w).tolist()) <= {1.0, 3.0}


def test_bf16_autocast_trains_fp32_weights(toy_dirs, tmp_path, monkeypatch, capsys):
    """--autocast bf16 runs forward/backward in bfloat16 and keeps fp32 weights: the same seed gives close but not
    identical weights to the fp32 run; the choice is recorded in the run's meta; without bf16 instructions it warns."""
    from training.train import main

    code, docs = toy_dirs
    common = ["--code-dir", code, "--docs-dir", docs, "--vocab", "400", "--arch", "qwen3",
              "--hidden", "32", "--layers", "2", "--heads", "2", "--kv-heads", "1", "--head-dim", "16",
              "--intermediate", "64", "--time-budget-min", "0", "--max-steps", "2", "--warmup-steps", "1",
              "--curriculum", "[[0, 64, 2]]", "--no-progress", "--threads", "1"]
    models = {}
    monkeypatch.setattr("training.train._has_fast_bf16", lambda: False)
    for mode in ("none", "bf16"):
        torch.manual_seed(0)
        models[mode], meta = main(["--run", str(tmp_path / mode), "--autocast", mode, *common])
        assert meta["args"]["autocast"] == mode and meta["step"] == 2
        warned = "without AMX / AVX-512 BF16" in capsys.readouterr().out
        assert warned == (mode == "bf16")  # a CPU without bf16 instructions is told it will be slow
    fp32, bf16 = (dict(models[m].named_parameters()) for m in ("none", "bf16"))
    assert all(p.dtype == torch.float32 for p in bf16.values())
    diffs = [(fp32[n] - p).abs().max().item() for n, p in bf16.items()]
    assert max(diffs) > 0  # autocast changed the arithmetic
    assert max(diffs) < 5e-2  # ... but trained the same model
