"""Byte-level BPE tokenizer for the bundled model (trained with ``tokenizers``)."""

from __future__ import annotations

import json
import os

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

EOT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [EOT, IM_START, IM_END]

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def train_tokenizer(texts, vocab_size: int = 8192, seed_batch: int = 1000, split_digits: bool = False) -> Tokenizer:
    """Byte-level BPE.  ``split_digits``: every digit is its own token (as in Llama and Qwen2), so a number is
    spelled the same way wherever it occurs -- ``70`` is ``7 0`` in ``account 70`` and in ``Account 70``."""
    tok = Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.pre_tokenizer = (pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
                         if split_digits else byte_level)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=True,
    )

    def batches():
        for i in range(0, len(texts), seed_batch):
            yield texts[i:i + seed_batch]

    tok.train_from_iterator(batches(), trainer=trainer, length=len(texts))
    return tok


def save_tokenizer(tok: Tokenizer, out_dir: str, model_max_length: int = 4096) -> None:
    os.makedirs(out_dir, exist_ok=True)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    added = {}
    for t in SPECIAL_TOKENS:
        added[str(tok.token_to_id(t))] = {
            "content": t, "lstrip": False, "normalized": False, "rstrip": False,
            "single_word": False, "special": True,
        }
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": None,
        "eos_token": EOT,
        "pad_token": EOT,
        "unk_token": None,
        "additional_special_tokens": [IM_START, IM_END],
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "add_prefix_space": False,
    }
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f, indent=2)


def token_span(offsets: list[tuple[int, int]], start: int, end: int) -> list[int]:
    """Indices of the tokens (by their character ``offsets``) that overlap the characters [start, end)."""
    return [k for k, (a, b) in enumerate(offsets) if b > start and a < end]


def load_tokenizer(path: str) -> Tokenizer:
    if os.path.isdir(path):
        path = os.path.join(path, "tokenizer.json")
    return Tokenizer.from_file(path)
