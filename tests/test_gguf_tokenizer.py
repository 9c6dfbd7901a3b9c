"""Tokenizers rebuilt from GGUF metadata (Tokenizer.from_gguf) tokenize, decode and render chats exactly as the
Hugging Face tokenizer of the checkpoint they were converted from.

The GGUF metadata is written the way llama.cpp's convert_hf_to_gguf.py writes it (token list padded to the
vocabulary size, token types from the added tokens, merges as "a b" strings, special ids, chat template), with
gguf.GGUFWriter, and read back with gguf.GGUFReader."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from turbospec.errors import TurboSpecError
from turbospec.tokenizer import StreamDecoder, Tokenizer, gguf_metadata

gguf = pytest.importorskip("gguf")

MODELS = Path(__file__).resolve().parents[1] / "models"

TEXTS = [
    "Hello, world! It's a test; we'll see. I'VE DONE IT, they'd've said.",
    "def f(x):\n    return x ** 2  # square\n\n\tif x != 0:\n\t\tprint(f'{x=}')\r\n",
    "numbers: 0 7 42 123 4567 1234567890 3.14159 -2e10 1,000,000 x1y22z333",
    "unicode: naïve café Ærøskøbing Straße ÿ Ωμέγα Привет мир العربية हिन्दी",
    "cjk: 我想在apple工作1314151天～ 日本語のテキスト 한국어 텍스트",
    "emoji: 🚀 😶\u200d🌫️ 🦙🦙 👍🏽 🏳️\u200d🌈 ✅",
    "whitespace:   two  three   \n\n\n four\t\t\ttabs   \n   trailing   ",
    "combining: e\u0301 a\u0300 n\u0303 (decomposed) vs é à ñ",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\nok<|im_end|><|endoftext|>",
    "<|im_end|><|im_end|>x<|im_start|> <|endoftext|>\n",
    "''''''```````\"\"\"\"......!!!!!!?????? ------=======",
    "",
    " ",
    "a",
]
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Sum 12 and 30, please. 🙂"},
    {"role": "assistant", "content": "42"},
    {"role": "user", "content": "And in 日本語?"},
]


def looks_special(t: str) -> bool:  # convert_hf_to_gguf's does_token_look_special, the part byte-level BPE needs
    return (t.startswith("<|") and t.endswith("|>")) or t in ("<pad>", "<mask>")


def gguf_fields(tokenizer_json: dict[str, Any], tokenizer_config: dict[str, Any], vocab_size: int, pre: str,
                path: Path, **extra: Any) -> dict[str, Any]:
    """Write the tokenizer's GGUF metadata as llama.cpp's converter does, read it back with GGUFReader."""
    vocab = dict(tokenizer_json["model"]["vocab"])
    added = {a["content"]: a for a in tokenizer_json["added_tokens"]}
    for a in added.values():
        vocab[a["content"]] = a["id"]
    rev = {i: t for t, i in vocab.items()}
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in rev:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        elif rev[i] in added:
            tokens.append(rev[i])
            types.append(gguf.TokenType.CONTROL if added[rev[i]]["special"] or looks_special(rev[i])
                         else gguf.TokenType.USER_DEFINED)
        else:
            tokens.append(rev[i])
            types.append(gguf.TokenType.NORMAL)
    merges = [m if isinstance(m, str) else " ".join(m) for m in tokenizer_json["model"]["merges"]]

    w = gguf.GGUFWriter(path, "qwen3")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    for kind in ("bos", "eos"):
        t = tokenizer_config.get(f"{kind}_token")
        t = t.get("content") if isinstance(t, dict) else t
        if t is not None:
            getattr(w, f"add_{kind}_token_id")(vocab[t])
    if "add_bos_token" in tokenizer_config:
        w.add_add_bos_token(bool(tokenizer_config["add_bos_token"]))
    if tokenizer_config.get("chat_template"):
        w.add_chat_template(tokenizer_config["chat_template"])
    return read_back(w, path, extra)


def read_back(w: Any, path: Path, extra: dict[str, Any]) -> dict[str, Any]:
    """Add the `extra` keys (GGUFWriter's add_<key>) to `w`, write it, and read the metadata back with GGUFReader."""
    for k, v in extra.items():
        getattr(w, f"add_{k}")(v)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    return gguf_metadata(gguf.GGUFReader(path))


def same_tokenizer(ref: Tokenizer, got: Tokenizer, texts: list[str] = TEXTS) -> None:
    assert got.vocab_size == ref.vocab_size
    assert (got.bos_token, got.eos_token, got.add_bos, got.eos_ids) == \
        (ref.bos_token, ref.eos_token, ref.add_bos, ref.eos_ids)
    for text in texts:
        ids = ref.encode(text)
        assert got.encode(text) == ids, text
        assert got.encode(text, add_special=False) == ref.encode(text, add_special=False), text
        assert got.decode(ids) == ref.decode(ids), text
        assert got.decode(ids, skip_special=False) == ref.decode(ids, skip_special=False) == text, text
        sd_ref, sd_got = StreamDecoder(ref), StreamDecoder(got)
        assert [sd_got.push(i) for i in ids] == [sd_ref.push(i) for i in ids], text
    every = list(range(ref.vocab_size))
    assert got.decode(every, skip_special=False) == ref.decode(every, skip_special=False)
    assert got.decode(every) == ref.decode(every)


# the bundled tokenizers: turbospec-tiny splits digits (Digits(individual) + ByteLevel: llama.cpp's "smollm" /
# "starcoder"), turbospec-tiny-hybrid is plain GPT-2 ByteLevel ("gpt-2")
BUNDLED = [("turbospec-tiny", "smollm"), ("turbospec-tiny", "starcoder"), ("turbospec-tiny-hybrid", "gpt-2")]


@pytest.mark.parametrize(("name", "pre"), BUNDLED)
def test_bundled_tokenizer_round_trips(name: str, pre: str, tmp_path: Path) -> None:
    d = MODELS / name
    if not (d / "tokenizer.json").exists():
        pytest.skip("no bundled tokenizer")
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    vocab_size = json.loads((d / "config.json").read_text()).get("vocab_size", 8192)
    fields = gguf_fields(json.loads((d / "tokenizer.json").read_text()), cfg, vocab_size, pre, tmp_path / "t.gguf")
    ref, got = Tokenizer(d), Tokenizer.from_gguf(fields)
    same_tokenizer(ref, got)
    assert got.chat_template == ref.chat_template
    for gen in (True, False):
        assert got.render_chat(MESSAGES, add_generation_prompt=gen) == ref.render_chat(MESSAGES, gen)
    assert got.supports_tools == ref.supports_tools
    assert got.eos_ids == {ref.tok.token_to_id("<|endoftext|>"), ref.tok.token_to_id("<|im_end|>")}


def test_pre_tokenizer_name_matters(tmp_path: Path) -> None:
    """turbospec-tiny-hybrid (merges like "Ġ1", "00") read with the digit-splitting "smollm" split tokenizes numbers
    differently from its own GPT-2 split: the name is used."""
    d = MODELS / "turbospec-tiny-hybrid"
    if not (d / "tokenizer.json").exists():
        pytest.skip("no bundled tokenizer")
    fields = gguf_fields(json.loads((d / "tokenizer.json").read_text()),
                         json.loads((d / "tokenizer_config.json").read_text()), 8192, "smollm", tmp_path / "t.gguf")
    assert Tokenizer.from_gguf(fields).encode("x 1000 12") != Tokenizer(d).encode("x 1000 12")


CORPUS = (TEXTS + [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "I'm sure you've heard they'll come; she's here and we'd go. DON'T, CAN'T, I'M.",
    "for (int i = 0; i < 100; ++i) { sum += a[i] * b[i]; }\n",
    "人工智能正在改变世界。我们需要学习新的技能。",
    "東京は日本の首都です。カタカナとひらがな。",
    "Ünïcödé tëxt wïth dïäcrïtïcs and Ελληνικά κείμενα.",
]) * 4

TRICKY = [
    "1234567890 12 345 6789 3.14 1e-5 ۱۲۳ ٤٥٦ ①②③ ²³",
    "I'm, you're, he's, we've, they'll, I'd, DON'T, She'S, 'twas, o'clock, rock'n'roll",
    "中文文本：你好，世界！我想在apple工作1314151天～",
    "line1\nline2\r\nline3\n\n\nline4\r\r\n  \n\t\n",
    "  leading and trailing  ", "x\u0301y\u0308 e\u0301te\u0301 (combining marks)", "(paren) [bracket] {brace}",
    "hello<|im_end|>world<|im_start|>system\nx", "<think>\nhmm\n</think>\n\nanswer", "emoji 🤖🧠 👩‍💻",
    "!!!???...,,,;;;::: ---___ ```code```", "über straße ÆØÅ",
]


def pair(merge: str) -> tuple[str, str]:
    a, b = merge.split(" ")
    return a, b


def splits(pre: str | tuple[str, ...]) -> list[Any]:
    """`tokenizers` pre-tokenizers: each regex of `pre` isolating its matches in turn, then the byte-level step."""
    from tokenizers import Regex, pre_tokenizers

    return [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in ((pre,) if isinstance(pre, str) else pre)] + \
        [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]


def trained(pre: str | tuple[str, ...]) -> tuple[dict[str, int], list[str]]:
    """A small byte-level BPE (vocabulary, merges) trained with `pre` as its pre-tokenizer regex (or regexes)."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers, trainers

    t = HFTokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.Sequence(splits(pre))
    t.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=700, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    j = json.loads(t.to_str())
    return j["model"]["vocab"], [" ".join(m) for m in j["model"]["merges"]]


def bpe_pair(pre: str | tuple[str, ...]) -> tuple[dict[str, int], list[str], Any]:
    """A BPE trained with the split(s) `pre` (vocabulary, merges) and a `tokenizers` reference of it (merges not
    ignored, byte-level decoding)."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    vocab, merges = trained(pre)
    ref = HFTokenizer(models.BPE(vocab=dict(vocab), merges=[pair(m) for m in merges]))
    ref.pre_tokenizer = pre_tokenizers.Sequence(splits(pre))
    ref.decoder = decoders.ByteLevel()
    return vocab, merges, ref


def bpe_gguf(path: Path, arch: str, pre: str, vocab: dict[str, int], merges: list[str]) -> Tokenizer:
    """The vocabulary and merges written as a GGUF file's byte-level BPE tokenizer with pre-tokenizer `pre`, read
    back by Tokenizer.from_gguf."""
    w = gguf.GGUFWriter(path, arch)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list([t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])])
    w.add_token_merges(merges)
    return Tokenizer.from_gguf(read_back(w, path, {}))


QWEN_TEMPLATE = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
                 "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


@pytest.mark.parametrize(("pre", "cls_path"), [("qwen2", "transformers.models.qwen2.tokenization_qwen2.Qwen2Tokenizer"),
                                               # (llama.cpp's name for the DeepSeek-R1 distills of Qwen: qwen2's split)
                                               ("deepseek-r1-qwen",
                                                "transformers.models.qwen2.tokenization_qwen2.Qwen2Tokenizer"),
                                               ("qwen35", "transformers.models.qwen3_5.tokenization_qwen3_5"
                                                          ".Qwen3_5Tokenizer")])
def test_qwen_pre_tokenizers_match_transformers(pre: str, cls_path: str, tmp_path: Path) -> None:
    """A Qwen-style tokenizer as transformers builds it (its own regex, NFC, ByteLevel) is the reference."""
    import importlib

    from tokenizers import AddedToken

    module, _, name = cls_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        pytest.skip(f"transformers has no {name}")
    vocab, merges = trained(importlib.import_module(module).PRETOKENIZE_REGEX)
    hf = cls(vocab=dict(vocab), merges=[pair(m) for m in merges])
    n = len(vocab)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    hf.add_tokens([AddedToken(s, special=True, normalized=False) for s in specials if s not in hf.get_vocab()])
    hf.add_tokens([AddedToken(s, special=False, normalized=False) for s in ("<think>", "</think>")])
    added = {t.content: (i, t.special) for i, t in hf.added_tokens_decoder.items()}
    tokens = [f"[PAD{i}]" for i in range(n + 16)]  # the converter's fillers up to the embedding rows
    types = [gguf.TokenType.UNUSED] * (n + 16)
    for t, i in vocab.items():
        tokens[i], types[i] = t, gguf.TokenType.NORMAL
    for t, (i, special) in added.items():
        tokens[i] = t
        types[i] = gguf.TokenType.CONTROL if special or looks_special(t) else gguf.TokenType.USER_DEFINED

    w = gguf.GGUFWriter(tmp_path / "q.gguf", "qwen3")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_eos_token_id(added["<|im_end|>"][0])
    w.add_bos_token_id(added["<|endoftext|>"][0])
    w.add_add_bos_token(False)
    w.add_chat_template(QWEN_TEMPLATE)
    got = Tokenizer.from_gguf(read_back(w, tmp_path / "q.gguf", {}))

    assert got.vocab_size == len(hf.get_vocab())
    for text in TRICKY + TEXTS:
        ids = hf.encode(text, add_special_tokens=False)
        assert got.encode(text) == ids, text
        assert got.decode(ids) == hf.decode(ids, skip_special_tokens=True), text
        assert got.decode(ids, skip_special=False) == hf.decode(ids, skip_special_tokens=False), text
    assert got.eos_token == "<|im_end|>" and got.eos_ids == {added["<|im_end|>"][0]}
    assert got.bos_token == "<|endoftext|>" and not got.add_bos
    assert got.render_chat(MESSAGES) == hf.apply_chat_template(MESSAGES, chat_template=QWEN_TEMPLATE, tokenize=False,
                                                               add_generation_prompt=True)
    # digits one by one, contractions case-insensitive, NFC: the Qwen split, not the GPT-2 one
    assert len(got.encode("1234567")) == 7
    assert got.encode("e\u0301") == got.encode("\u00e9")


LLAMA3_RE = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
# Mistral Nemo's tokenizer.json (as llama.cpp's src/llama-vocab.cpp quotes it for "tekken")
TEKKEN_RE = r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"""


@pytest.mark.parametrize(("pre", "regex"), [("llama-bpe", LLAMA3_RE), ("tekken", TEKKEN_RE)])
def test_llama3_bpe(tmp_path: Path, pre: str, regex: str) -> None:
    """ "llama-bpe": Llama 3's split (digits in threes), its merges ignored for whole-word tokens, BOS added; "tekken"
    (Mistral Nemo / Small 3) the same but for its split (case changes start words, digits one by one)."""
    from tokenizers import AddedToken, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    vocab, merges = trained(regex)
    n = len(vocab)
    vocab["Ġunreachable"] = n  # a word no merge builds: found whole only because merges are ignored for it
    n += 1
    ref = HFTokenizer(models.BPE(vocab=dict(vocab), merges=[pair(m) for m in merges], ignore_merges=True))
    ref.pre_tokenizer = pre_tokenizers.Sequence(splits(regex))
    ref.decoder = decoders.ByteLevel()
    ref.add_special_tokens([AddedToken("<|begin_of_text|>", normalized=False),
                            AddedToken("<|eot_id|>", normalized=False)])
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])] + ["<|begin_of_text|>", "<|eot_id|>"]
    types = [gguf.TokenType.NORMAL] * n + [gguf.TokenType.CONTROL] * 2
    w = gguf.GGUFWriter(tmp_path / "l.gguf", "llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(n)
    w.add_eos_token_id(n + 1)
    got = Tokenizer.from_gguf(read_back(w, tmp_path / "l.gguf", {}))
    assert got.add_bos and got.bos_token == "<|begin_of_text|>"  # llama.cpp's default for llama-bpe
    assert got.eos_ids == {n + 1}
    for text in TRICKY + TEXTS:
        ids = ref.encode(text, add_special_tokens=False).ids
        assert got.encode(text, add_special=False) == ids, text
        assert got.encode(text) == ([n] + ids if ids[:1] != [n] else ids), text
        assert got.decode(ids) == ref.decode(ids), text
    digits = len(got.encode("1234567", add_special=False))
    assert digits == 7 if pre == "tekken" else digits >= 3
    if pre == "tekken":  # a case change starts a word
        assert got.encode("camelCase", add_special=False) == ref.encode("camel", add_special_tokens=False).ids + \
            ref.encode("Case", add_special_tokens=False).ids
    assert got.encode("a unreachable") == [n, vocab["a"], n - 1]
    assert got.tok.encode("a").ids == [n, vocab["a"]]  # the post-processor adds BOS as Llama 3's does


# OpenAI's o200k split as its tokenizer.json has it (quoted by llama.cpp's src/llama-vocab.cpp for "gpt-4o")
GPT4O_RE = r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"""


def test_gpt4o_bpe(tmp_path: Path) -> None:
    """ "gpt-4o" (Phi-4-mini): the o200k split, merges not ignored, no BOS; against `tokenizers` with that split."""
    vocab, merges, ref = bpe_pair(GPT4O_RE)
    got = bpe_gguf(tmp_path / "o.gguf", "phi3", "gpt-4o", vocab, merges)
    assert not got.add_bos
    for text in TRICKY + TEXTS:
        ids = ref.encode(text, add_special_tokens=False).ids
        assert got.encode(text) == ids, text
        assert got.decode(ids) == ref.decode(ids), text
    assert len(got.encode("1234567")) >= 3 and got.encode("I'M") == ref.encode("I'M").ids


# DeepSeek LLM's and DeepSeek Coder's tokenizer.json splits, as llama.cpp's src/llama-vocab.cpp quotes them (as
# escapes: text tools normalise some of these characters to their canonical equivalents)
DEEPSEEK_LLM_RES = (
    "[\\r\\n]",
    "\\s?[A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af\u0370-"
    "\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481"
    "\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b"
    "\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b"
    "\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb"
    "\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128"
    "\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4"
    "\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf"
    "\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-"
    "\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943]+",
    "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
    "\\s+$",
    "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+",
    "\\p{N}+",
)
DEEPSEEK_CODER_RES = ("[\\r\\n]", "\\s?\\p{L}+", "\\s?\\p{P}+", "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+", "\\p{N}")


@pytest.mark.parametrize(("pre", "res"), [("deepseek-llm", DEEPSEEK_LLM_RES), ("deepseek-coder", DEEPSEEK_CODER_RES)])
def test_deepseek_bpe(tmp_path: Path, pre: str, res: tuple[str, ...]) -> None:
    """ "deepseek-llm" / "deepseek-coder" (DeepSeek LLM, DeepSeek Coder: llama-architecture files): their sequences of
    splits, merges not ignored, no BOS by default; against `tokenizers` with those splits, and `export-gguf` names
    them from a tokenizer.json."""
    from turbospec.model.gguf_export import pre_tokenizer_name

    vocab, merges, ref = bpe_pair(res)
    got = bpe_gguf(tmp_path / "d.gguf", "llama", pre, vocab, merges)
    assert not got.add_bos
    for text in TRICKY + TEXTS:
        ids = ref.encode(text, add_special_tokens=False).ids
        assert got.encode(text) == ids, text
        assert got.decode(ids) == ref.decode(ids), text
    pieces = [p for p, _ in got.tok.pre_tokenizer.pre_tokenize_str("Hello, world!\n1234 \u4f60\u597d  ")]
    # words with the space before them, punctuation, line breaks, CJK runs apart from the space before them; DeepSeek
    # Coder's digits one by one, DeepSeek LLM's runs of them whole
    digits = ["1", "2", "3", "4"] if pre == "deepseek-coder" else ["1234"]
    assert pieces == ["Hello", ",", "Ġworld", "!", "Ċ", *digits, "Ġ", "ä½łå¥½", "ĠĠ"]
    as_json = json.loads(ref.to_str())
    assert pre_tokenizer_name(as_json) == pre
    as_json["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = "[\r\n]"  # the line breaks themselves
    assert pre_tokenizer_name(as_json) == pre


def test_gguf_metadata_values(tmp_path: Path) -> None:
    w = gguf.GGUFWriter(tmp_path / "m.gguf", "qwen3")
    w.add_uint32("a.u32", 7)
    w.add_int32("a.i32", -3)
    w.add_uint64("a.u64", 2**40)
    w.add_float32("a.f32", 0.5)
    w.add_bool("a.bool", True)
    w.add_string("a.str", "héllo ✓")
    w.add_array("a.ints", [1, 2, 3])
    w.add_array("a.strs", ["x", "", "ü"])
    m = read_back(w, tmp_path / "m.gguf", {})
    assert m["general.architecture"] == "qwen3"
    want = {"a.u32": 7, "a.i32": -3, "a.u64": 2**40, "a.f32": 0.5, "a.bool": True, "a.str": "héllo ✓",
            "a.ints": [1, 2, 3], "a.strs": ["x", "", "ü"]}
    for k, v in want.items():
        assert m[k] == v and type(m[k]) is type(v), k
    assert all(type(x) is int for x in m["a.ints"])


BASE = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt-2", "tokenizer.ggml.tokens": ["a", "b", "ab"],
        "tokenizer.ggml.token_type": [1, 1, 1], "tokenizer.ggml.merges": ["a b"]}


@pytest.mark.parametrize(("change", "message"), [
    ({"tokenizer.ggml.model": "t5"}, "'t5' is not supported (supported: 'gpt2', byte-level BPE; 'llama'"),
    ({"tokenizer.ggml.model": "llama"}, "tokenizer.ggml.scores must be 3 numbers (one per token)"),
    ({"tokenizer.ggml.model": "llama", "tokenizer.ggml.scores": [0.0, "x", 1.0]}, "tokenizer.ggml.scores must be"),
    ({"tokenizer.ggml.model": "llama", "tokenizer.ggml.scores": [0.0] * 3, "tokenizer.ggml.add_space_prefix": 1},
     "add_space_prefix 1 is not a bool"),
    ({"tokenizer.ggml.model": None}, "no tokenizer.ggml.model"),
    ({"tokenizer.ggml.pre": "klingon"}, "tokenizer.ggml.pre 'klingon' is not supported (supported: dbrx, deepseek-coder, deepseek-llm, deepseek-r1-qwen, "),
    ({"tokenizer.ggml.tokens": None}, "tokenizer.ggml.tokens is missing"),
    ({"tokenizer.ggml.tokens": ["a", 2, "ab"]}, "tokenizer.ggml.tokens is missing or not a list of strings"),
    ({"tokenizer.ggml.merges": None}, "tokenizer.ggml.merges is missing"),
    ({"tokenizer.ggml.merges": ["ab"]}, "merge 'ab' is not two tokens"),
    ({"tokenizer.ggml.merges": ["a c"]}, "cannot build it"),
    ({"tokenizer.ggml.token_type": [1, 1]}, "token_type must be 3 integers"),
    ({"tokenizer.ggml.token_type": "x"}, "token_type must be 3 integers"),
    ({"tokenizer.ggml.eos_token_id": 3}, "eos_token_id 3 is not a token id (vocabulary of 3)"),
    ({"tokenizer.ggml.bos_token_id": "0"}, "bos_token_id '0' is not a token id"),
    ({"tokenizer.ggml.add_bos_token": 1}, "add_bos_token 1 is not a bool"),
    ({"tokenizer.chat_template": ["x"]}, "chat_template is not a string"),
])
def test_bad_metadata_is_one_line_error(change: dict[str, Any], message: str) -> None:
    fields = {k: v for k, v in {**BASE, **change}.items() if v is not None}
    with pytest.raises(TurboSpecError) as e:
        Tokenizer.from_gguf(fields)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_minimal_metadata() -> None:
    t = Tokenizer.from_gguf({k: v for k, v in BASE.items() if k != "tokenizer.ggml.pre"})  # llama.cpp: "default"
    assert t.encode("abab") == [2, 2] and t.vocab_size == 3
    assert t.decode(t.encode("ab")) == "ab" and t.eos_ids == set() and t.chat_template is None
    with pytest.raises(TurboSpecError, match="no chat template"):
        t.render_chat([{"role": "user", "content": "x"}])
    with pytest.raises(TurboSpecError, match="metadata must be a dict"):
        Tokenizer.from_gguf([])  # type: ignore[arg-type]


def spm_model(tmp_path: Path, **options: Any):
    """A small SentencePiece BPE model trained as Llama 2's was (byte fallback, digits split, whitespace kept)."""
    spm = pytest.importorskip("sentencepiece")
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS), model_prefix=str(tmp_path / "sp"), vocab_size=900, model_type="bpe",
        byte_fallback=True, split_digits=True, allow_whitespace_only_pieces=True, remove_extra_whitespaces=False,
        normalization_rule_name="identity", character_coverage=0.98, bos_id=1, eos_id=2, unk_id=0,
        max_sentence_length=100000, minloglevel=2, **options)
    return spm.SentencePieceProcessor(model_file=str(tmp_path / "sp.model"))


def spm_gguf(sp: Any, path: Path, **extra: Any) -> dict[str, Any]:
    """The SentencePiece model's GGUF metadata as llama.cpp's converter writes it (`_create_vocab_sentencepiece`:
    pieces, scores, types; model "llama", pre "default"), read back with GGUFReader."""
    n = sp.get_piece_size()
    tokens = [sp.id_to_piece(i) for i in range(n)]
    types = [gguf.TokenType.UNKNOWN if sp.is_unknown(i) else gguf.TokenType.CONTROL if sp.is_control(i) else
             gguf.TokenType.UNUSED if sp.is_unused(i) else gguf.TokenType.BYTE if sp.is_byte(i) else
             gguf.TokenType.NORMAL for i in range(n)]
    w = gguf.GGUFWriter(path, "llama")
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores([sp.get_score(i) for i in range(n)])
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    return read_back(w, path, extra)


SPM_TEXTS = [t for t in TRICKY + TEXTS if "<" not in t] + [
    "Hello world", " Hello", "  two leading", "trailing  ", "a\n\nb", "tab\there", "x" * 40, "naïve façade",
    "rare: ☃ ♞ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ꙮ", "mixed123abc456", "\u00a0nbsp\u3000ideographic space"]


def test_sentencepiece_bpe(tmp_path: Path) -> None:
    """"llama" (SentencePiece BPE, Llama 2 / Mistral 7B files): the tokenizer rebuilt from pieces, scores and types
    tokenizes and decodes as the `sentencepiece` library does with the model (a space before the text, byte tokens
    for characters outside the vocabulary), and adds BOS."""
    sp = spm_model(tmp_path)
    got = Tokenizer.from_gguf(spm_gguf(sp, tmp_path / "s.gguf"))
    assert got.add_bos and got.bos_token == "<s>" and got.eos_ids == {2}
    bytes_used = 0
    for text in SPM_TEXTS + CORPUS[:6]:
        ids = sp.encode(text)
        assert got.encode(text, add_special=False) == ids, (text, got.encode(text, add_special=False), ids)
        assert got.encode(text) == [1] + ids
        assert got.decode(ids) == sp.decode(ids), text
        bytes_used += sum(sp.is_byte(i) for i in ids)
        dec = StreamDecoder(got)
        assert "".join(dec.push(i) for i in ids) == got.decode(ids), text
    assert bytes_used > 0  # characters outside the vocabulary took the byte fallback
    # a special token in the text is its id, and the text after it starts a word again (llama.cpp's space prefix)
    assert got.encode("hi</s>there", add_special=False) == sp.encode("hi") + [2] + sp.encode("there")


def test_sentencepiece_without_space_prefix(tmp_path: Path) -> None:
    sp = spm_model(tmp_path, add_dummy_prefix=False)
    got = Tokenizer.from_gguf(spm_gguf(sp, tmp_path / "s.gguf", add_space_prefix=False))
    for text in SPM_TEXTS:
        assert got.encode(text, add_special=False) == sp.encode(text), text
        assert got.decode(sp.encode(text)) == sp.decode(sp.encode(text)), text
