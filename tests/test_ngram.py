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
        prompt = [rnd.randrange(vocab) for _ in range(rnd.randrange(1, 30))]
        for _ in range(4):
            d.begin(list(prompt), None)
            ctx = prompt + [rnd.randrange(vocab)]
            for _ in range(30):
                k = rnd.choice([1, 3, 8])
                assert d.propose(ctx, k).tokens == scan(ctx, n_min, n_max, k)
                ctx += [rnd.randrange(vocab) for _ in range(rnd.choice([1, 1, 2, 4]))]
            # the next request: this one's tokens and more (the next turn), the same prompt again, one that
            # departs from it somewhere, or another text
            cut = rnd.randrange(len(prompt) + 1)
            prompt = rnd.choice([ctx + [1, 2], list(prompt), prompt[:cut] + [vocab] + prompt[cut:],
                                 [rnd.randrange(vocab) for _ in range(20)]])


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


def test_suffix_drafter_keeps_what_the_next_request_shares():
    """The next turn of a conversation extends the drafter's index, the same prompt again drops only the last
    output; the drafts equal those of a fresh drafter; another text gets a new index."""
    rnd = random.Random(2)
    text = [rnd.randrange(40) for _ in range(300)]
    d = SuffixDrafter()
    d.begin(text, None)
    index = d.local
    out = text + text[:5]
    d.propose(out, 8)
    for prompt in (out + [7, 8] + text[100:130], text, text[:280] + [9] + text[280:]):
        d.begin(prompt, None)
        assert d.local is index  # kept: extended, or cut back to what the prompts share
        fresh = SuffixDrafter()
        fresh.begin(prompt, None)
        assert d.local.tokens == fresh.local.tokens and d.local.ends == fresh.local.ends
        assert d.propose(prompt + [3], 8).tokens == fresh.propose(prompt + [3], 8).tokens
    d.begin(text[50:], None)  # another text: a new index
    assert d.local is not index


def test_ngram_mod_keeps_its_pool_for_the_next_turn_only():
    """A request that continues the last adds only its new windows and ends with the pool a fresh drafter builds
    from its tokens; another prompt (the same one again included: the last answer is not in it) starts empty."""
    rnd = random.Random(3)
    text = [rnd.randrange(30) for _ in range(600)]
    d = NgramMod(n_match=3)
    d.begin(text, None)
    d.propose(text + [4, 5, 6], 4)
    bulk = []  # prompts added afresh (600 tokens and more: with tensor ops)
    add_many = d._add_many
    d._add_many = lambda tokens, first: (bulk.append(first), add_many(tokens, first))[1]
    for prompt, kept in ((text + [4, 5, 6, 7] + text[:40], True), (text, False), (text[10:], False)):
        bulk.clear()
        d.begin(prompt, None)
        fresh = NgramMod(n_match=3)
        fresh.begin(prompt, None)
        assert torch.equal(d.pool, fresh.pool) and d.added == prompt
        assert bulk == ([] if kept else [d.n])  # kept: only the 44 new windows, one by one
