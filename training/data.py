"""Token streams and the training-batch sampler (real code / prose windows + retrieval documents)."""

from __future__ import annotations

import os
import random

import numpy as np

from .corpus import Corpus, distinct_needles, filler_lines_from, make_retrieval_example, multi_fact_parts
from .tokenizer import EOT, token_span


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


def symbol_ids(tok, streams: dict, pool: str, n: int) -> list[int]:
    """The ``n`` most frequent all-digit tokens of the token streams (what values are spelt with), or with
    ``pool == "frequent"`` the most frequent tokens of any kind (special tokens excluded)."""
    vocab = tok.get_vocab()
    ok = np.zeros(max(vocab.values()) + 1, dtype=bool)
    for t, i in vocab.items():
        if pool == "frequent":
            ok[i] = not (t.startswith("<|") and t.endswith("|>"))
        else:
            ok[i] = t.lstrip("\u0120").isdigit()
    counts = np.bincount(np.concatenate(list(streams.values())), minlength=len(ok))[:len(ok)]
    ranked = [int(i) for i in np.argsort(-counts) if ok[i] and counts[i] > 0]
    return ranked[:n] or list(range(n))


class BatchSampler:
    """Samples training sequences of ``seq_len + 1`` tokens with per-target loss weights.

    * with probability ``p_symbols`` random digit tokens, repeated (the pure copying task);
    * with probability ``p_repeat`` a window of real text repeated until the sequence is full;
    * with probability ``p_retrieval`` a synthetic retrieval document (filler from the *training*
      files only) of 1/4..1 of the sequence, the rest filled with a random window of real text;
      the answer tokens get loss weight ``answer_weight``;
    * otherwise a random window of the code stream (prob. ``p_code``) or the prose stream.
    """

    def __init__(self, tokenizer, corpus: Corpus, streams: dict, seed: int = 0, p_retrieval: float = 0.1,
                 p_code: float = 0.55, answer_weight: float = 3.0, max_facts: int = 1):
        self.tok = tokenizer
        self.streams = streams
        self.filler = corpus.texts("code") + corpus.texts("prose")
        self.rng = random.Random(seed)
        self.p_retrieval = p_retrieval
        self.p_code = p_code
        self.answer_weight = answer_weight
        self.max_facts = max_facts
        self.key_weight = 1.0  # loss weight of the answer tokens that restate the key (multi-fact documents)
        self.family_weights: tuple[float, ...] | None = None  # fact families (corpus.FAMILIES order); None: uniform
        self.p_repeat = 0.0
        self.p_symbols = 0.0
        self.n_symbols = 64
        self.symbol_pool = "digits"  # or "frequent": the n_symbols most frequent tokens of any kind
        self.symbol_episodes: tuple[int, int] | None = None  # (min, max) half-length of short copy episodes
        self._syms: list[int] | None = None  # built on first use (_symbol_ids)
        self.questions = 0
        self.eot = tokenizer.token_to_id(EOT)
        self.retrieval_docs = 0

    def state(self):
        return {"rng": self.rng.getstate(), "retrieval_docs": self.retrieval_docs, "questions": self.questions}

    def load_state(self, st):
        self.rng.setstate(st["rng"])
        self.retrieval_docs = st.get("retrieval_docs", 0)
        self.questions = st.get("questions", 0)

    def _window(self, n: int) -> np.ndarray:
        s = self.streams["code"] if self.rng.random() < self.p_code else self.streams["prose"]
        start = self.rng.randrange(0, len(s) - n - 1)
        return s[start:start + n]

    def sample(self, seq_len: int):
        n = seq_len + 1
        w = np.ones(n, dtype=np.float32)
        r = self.rng.random()
        if r < self.p_symbols:
            # random symbols, repeated: the pure copying task that forms induction heads within a few hundred
            # steps in a dense model (training/scripts/copy_formation.py)
            syms = self._symbol_ids()
            if self.symbol_episodes is None:
                half = [syms[self.rng.randrange(len(syms))] for _ in range(max(8, (n + 1) // 2))]
                return np.asarray((half * 2)[:n], dtype=np.int32), w
            return self._symbol_episodes(syms, n), w
        r -= self.p_symbols
        if r < self.p_repeat:
            # a window of real text repeated until the sequence is full: every copy after the first is
            # predictable only by copying (window lengths from 16 tokens to half the sequence)
            win = self._window(self.rng.randint(16, max(16, (n + 1) // 2)))
            return np.tile(win, -(-n // len(win)))[:n], w
        if r >= self.p_repeat + self.p_retrieval:
            return self._window(n), w
        length = self.rng.randint(min(max(64, seq_len // 4), seq_len - 1), seq_len - 1)
        if self.max_facts > 1:
            doc, dw = self._multi_doc(length)
            doc, dw = doc[:n], dw[:n]
        else:
            ex = make_retrieval_example(self.tok, self.filler, self.rng, length)
            p_ids = self.tok.encode(ex["prompt"]).ids
            a_ids = self.tok.encode(ex["answer"]).ids
            doc = np.asarray(p_ids + a_ids + [self.eot], dtype=np.int32)[:n]
            dw = np.ones(len(doc), dtype=np.float32)
            dw[len(p_ids):len(p_ids) + len(a_ids)] = self.answer_weight
            self.questions += 1
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

    def set_symbols(self, n: int) -> None:
        """Change the size of the copy task's symbol pool (a curriculum can widen it as training goes)."""
        if n != self.n_symbols:
            self.n_symbols, self._syms = n, None

    def _symbol_episodes(self, syms: list[int], n: int) -> np.ndarray:
        """Short copy episodes back to back: random symbols of a random half-length, then the same again."""
        lo, hi = self.symbol_episodes
        out: list[int] = []
        while len(out) < n:
            half = [syms[self.rng.randrange(len(syms))] for _ in range(self.rng.randint(lo, hi))]
            out += half + half
        return np.asarray(out[:n], dtype=np.int32)

    def _symbol_ids(self) -> list[int]:
        if self._syms is None:
            self._syms = symbol_ids(self.tok, self.streams, self.symbol_pool, self.n_symbols)
        return self._syms

    def _qa_ids(self, nd: dict) -> tuple[list[int], list[int], int, list[int]]:
        """Question ids, answer ids, the index of the first answer token that spells the value, and the indices
        of the answer tokens that restate the fact's key (account number, project; empty for other families)."""
        q_ids = self.tok.encode(f"\nQuestion: {nd['question']}\nAnswer:").ids
        answer = " " + nd["answer"]
        enc = self.tok.encode(answer)
        start = answer.index(nd["value"])
        first = token_span(enc.offsets, start, start + len(nd["value"]))[0]
        key = []
        if nd.get("key") is not None:
            ks = answer.index(str(nd["key"]))
            key = token_span(enc.offsets[:first], ks, ks + len(str(nd["key"])))
        return q_ids, enc.ids, first, key

    def _multi_doc(self, length: int, chars_per_token: float = 3.2):
        """A document of about ``length`` tokens: 1..max_facts facts in real filler, then one question per
        fact.  Only the tokens from the value on get ``answer_weight`` (the sentence before it is copied
        from the question); the tokens that restate the key from the question get ``key_weight``."""
        k = self.rng.randint(1, max(1, min(self.max_facts, length // 64)))
        needles = distinct_needles(self.rng, k, self.family_weights)
        qas = [self._qa_ids(nd) for nd in needles]
        qa_len = sum(len(q) + len(a) for q, a, _, _ in qas) + 1
        body_budget = max(16, length - qa_len)
        filler = filler_lines_from(self.filler, self.rng, int(body_budget * chars_per_token))
        head, lines = multi_fact_parts(self.rng, filler, needles)
        keep = {nd["needle"] for nd in needles}
        body = self.tok.encode(head + "\n".join(lines)).ids
        while len(body) > body_budget and len(lines) > len(keep):
            over = len(body) - body_budget
            for _ in range(max(1, int(over * chars_per_token / 60))):
                drop = [i for i, ln in enumerate(lines) if ln not in keep]
                if not drop:
                    break
                lines.pop(drop[0] if self.rng.random() < 0.5 else drop[-1])
            body = self.tok.encode(head + "\n".join(lines)).ids
        self.rng.shuffle(qas)
        ids, w = list(body), [1.0] * len(body)
        for q, a, first, key in qas:
            ids += q + a
            aw = [self.key_weight if k in key else 1.0 for k in range(first)] + [self.answer_weight] * (len(a) - first)
            w += [1.0] * len(q) + aw
        ids.append(self.eot)
        w.append(1.0)
        self.questions += len(qas)
        return np.asarray(ids, dtype=np.int32), np.asarray(w, dtype=np.float32)

    def batch(self, batch_size: int, seq_len: int):
        xs, ws = zip(*(self.sample(seq_len) for _ in range(batch_size)))
        return np.stack(xs), np.stack(ws)
