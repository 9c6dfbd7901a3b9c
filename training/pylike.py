"""Does generated code look like Python?  A measured stand-in for judging greedy continuations by eye.

A continuation of a held-out file is cut mid-statement, so it cannot be parsed whole.  Each complete,
non-blank, non-comment line is parsed on its own by :mod:`ast` -- as is, or in the smallest frame that makes a
fragment of a larger statement a statement (a block opener gets a body, an ``else:`` a preceding ``if``, an
argument line a call around it, an opening line its closing bracket).  The same is measured on the file's
real continuation, which has the same fragments, so the two rates compare like with like.  Repetition: the share
of lines that repeat an earlier line of the same continuation (greedy decoding of a small model loops).
"""

from __future__ import annotations

import ast

_FRAMES = (
    "{s}",
    "{s}\n pass",                              # block opener: def f(x):
    "if 1:\n pass\n{s}\n pass",                 # else: / elif x:
    "try:\n pass\n{s}\n pass",                  # except E: / finally:
    "f({s})",                                   # argument line: a=1, b=2,
    "def f({s}): pass",                         # parameter line: x, *, y=None,
    "[{s}]",                                    # list / dict element line
    "{{{s}}}",
    "{s})", "{s}]", "{s}}}", "{s}))",            # a line that opens a bracket
    "f(x{s}", "[x{s}", "{{x{s}",                 # a line that closes one
    "f(x\n{s}\n)",
)


_PAIRS = {")": "(", "]": "[", "}": "{"}


def _balanced(s: str) -> list[str]:
    """``s`` with the brackets it leaves open closed and the ones it closes opened (a line of a longer
    bracketed expression), the opened part started with nothing, a name or a name and a comma."""
    stack: list[str] = []
    before: list[str] = []
    for ch in s:
        if ch in "([{":
            stack.append(ch)
        elif ch in _PAIRS:
            if stack:
                stack.pop()
            else:
                before.append(_PAIRS[ch])
    closing = "".join({v: k for k, v in _PAIRS.items()}[c] for c in reversed(stack))
    opening = "".join(reversed(before))
    return [f"{opening}{filler}{s}{closing}" for filler in ("", "x", "x, ")] if opening or closing else []


def line_parses(line: str) -> bool:
    """True if ``line`` (one source line) is Python on its own or as a fragment of a larger statement."""
    s = line.strip()
    for src in [frame.format(s=s) for frame in _FRAMES] + _balanced(s):
        try:
            ast.parse(src)
            return True
        except (SyntaxError, ValueError):
            continue
    return False


def code_lines(text: str) -> list[str]:
    """The complete, non-blank, non-comment lines of a continuation (the last, unfinished line is dropped)."""
    lines = text.split("\n")[:-1]
    return [ln for ln in lines if ln.strip() and not ln.strip().startswith("#")]


def python_likeness(texts: list[str]) -> dict:
    """Share of lines that parse and share of lines repeating an earlier line of their own text."""
    n = parsed = repeated = 0
    for text in texts:
        seen: set[str] = set()
        for ln in code_lines(text):
            n += 1
            parsed += line_parses(ln)
            repeated += ln.strip() in seen
            seen.add(ln.strip())
    return {"lines": n, "parse_rate": round(parsed / max(n, 1), 3), "repeat_rate": round(repeated / max(n, 1), 3)}
