"""The incremental detokenizer: the same pieces as decoding everything at every step, without its quadratic cost."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from turbospec.tokenizer import StreamDecoder, Tokenizer

MODEL = Path(__file__).resolve().parents[1] / "models" / "turbospec-tiny"
pytestmark = pytest.mark.skipif(not (MODEL / "tokenizer.json").exists(), reason="no bundled tokenizer")


@pytest.fixture(scope="module")
def tok():
    return Tokenizer(MODEL)


def reference_pieces(tok: Tokenizer, ids: list[int]) -> list[str]:
    """Decode the whole list at every push; emit what is new unless the text ends in an incomplete character."""
    out, emitted = [], 0
    for n in range(1, len(ids) + 1):
        text = tok.decode(ids[:n])
        if text.endswith("\ufffd"):
            out.append("")
            continue
        out.append(text[emitted:])
        emitted = len(text)
    return out


def pieces(tok: Tokenizer, ids: list[int]) -> list[str]:
    dec = StreamDecoder(tok)
    return [dec.push(t) for t in ids]


def test_multibyte_characters_split_across_tokens(tok):
    text = "naïve café — 東京 🙂🚀 ok\n    def f(x): return x  # ✓"
    ids = tok.encode(text, add_special=False)
    assert len(ids) > len(text.split())  # some characters take several byte-level tokens
    got = pieces(tok, ids)
    assert got == reference_pieces(tok, ids)
    assert "".join(got) == tok.decode(ids) == text
    assert not any("\ufffd" in p for p in got)


@settings(max_examples=60, deadline=None, derandomize=True, database=None)
@given(st.lists(st.integers(min_value=0, max_value=8191), min_size=1, max_size=60))
def test_same_pieces_as_decoding_everything(tok, ids):
    assert pieces(tok, ids) == reference_pieces(tok, ids)


def test_work_per_token_does_not_grow_with_the_output(tok):
    """Counts the ids each push hands to the tokenizer: as many at token 30,000 as at token 10 (a decoder that
    re-decodes the whole output would hand it 30,000)."""
    text = "naïve café — 東京 🙂 def f(x): return x  # ✓\n"
    ids = tok.encode(text, add_special=False)
    ids = (ids * (30_000 // len(ids) + 1))[:30_000]
    decoded: list[int] = []
    real = tok.decode

    class Counting:
        def decode(self, some: list[int], skip_special: bool = True) -> str:
            decoded.append(len(some))
            return real(some, skip_special)

    dec = StreamDecoder(Counting())  # type: ignore[arg-type]
    per_push = []
    for t in ids:
        decoded.clear()
        dec.push(t)
        per_push.append(sum(decoded))
    assert max(per_push[-1000:]) <= max(per_push[:1000]) <= 16
