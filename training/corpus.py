"""Training corpus for the bundled model: real text that is available offline.

* code  -- the Python standard library sources of the running interpreter (``*.py``,
  test suites and site-packages skipped);
* prose -- the reStructuredText ``_sources`` of the Python documentation, shipped by
  Debian's ``python3.11-doc`` package (``apt-get install python3.11-doc``);
* retrieval -- synthetic long-range retrieval documents (a key or number stated once,
  real filler text, then a question whose answer is that value), generated on the fly.

The held-out split is deterministic: a file is held out iff the SHA-1 of
``"<kind>:<relative path>"`` falls in the lowest ``HELDOUT_PERCENT`` percent.
Held-out files are never used for training (nor for the tokenizer).
"""

from __future__ import annotations

import glob
import hashlib
import os
import random
import sysconfig
from dataclasses import dataclass, field

HELDOUT_PERCENT = 6  # >= 5 % of the files of each kind

# Directory names skipped in the stdlib walk (test suites are huge and repetitive).
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__", "turtledemo"}
_MAX_FILE_BYTES = 400_000

DOCS_HINT = (
    "The prose part of the corpus needs the Python documentation sources from Debian's "
    "python3.11-doc package. Install it with:\n"
    "    apt-get update && apt-get install -y python3.11-doc\n"
    "or pass --docs-dir pointing at a directory of *.rst.txt / *.txt files "
    "(the html/_sources directory of the Python docs)."
)

DOCS_CANDIDATES = (
    "/usr/share/doc/python3.11/html/_sources",
    "/usr/share/doc/python3.11-doc/html/_sources",
    "/usr/share/doc/python3/html/_sources",
)


class CorpusError(RuntimeError):
    pass


def is_heldout(kind: str, relpath: str, percent: int = HELDOUT_PERCENT) -> bool:
    """Deterministic held-out membership from a hash of the (kind, path) pair."""
    digest = hashlib.sha1(f"{kind}:{relpath.replace(os.sep, '/')}".encode()).digest()
    return int.from_bytes(digest[:8], "big") % 100 < percent


@dataclass
class Doc:
    kind: str  # "code" | "prose"
    path: str  # relative path inside its root
    text: str


@dataclass
class Corpus:
    train: list[Doc] = field(default_factory=list)
    heldout: list[Doc] = field(default_factory=list)

    def texts(self, kind: str | None = None, split: str = "train") -> list[str]:
        docs = self.train if split == "train" else self.heldout
        return [d.text for d in docs if kind is None or d.kind == kind]

    def summary(self) -> dict:
        out = {}
        for split, docs in (("train", self.train), ("heldout", self.heldout)):
            for kind in ("code", "prose"):
                sel = [d for d in docs if d.kind == kind]
                out[f"{split}_{kind}_files"] = len(sel)
                out[f"{split}_{kind}_chars"] = sum(len(d.text) for d in sel)
        return out


def stdlib_dir() -> str:
    return sysconfig.get_paths()["stdlib"]


def find_docs_dir(explicit: str | None = None) -> str:
    cands = [explicit] if explicit else list(DOCS_CANDIDATES)
    for c in cands:
        if c and os.path.isdir(c) and glob.glob(os.path.join(c, "**", "*.txt"), recursive=True):
            return c
    raise CorpusError(
        f"Python documentation sources not found (looked in {', '.join(str(c) for c in cands)}).\n" + DOCS_HINT
    )


def _read(path: str) -> str | None:
    try:
        if os.path.getsize(path) > _MAX_FILE_BYTES:
            return None
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (UnicodeDecodeError, OSError):
        return None
    text = text.replace("\r\n", "\n")
    return text if text.strip() else None


def iter_code_files(root: str):
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("."))
        for fn in sorted(filenames):
            if fn.endswith(".py") and not fn.startswith("test_"):
                yield os.path.join(dirpath, fn)


def iter_prose_files(root: str):
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(dirnames)
        for fn in sorted(filenames):
            if fn.endswith(".txt"):
                yield os.path.join(dirpath, fn)


def load_corpus(
    code_dir: str | None = None,
    docs_dir: str | None = None,
    percent: int = HELDOUT_PERCENT,
    require_docs: bool = True,
) -> Corpus:
    """Load code and prose files and split them deterministically."""
    code_root = code_dir or stdlib_dir()
    corpus = Corpus()
    for path in iter_code_files(code_root):
        text = _read(path)
        if text is None:
            continue
        rel = os.path.relpath(path, code_root)
        doc = Doc("code", rel, text)
        (corpus.heldout if is_heldout("code", rel, percent) else corpus.train).append(doc)
    try:
        docs_root = find_docs_dir(docs_dir)
    except CorpusError:
        if require_docs:
            raise
        docs_root = None
    if docs_root:
        for path in iter_prose_files(docs_root):
            text = _read(path)
            if text is None:
                continue
            rel = os.path.relpath(path, docs_root)
            doc = Doc("prose", rel, text)
            (corpus.heldout if is_heldout("prose", rel, percent) else corpus.train).append(doc)
    if not corpus.train:
        raise CorpusError(f"no training files found under {code_root!r}")
    return corpus


# ---------------------------------------------------------------------------
# Synthetic long-range retrieval documents
# ---------------------------------------------------------------------------

_NAMES = [
    "Alice", "Bob", "Carol", "Dmitri", "Elena", "Farid", "Greta", "Hiro", "Ines", "Jamal", "Kofi", "Lena",
    "Marta", "Nils", "Olga", "Pavel", "Quinn", "Rosa", "Sven", "Tariq", "Uma", "Viktor", "Wen", "Yusuf",
]
_PROJECTS = ["Apollo", "Borealis", "Cobalt", "Delta", "Ember", "Falcon", "Granite", "Helix", "Iris", "Juniper"]


def _money(rng: random.Random) -> str:
    return f"{rng.randint(100_000, 99_999_999):,}"


FAMILIES = ("passkey", "secret", "account", "budget", "code")


def _needle(rng: random.Random, weights: tuple[float, ...] | None = None) -> dict:
    """Pick a fact family (uniformly, or by ``weights`` in ``FAMILIES`` order). Returns needle line, question,
    answer line and the bare value."""
    fam = rng.randrange(5) if weights is None else rng.choices(range(5), weights=weights)[0]
    if fam == 0:
        v = str(rng.randint(10_000, 99_999))
        return {"family": "passkey", "needle": f"The passkey is {v}. Remember it. {v} is the passkey.",
                    "question": "What is the passkey?", "answer": f"The passkey is {v}.", "value": v}
    if fam == 1:
        name = rng.choice(_NAMES)
        v = str(rng.randint(1000, 999_999))
        return {"family": "secret", "needle": f"The secret number of {name} is {v}.",
                    "question": f"What is the secret number of {name}?",
                    "answer": f"The secret number of {name} is {v}.", "value": v}
    if fam == 2:
        k = rng.randint(1, 99)
        v = _money(rng)
        return {"family": "account", "needle": f"Account {k} balance: {v}",
                    "question": f"What is the balance of account {k}?",
                    "answer": f"Account {k} balance: {v}", "value": v, "key": k}
    if fam == 3:
        p = rng.choice(_PROJECTS)
        v = _money(rng)
        return {"family": "budget", "needle": f"The approved budget for project {p} is ${v}.",
                    "question": f"What is the approved budget for project {p}?",
                    "answer": f"The approved budget for project {p} is ${v}.", "value": v, "key": p}
    v = str(rng.randint(100_000, 9_999_999))
    return {"family": "code", "needle": f"ACCESS_CODE = {v}",
                "question": "Which value was assigned to ACCESS_CODE?",
                "answer": f"ACCESS_CODE = {v}", "value": v}


def _distractor(rng: random.Random, family: str, avoid: set) -> str:
    """A number-dense line (financial-report style) whose account number / project is not in ``avoid`` (the
    facts' keys), so it never answers a question."""
    if family == "account" or rng.random() < 0.5:
        k = rng.randint(1, 99)
        while k in avoid:
            k = rng.randint(1, 99)
        return f"Account {k} balance: {_money(rng)}"
    if family == "budget" or rng.random() < 0.5:
        p = rng.choice([q for q in _PROJECTS if q not in avoid])
        return f"Quarterly revenue of {p}: ${_money(rng)} ({rng.randint(-30, 60)}% year over year)"
    return f"Line item {rng.randint(100, 999)}: {rng.randint(1, 500)} units at ${rng.randint(1, 9999)}.{rng.randint(0, 99):02d}"


_HEADS = ["Report.\n", "Read the following document carefully.\n", "Document:\n", ""]


def retrieval_parts(rng: random.Random, filler_lines: list[str], dense: bool | None = None):
    """Build (head, filler_lines_with_needle, tail, answer, value, family, needle_line).

    ``filler_lines`` is real text split into lines; the needle is inserted at a random depth,
    number-dense distractor lines are sprinkled in when ``dense``.  The caller controls the
    length by how many filler lines it passes.
    """
    nd = _needle(rng)
    if dense is None:
        dense = nd["family"] in ("account", "budget") or rng.random() < 0.3
    lines = list(filler_lines)
    if dense:
        n_distr = max(3, len(lines) // 12)
        for _ in range(n_distr):
            lines.insert(rng.randrange(len(lines) + 1), _distractor(rng, nd["family"], {nd.get("key")}))
    pos = rng.randrange(len(lines) + 1)
    lines.insert(pos, nd["needle"])
    head = rng.choice(_HEADS)
    tail = f"\nQuestion: {nd['question']}\nAnswer:"
    return head, lines, tail, " " + nd["answer"], nd["value"], nd["family"], nd["needle"]


def filler_lines_from(texts: list[str], rng: random.Random, n_chars: int) -> list[str]:
    """Consecutive real lines taken from random documents until about ``n_chars`` are gathered."""
    out: list[str] = []
    total = 0
    while total < n_chars:
        t = texts[rng.randrange(len(texts))]
        lines = [ln for ln in t.split("\n") if ln.strip()]
        if not lines:
            continue
        start = rng.randrange(len(lines))
        for ln in lines[start:start + rng.randint(10, 80)]:
            ln = ln[:200]
            out.append(ln)
            total += len(ln) + 1
            if total >= n_chars:
                break
    return out


def make_retrieval_example(tokenizer, texts: list[str], rng: random.Random, n_tokens: int,
                           chars_per_token: float = 3.2) -> dict:
    """A retrieval document of about ``n_tokens`` tokens (prompt + answer).

    Returns dict(prompt=str, answer=str, value=str, family=str, n_prompt_tokens=int).
    The filler is trimmed line by line so that the prompt fits ``n_tokens - answer``.
    """
    lines = filler_lines_from(texts, rng, int(n_tokens * chars_per_token * 1.15))
    head, lines, tail, answer, value, fam, needle = retrieval_parts(rng, lines)
    budget = n_tokens - len(tokenizer.encode(answer).ids)

    def build(ls):
        return head + "\n".join(ls) + tail

    prompt = build(lines)
    n = len(tokenizer.encode(prompt).ids)
    # trim filler lines (never the needle) from the far side of the needle until it fits
    needle_idx = lines.index(needle)
    while n > budget and len(lines) > 1:
        over = n - budget
        k = max(1, int(over * chars_per_token / 60))
        for _ in range(k):
            if len(lines) <= 1:
                break
            if needle_idx < len(lines) - 1 and (needle_idx == 0 or rng.random() < 0.5):
                lines.pop()
            else:
                lines.pop(0)
                needle_idx -= 1
        prompt = build(lines)
        n = len(tokenizer.encode(prompt).ids)
    return {"prompt": prompt, "answer": answer, "value": value, "family": fam, "n_prompt_tokens": n}


# ---------------------------------------------------------------------------
# Training documents with several facts and several questions
# ---------------------------------------------------------------------------

def _fact_key(nd: dict) -> tuple:
    return (nd["family"], nd.get("key"), nd["question"])


def distinct_needles(rng: random.Random, n: int, weights: tuple[float, ...] | None = None) -> list[dict]:
    """Up to ``n`` facts whose questions all differ (one passkey, one ACCESS_CODE, distinct names/keys);
    families drawn as in ``_needle``."""
    out, seen = [], set()
    for _ in range(n * 4):
        if len(out) >= n:
            break
        nd = _needle(rng, weights)
        k = _fact_key(nd)
        if k in seen:
            continue
        seen.add(k)
        out.append(nd)
    return out


def multi_fact_parts(rng: random.Random, filler_lines: list[str], needles: list[dict]):
    """(head, lines): several facts (``distinct_needles``) at random depths in real filler, number-dense or not.

    Distractor lines never reuse a fact's account number or project; the caller appends one
    ``Question/Answer`` pair per fact (in random order), so one document trains copying many times.
    """
    lines = list(filler_lines)
    fams = {nd["family"] for nd in needles}
    if fams & {"account", "budget"} or rng.random() < 0.3:
        family = "budget" if "budget" in fams else needles[0]["family"]
        keys = {nd.get("key") for nd in needles}
        for _ in range(max(3, len(lines) // 12)):
            lines.insert(rng.randrange(len(lines) + 1), _distractor(rng, family, keys))
    for nd in needles:
        lines.insert(rng.randrange(len(lines) + 1), nd["needle"])
    head = rng.choice(_HEADS)
    return head, lines
