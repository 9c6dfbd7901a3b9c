"""Text tokenization of GGUF files against llama.cpp itself, for every byte-level pre-tokenizer turbospec reads
(`tokenizer.ggml.pre`): a BPE vocabulary trained with that pre-tokenizer on the tokenizer tests' corpus, in a tiny
random Llama checkpoint converted by llama.cpp's own `convert_hf_to_gguf.py` (told the pre-tokenizer's name: its
list of known vocabularies is keyed by hashes of released tokenizers); then llama-server's `/tokenize` against
turbospec's `Tokenizer.from_gguf` on the tests' texts and `--random` random strings (letters, digits, punctuation and
symbols of several scripts, CJK, Hangul, emoji, combining marks, tabs, line breaks and runs of spaces): the number of
texts whose token ids differ (and how many of them hold combining marks), with the first few of them. Then a DeepSeek
Coder instruct tokenizer (its special tokens, BOS and chat template) the same way: the prompt each engine renders for
a conversation (llama-server's `/apply-template`) and its token ids.

    python benchmarks/gguf_tokenize.py --llama-cpp <llama-cpp-python sdist>/vendor/llama.cpp \\
        [--random 2000] [--json docs/results/gguf_tokenize.json]

`--llama-cpp` is a llama.cpp source tree with `build/bin/llama-server` built (see docs/gguf.md)."""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import unicodedata
from pathlib import Path

import httpx
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gguf_families import CONVERT  # noqa: E402  (llama.cpp's converter, told the pre-tokenizer's name)

# one name per distinct pre-tokenizer (the others in turbospec/tokenizer.py's table are aliases of these)
NAMES = ["gpt-2", "starcoder", "qwen2", "qwen35", "llama-bpe", "smaug-bpe", "tekken", "gpt-4o", "deepseek-llm",
         "deepseek-coder", "default"]
POOLS = ["abcdefghijklmnopqrstuvwxyz", "ABCDEFGHIJKLMNOPQRSTUVWXYZ", "0123456789", " ", "  \t", "\n\r",
         "!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~", "'s't're've'm'll'd", "àéîõüçñßøæÀÉÎÕÜÇÑØÆÿ", "αβγδεζηθΩΣΔ",
         "абвгдежзийЖЩЯ", "你好世界人工智能中文", "日本語のテキストカタカナ", "한국어텍스트", "٠١٢٣٤٥۱۲۳", "①②③²³½",
         "→←∑∞≠≤±×÷§¶•…“”‘’—–", "！？。，、：；（）～", "\u0301\u0300\u0308\u0303", "🚀😶🦙👍🏽🤖\u200d",
         "µÀΆᴀℂ𐐀Ｚａ"]


def random_texts(n: int, seed: int = 0) -> list[str]:
    rnd = random.Random(seed)
    out = []
    for _ in range(n):
        pools = rnd.sample(POOLS, rnd.randint(1, 4))
        out.append("".join(rnd.choice(rnd.choice(pools)) for _ in range(rnd.randint(1, 40))))
    return out


def has_marks(text: str) -> bool:
    """Whether the text holds a combining mark (Unicode category M*): where NFC normalisation and \\p{M} matter."""
    return any(unicodedata.category(c).startswith("M") for c in text)


def tokenizer_json(pre: str, specials: tuple[str, ...] = ("<|endoftext|>",)) -> str:
    """A byte-level BPE trained with turbospec's pre-tokenizer (and normalizer) for `pre`, as a tokenizer.json
    (`specials`: its special tokens, the first ids)."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import pre_tokenizers, trainers

    from tests.test_gguf_tokenizer import CORPUS, TEXTS, TRICKY
    from turbospec.tokenizer import _PRE

    normalizer, pre_tokenizer, ignore_merges, _ = _PRE[pre]
    empty = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": [], "normalizer": normalizer,
             "pre_tokenizer": pre_tokenizer, "post_processor": None,
             "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
             "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                       "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                       "ignore_merges": ignore_merges, "vocab": {}, "merges": []}}
    t = HFTokenizer.from_str(json.dumps(empty))
    t.train_from_iterator(CORPUS + TRICKY + TEXTS + random_texts(300, seed=1), trainers.BpeTrainer(
        vocab_size=1000, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
        special_tokens=list(specials)))
    return t.to_str()


# DeepSeek Coder's instruct tokenizer: its special tokens and chat template (deepseek-coder-6.7b-instruct's
# tokenizer_config.json), BOS added
DEEPSEEK_SPECIALS = ("<\uff5cbegin\u2581of\u2581sentence\uff5c>", "<\uff5cend\u2581of\u2581sentence\uff5c>", "<|EOT|>",
                     "<\uff5cfim\u2581hole\uff5c>")
DEEPSEEK_TEMPLATE = (
    "{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}{% endif %}"
    "{%- set ns = namespace(found=false) -%}{%- for message in messages -%}{%- if message['role'] == 'system' -%}"
    "{%- set ns.found = true -%}{%- endif -%}{%- endfor -%}{{bos_token}}{%- if not ns.found -%}"
    "{{'You are an AI programming assistant, utilizing the Deepseek Coder model, developed by Deepseek Company, and "
    "you only answer questions related to computer science.\\n'}}{%- endif %}{%- for message in messages %}"
    "{%- if message['role'] == 'system' %}{{ message['content'] }}{%- else %}{%- if message['role'] == 'user' %}"
    "{{'### Instruction:\\n' + message['content'] + '\\n'}}{%- else %}"
    "{{'### Response:\\n' + message['content'] + '\\n<|EOT|>\\n'}}{%- endif %}{%- endif %}{%- endfor %}"
    "{% if add_generation_prompt %}{{'### Response:'}}{% endif %}")
CHATS = [
    [{"role": "user", "content": "Write a function that adds 2 and 40 in Python."}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Sum 12 and 30, please."},
     {"role": "assistant", "content": "42"}, {"role": "user", "content": "And in \u65e5\u672c\u8a9e?"}],
]


def converted(tree: Path, out: Path, name: str, tok: str, pre: str, config: dict) -> Path:
    """A tiny random Llama with tokenizer.json `tok` and tokenizer_config.json `config` (its BOS and EOS tokens),
    converted by llama.cpp's converter (told the pre-tokenizer `pre`) into out/name.gguf."""
    from tests import hf_tiny

    vocab = json.loads(tok)["model"]["vocab"]
    cfg_cls, model_cls, extra = hf_tiny.VARIANTS["llama"]
    hf_tiny.VARIANTS["llama_tok"] = (cfg_cls, model_cls, {**extra, "vocab_size": len(vocab),
                                                           "bos_token_id": vocab[config["bos_token"]],
                                                           "eos_token_id": vocab[config["eos_token"]]})
    src = hf_tiny.build("llama_tok", out / name)
    (src / "tokenizer.json").write_text(tok)
    (src / "tokenizer_config.json").write_text(json.dumps(config))
    (out / "convert.py").write_text(CONVERT.format(tree=str(tree), pre=pre))
    path = out / f"{name}.gguf"
    subprocess.run([sys.executable, str(out / "convert.py"), str(src), "--outtype", "f32", "--outfile", str(path)],
                   check=True, capture_output=True, env={**os.environ})
    return path


def chat_check(tree: Path, server: str, out: Path) -> dict:
    """A DeepSeek Coder instruct tokenizer (special tokens, BOS, chat template) through llama.cpp's converter: the
    prompt each engine renders for a conversation (llama-server's /apply-template) and its token ids."""
    import gguf
    from served_speed import free_port
    from served_speed import server as serve

    from turbospec.tokenizer import Tokenizer, gguf_metadata

    path = converted(tree, out, "chat", tokenizer_json("deepseek-coder", DEEPSEEK_SPECIALS), "deepseek-coder", {
        "tokenizer_class": "LlamaTokenizerFast", "bos_token": DEEPSEEK_SPECIALS[0], "eos_token": "<|EOT|>",
        "add_bos_token": True, "add_eos_token": False, "chat_template": DEEPSEEK_TEMPLATE})
    ours = Tokenizer.from_gguf(gguf_metadata(gguf.GGUFReader(path)))
    port = free_port()
    cmd = [server, "-m", str(path), "--port", str(port), "-c", "256", "-np", "1", "--no-warmup", "--jinja"]
    row: dict = {"bos": ours.bos_token, "eos": ours.eos_token, "add_bos": ours.add_bos, "chats": []}
    with serve(cmd, port) as url, httpx.Client(timeout=60) as c:
        for msgs in CHATS:
            theirs = c.post(url + "/apply-template", json={"messages": msgs}).json()["prompt"]
            mine = ours.render_chat(msgs)
            their_ids = c.post(url + "/tokenize", json={"content": theirs, "add_special": True,
                                                       "parse_special": True}).json()["tokens"]
            row["chats"].append({"same_prompt": mine == theirs,
                                 "same_prompt_but_leading_bos": mine.removeprefix(ours.bos_token or "") == theirs,
                                 "same_ids": ours.encode(mine) == their_ids, "ids": len(their_ids),
                                 "bos_first": their_ids[:1] == [ours.tok.token_to_id(ours.bos_token)]})
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-cpp", required=True, help="llama.cpp source tree with build/bin/llama-server")
    ap.add_argument("--random", type=int, default=2000, help="random strings besides the tests' texts")
    ap.add_argument("--names", nargs="*", default=NAMES)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    tree = Path(a.llama_cpp).resolve()
    server = str(tree / "build" / "bin" / "llama-server")
    import gguf
    from served_speed import free_port
    from served_speed import server as serve

    from tests.test_gguf_tokenizer import TEXTS, TRICKY
    from turbospec.tokenizer import _PRE, Tokenizer, gguf_metadata

    texts = TRICKY + TEXTS + random_texts(a.random)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        for pre in a.names:
            path = converted(tree, out, pre, tokenizer_json(pre), pre, {
                "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|endoftext|>",
                "eos_token": "<|endoftext|>", "add_bos_token": False})
            ours = Tokenizer.from_gguf(gguf_metadata(gguf.GGUFReader(path)))
            port = free_port()
            cmd = [server, "-m", str(path), "--port", str(port), "-c", "256", "-np", "1", "--no-warmup",
                   "-t", str(torch.get_num_threads())]
            differ = []
            nfc = (_PRE[pre][0] or {}).get("type") == "NFC"
            with serve(cmd, port) as url, httpx.Client(timeout=60) as c:
                for text in texts:
                    theirs = c.post(url + "/tokenize", json={"content": text, "add_special": False}).json()["tokens"]
                    mine = ours.encode(text, add_special=False)
                    if mine != theirs:
                        d = {"text": text, "turbospec": mine, "llama_cpp": theirs}
                        if nfc:  # llama.cpp given the text as the tokenizer's normaliser leaves it
                            d["llama_cpp_given_nfc_text"] = c.post(url + "/tokenize", json={
                                "content": unicodedata.normalize("NFC", text), "add_special": False}).json()["tokens"]
                        differ.append(d)
            # llama.cpp applies no NFC normalisation (Qwen's tokenizers have it) and runs the Tekken and o200k splits
            # through its general regex path: texts with combining marks are counted apart
            marks = [d for d in differ if has_marks(d["text"])]
            row = {"pre": pre, "vocab": ours.vocab_size, "texts": len(texts), "differ": len(differ),
                   "differ_with_combining_marks": len(marks), "first": differ[:3],
                   "differ_given_nfc_text": sum(d["llama_cpp_given_nfc_text"] != d["turbospec"] for d in differ)
                   if nfc else None,
                   "first_without_marks": [d for d in differ if not has_marks(d["text"])][:3]}
            print(json.dumps(row, ensure_ascii=False)[:600], flush=True)
            rows.append(row)
        chat = chat_check(tree, server, out)
        print(json.dumps(chat, ensure_ascii=False), flush=True)
    if a.json:
        command = " ".join(["python", *sys.argv]).replace(a.llama_cpp, "<llama.cpp>")
        Path(a.json).write_text(json.dumps({"command": command, "rows": rows, "deepseek_coder_chat": chat}, indent=1,
                                           ensure_ascii=False) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
