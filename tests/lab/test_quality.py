import json
import random

import pytest

from turbospec.cli.main import main
from turbospec.demo import make_demo_model
from turbospec.lab.quality import make_retrieval_case
from turbospec.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_demo_model(tmp_path_factory.mktemp("q") / "m", hidden_size=32, intermediate_size=64,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                           vocab_size=300)


def test_retrieval_case_places_the_fact(tiny):
    tok = Tokenizer(tiny)
    filler = tok.encode("lorem ipsum dolor sit amet " * 200, add_special=False)
    for kind in ("passkey", "numbers"):
        ids, value = make_retrieval_case(tok, filler, 400, 0.25, kind, random.Random(1))
        text = tok.decode(ids)
        assert value in text and abs(len(ids) - 400) <= 2
        assert 0.05 < text.index(value) / len(text) < 0.6
        assert text.rstrip().endswith(" is")


def test_quality_table_and_retrieval(tiny, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 40)
    out = tmp_path / "rep"
    rc = main(["quality", "-m", str(tiny), "--text", str(text), "--kv", "f16/f16,q8_0/q8_0,q4_0/q4_0",
               "--ctx", "64", "--chunks", "2", "--retrieval", "--lengths", "96", "--depths", "0.5",
               "--cases", "1", "--out", str(out), "-q", "-t", "1"])
    assert rc == 0
    rep = json.loads((out / "report.json").read_text())
    rows = {r["kv"]: r for r in rep["perplexity"]}
    # baseline vs itself
    assert rows["f16/f16"]["kld_max"] == 0.0 and rows["f16/f16"]["same_top1_pct"] == 100.0
    # coarser codes, larger divergence
    assert rows["q4_0/q4_0"]["kld_mean"] > rows["q8_0/q8_0"]["kld_mean"] > 0
    for r in rows.values():
        assert r["ppl"] > 1 and r["chunks"] == 2
        assert r["kld_median"] <= r["kld_p99"] <= r["kld_p999"] <= r["kld_max"]
    assert len(rep["retrieval"]) == 3 * 2 and all(0 <= r["accuracy"] <= 1 for r in rep["retrieval"])
    for f in ("report.md", "perplexity.csv", "retrieval.csv", "kld.png"):
        assert (out / f).exists()
