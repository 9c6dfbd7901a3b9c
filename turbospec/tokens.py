"""Token sequences: the common prefix of two (what a cache or a drafter's table keeps for the next request)."""

from __future__ import annotations

from collections.abc import Sequence


def common_prefix(a: Sequence[int], b: Sequence[int], upto: int | None = None) -> int:
    """How many leading tokens a and b[:upto] share, compared 4096 at a time first (slices compare in C: a token-by-token
    loop took 34 ms over 262K tokens). The engine's prefix reuse and the drafters whose tables follow the context
    (a new request keeps what it shares with the last) use it."""
    n = min(len(a), len(b) if upto is None else min(upto, len(b)))
    i = 0
    while i + 4096 <= n and a[i:i + 4096] == b[i:i + 4096]:
        i += 4096
    while i < n and a[i] == b[i]:
        i += 1
    return i


def kept(have: list[int], tokens: Sequence[int], upto: int, check: bool = False) -> int:
    """How many leading tokens of `have` (what a cache or a table holds) stay for tokens[:upto]: all of them where
    the tokens only grew since (within a request: checked at `have`'s last token), else their common prefix
    (`check`: always compared, as for a new request)."""
    n = len(have)
    if check or n > upto or (n and tokens[n - 1] != have[-1]):
        return common_prefix(have, tokens, upto)
    return n
