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


class TextStream:
    """Generated tokens to streamed text with stop strings: `push(token)` returns (text that may go out now,
    stopped); when a stop string completes, the text before it and True. Text that may be the start of a stop string
    is held back until it cannot be; `flush()` returns what is held at the end."""

    def __init__(self, tokenizer, stops: list[str]):
        from turbospec.tokenizer import StreamDecoder

        self.dec = StreamDecoder(tokenizer) if tokenizer is not None else None
        self.stops = [s for s in stops if s]
        self.held = ""

    def push(self, token: int) -> tuple[str, bool]:
        text = self.dec.push(token) if self.dec else ""
        if not self.stops:
            return text, False
        self.held += text
        cut = find_stop(self.held, self.stops)
        if cut is not None:
            text, self.held = self.held[:cut], ""
            return text, True
        safe = safe_prefix_len(self.held, self.stops)
        text, self.held = self.held[:safe], self.held[safe:]
        return text, False

    def flush(self) -> str:
        text, self.held = self.held, ""
        return text
