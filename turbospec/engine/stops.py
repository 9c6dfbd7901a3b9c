"""Stop strings in streamed text: where one ends the output, and how much text must be held back."""

from __future__ import annotations


def find_stop(text: str, stops: list[str]) -> int | None:
    hits = [i for s in stops if (i := text.find(s)) >= 0]
    return min(hits) if hits else None


def safe_prefix_len(text: str, stops: list[str]) -> int:
    """Length of the prefix of `text` that cannot be the beginning of any stop string."""
    keep = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:k]):
                keep = max(keep, k)
                break
    return len(text) - keep
