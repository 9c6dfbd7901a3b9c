"""Token streams and the training-batch sampler (real code / prose windows + retrieval documents)."""

from __future__ import annotations

import os
import random

import numpy as np

from .corpus import Corpus, make_retrieval_example
from .tokenizer import EOT


def encode_docs(tokenizer, texts: list[str], eot_id: int) -> np.ndarray:
    """Concatenate the documents, each followed by <|endoftext|>."""
    out = []
    batch = 64
    for i in range(0, len(texts), batch):
        for enc in tokenizer.encode_batch(texts[i:i + batch]):
            out.append(np.asarray(enc.ids, dtype=np.int32))
            out.append(np.asarray([eot_id], dtype=np.int32))
    return np.concatenate(out) if out else np.zeros(0, dtype=np.int32)


def build_streams(tokenizer, corpus: Corpus, cache_path: str | None = None) -> dict:
    if cache_path and os.path.exists(cache_path):
        z = np.load(cache_path)
        return {k: z[k] for k in z.files}
    eot = tokenizer.token_to_id(EOT)
    streams = {
        "code": encode_docs(tokenizer, corpus.texts("code"), eot),
        "prose": encode_docs(tokenizer, corpus.texts("prose"), eot),
    }
    if cache_path:
        os.makedirs(os.path.dirname(cache_path), exist_ok=True)
        np.savez(cache_path, **streams)
    return streams


class BatchSampler:
    """Samples training sequences of ``seq_len + 1`` tokens with per-target loss weights.

    * with probability ``p_retrieval`` a synthetic retrieval document (filler from the *training*
      files only) of 1/4..1 of the sequence, the rest filled with a random window of real text;
      the answer tokens get loss weight ``answer_weight``;
    * otherwise a random window of the code stream (prob. ``p_code``) or the prose stream.
    """

    def __init__(self, tokenizer, corpus: Corpus, streams: dict, seed: int = 0, p_retrieval: float = 0.1,
                 p_code: float = 0.55, answer_weight: float = 3.0):
        self.tok = tokenizer
        self.streams = streams
        self.filler = corpus.texts("code") + corpus.texts("prose")
        self.rng = random.Random(seed)
        self.p_retrieval = p_retrieval
        self.p_code = p_code
        self.answer_weight = answer_weight
        self.eot = tokenizer.token_to_id(EOT)
        self.retrieval_docs = 0

    def state(self):
        return {"rng": self.rng.getstate(), "retrieval_docs": self.retrieval_docs}

    def load_state(self, st):
        self.rng.setstate(st["rng"])
        self.retrieval_docs = st.get("retrieval_docs", 0)

    def _window(self, n: int) -> np.ndarray:
        s = self.streams["code"] if self.rng.random() < self.p_code else self.streams["prose"]
        start = self.rng.randrange(0, len(s) - n - 1)
        return s[start:start + n]

    def sample(self, seq_len: int):
        n = seq_len + 1
        w = np.ones(n, dtype=np.float32)
        if self.rng.random() >= self.p_retrieval:
            return self._window(n), w
        length = self.rng.randint(min(max(64, seq_len // 4), seq_len - 1), seq_len - 1)
        ex = make_retrieval_example(self.tok, self.filler, self.rng, length)
        p_ids = self.tok.encode(ex["prompt"]).ids
        a_ids = self.tok.encode(ex["answer"]).ids
        doc = np.asarray(p_ids + a_ids + [self.eot], dtype=np.int32)[:n]
        dw = np.ones(len(doc), dtype=np.float32)
        dw[len(p_ids):len(p_ids) + len(a_ids)] = self.answer_weight
        rest = n - len(doc)
        self.retrieval_docs += 1
        if rest <= 0:
            return doc, dw
        filler = self._window(rest)
        if self.rng.random() < 0.5:
            return np.concatenate([doc, filler]), np.concatenate([dw, np.ones(rest, np.float32)])
        # keep a token boundary: end the filler window with an <|endoftext|>
        filler = filler.copy()
        filler[-1] = self.eot
        return np.concatenate([filler, doc]), np.concatenate([np.ones(rest, np.float32), dw])

    def batch(self, batch_size: int, seq_len: int):
        xs, ws = zip(*(self.sample(seq_len) for _ in range(batch_size)))
        return np.stack(xs), np.stack(ws)
