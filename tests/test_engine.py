import pytest
import torch

from tests.hf_tiny import build
from turbospec.config import EngineConfig
from turbospec.demo import make_demo_model
from turbospec.engine import Engine
from turbospec.engine.stops import safe_prefix_len
from turbospec.errors import TurboSpecError
from turbospec.model import load_model
from turbospec.sampling import SamplingParams
from turbospec.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def hf_qwen3(tmp_path_factory):
    return build("qwen3", tmp_path_factory.mktemp("e"))


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    p = make_demo_model(tmp_path_factory.mktemp("d") / "m", hidden_size=32, intermediate_size=64,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                        vocab_size=300)
    return Engine(load_model(p), Tokenizer(p), EngineConfig(ctx=256, ubatch=16))


@pytest.mark.parametrize("ubatch", [5, 64])
def test_greedy_matches_transformers_generate(hf_qwen3, ubatch):
    from transformers import AutoModelForCausalLM

    ids = torch.randint(0, 128, (40,), generator=torch.Generator().manual_seed(5))
    hf = AutoModelForCausalLM.from_pretrained(hf_qwen3, dtype=torch.float32).eval()
    ref = hf.generate(ids[None], max_new_tokens=24, do_sample=False, min_new_tokens=24)[0, 40:].tolist()
    eng = Engine(load_model(hf_qwen3), None, EngineConfig(ctx=128, ubatch=ubatch))
    out = eng.generate([ids.tolist()], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0]
    assert out["tokens"] == ref
    assert out["stats"].gen_tokens == 24 and out["stats"].finish_reason == "length"


def test_seeded_sampling_reproducible(demo):
    p = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=7, max_tokens=20, ignore_eos=True)
    a = demo.generate(["abc"], p)[0]["tokens"]
    b = demo.generate(["abc"], p)[0]["tokens"]
    c = demo.generate(["abc"], SamplingParams(**{**p.__dict__, "seed": 8}))[0]["tokens"]
    assert a == b and a != c


def test_stream_equals_batch(demo):
    p = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    streamed = list(demo.stream("hi there", p))
    batch = demo.generate(["hi there"], p)[0]
    assert [t for c in streamed for t in c.tokens] == batch["tokens"]
    assert "".join(c.text for c in streamed) == batch["text"]


def test_stop_string_cuts_output(demo):
    p = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    full = demo.generate(["xyz"], p)[0]["text"]
    if len(full) < 4:
        pytest.skip("random model produced too little text")
    stop = full[2:4]
    out = demo.generate(["xyz"], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop]))[0]
    assert out["text"] == full[: full.find(stop)]
    assert out["stats"].finish_reason == "stop"


def test_eos_stops(demo):
    p = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    toks = demo.generate(["q"], p)[0]["tokens"]
    old = demo.model.cfg.eos_token_ids
    demo.model.cfg.eos_token_ids = (toks[3],)
    try:
        out = demo.generate(["q"], SamplingParams(temperature=0, max_tokens=30))[0]
    finally:
        demo.model.cfg.eos_token_ids = old
    assert out["tokens"] == toks[: toks.index(toks[3])]  # the EOS token itself is not emitted
    assert out["stats"].finish_reason == "stop"


def test_context_overflow_is_clear_error(demo):
    with pytest.raises(TurboSpecError, match="exceeds context size"):
        list(demo.stream("a" * 300, SamplingParams(max_tokens=10)))


def test_chat_template(demo):
    text = demo.tokenizer.render_chat([{"role": "user", "content": "hi"}])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_safe_prefix():
    assert safe_prefix_len("hello wo", ["world"]) == 6
    assert safe_prefix_len("abc", ["x"]) == 3


@pytest.mark.parametrize("rows", [1, 5, 30])
def test_prefill_rows_across_chunks(hf_qwen3, rows):
    """Engine.prefill(tokens, rows) returns the hidden rows of the last `rows` prompt positions even when they span
    ubatch chunks (each chunk's last layer computes only the rows kept), equal to the full computation's."""
    model = load_model(hf_qwen3, "float32")
    ids = torch.randint(0, 128, (45,), generator=torch.Generator().manual_seed(2)).tolist()
    full = Engine(model, None, EngineConfig(ctx=64, ubatch=20, prefix_cache=False)).prefill(ids, None)
    got = Engine(model, None, EngineConfig(ctx=64, ubatch=20, prefix_cache=False)).prefill(ids, rows)
    assert full.shape[0] == 45 and got.shape[0] == rows
    assert torch.allclose(got, full[-rows:], atol=1e-5)


def test_prefix_reuse_finds_where_a_long_prompt_diverges(tmp_path):
    """The next prompt resumes at the first token that differs from the cached one, wherever that falls (the
    comparison runs over slices of 4096 tokens first); its output equals a cold engine's."""
    p = make_demo_model(tmp_path / "m", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=1, head_dim=16, vocab_size=300)
    model = load_model(p)
    eng = Engine(model, None, EngineConfig(ctx=9000))
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    prompt = torch.randint(3, 300, (8800,), generator=torch.Generator().manual_seed(0)).tolist()
    eng.generate([prompt], sp)
    for at in (8500, 4096, 4095, 100):
        other = prompt[:at] + [(prompt[at] + 1) % 297 + 3] + prompt[at + 1:8600]
        got = eng.generate([other], sp)[0]
        assert eng.reused_tokens == at and got["stats"].cached_tokens == at
        cold = Engine(model, None, EngineConfig(ctx=9000)).generate([other], sp)[0]
        assert got["tokens"] == cold["tokens"]
        prompt = other
