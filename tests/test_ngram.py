"""The n-gram drafters keep tables that grow with the context: the same drafts as scanning the context every step,
at a cost that does not grow with its length."""

import random

import torch

from turbospec.speculative.ngram import VECTOR_MIN, NgramMod, PromptLookup
from turbospec.speculative.suffix import SuffixDrafter


def scan(tokens: list[int], n_min: int, n_max: int, k: int) -> list[int]:
    """Prompt lookup by scanning back through the context (the reference): the most recent earlier occurrence of
    the longest suffix of n_max..n_min tokens, and the tokens after it."""
    L = len(tokens)
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        for s in range(L - n - 1, -1, -1):
            if tokens[s:s + n] == tokens[L - n:]:
                return tokens[s + n:s + n + k]
    return []


def test_prompt_lookup_drafts_what_a_scan_finds_across_steps_and_requests():
    rnd = random.Random(0)
    for _ in range(40):
        n_min, n_max, vocab = rnd.choice([1, 2]), rnd.choice([2, 3, 5]), rnd.choice([3, 6, 20])
        d = PromptLookup(n_min, n_max)
        ctx = [rnd.randrange(vocab) for _ in range(rnd.randrange(1, 30))]
        for _ in range(3):  # requests: the next one continues this one's tokens, or is another text
            d.begin(list(ctx), None)
            ctx.append(rnd.randrange(vocab))
            for _ in range(30):
                k = rnd.choice([1, 3, 8])
                assert d.propose(ctx, k).tokens == scan(ctx, n_min, n_max, k)
                ctx += [rnd.randrange(vocab) for _ in range(rnd.choice([1, 1, 2, 4]))]
            ctx = ctx + [1, 2] if rnd.random() < 0.5 else [rnd.randrange(vocab) for _ in range(20)]


def test_ngram_mod_adds_a_long_prompt_as_token_by_token():
    rnd = random.Random(1)
    for bits, vocab in ((8, 5), (12, 50), (20, 150000)):
        tokens = [rnd.randrange(vocab) for _ in range(3 * VECTOR_MIN)]
        fast, slow = NgramMod(pool_bits=bits), NgramMod(pool_bits=bits)
        fast.begin(tokens[:10], None)
        fast.propose(tokens, 4)  # the rest at once, with tensor ops
        for end in range(slow.n, len(tokens)):
            slow.pool[slow._hash(tokens[end - slow.n:end])] = tokens[end]
        assert torch.equal(fast.pool, slow.pool) and int((fast.pool >= 0).sum()) > 0


def test_suffix_drafter_keeps_its_index_for_the_next_turn():
    rnd = random.Random(2)
    text = [rnd.randrange(40) for _ in range(300)]
    d = SuffixDrafter()
    d.begin(text, None)
    index = d.local
    d.propose(text + text[:5], 8)
    turn2 = text + text[:5] + [7, 8] + text[100:130]
    d.begin(turn2, None)
    assert d.local is index  # extended, not rebuilt
    fresh = SuffixDrafter()
    fresh.begin(turn2, None)
    assert d.propose(turn2 + [3], 8).tokens == fresh.propose(turn2 + [3], 8).tokens
    d.begin(text[50:], None)  # another text: a new index
    assert d.local is not index
