"""Frequency-ranked draft vocabulary (as FR-Spec): the token ids the model's *training* text uses most.

A reduced draft head (`--spec-draft-vocab N`) scores only N rows of the lm_head. Byte-level BPE numbers tokens
in merge order, so "the first N ids" is only a rough frequency order; counting the training split's tokens gives
the real order. The ranking is stored beside the model as `draft_vocab.json` (written by
`python -m training.draft_vocab`), and in a GGUF file that `turbospec export-gguf` wrote from such a model under
`GGUF_KEY` (llama.cpp ignores keys it does not know); verification stays exact whatever the drafter proposes.
"""

from __future__ import annotations

import json
from pathlib import Path

FILE = "draft_vocab.json"
GGUF_KEY = "turbospec.draft_vocab.ranked_ids"


def load(model: str | Path | None) -> list[int] | None:
    """The ranked ids stored beside a model directory or in a GGUF file, or None."""
    if not model:
        return None
    from turbospec.model.gguf import GGUFFile, is_gguf

    if is_gguf(model):
        return from_meta(GGUFFile(model).meta)
    path = Path(model) / FILE
    if not path.exists():
        return None
    return [int(t) for t in json.loads(path.read_text())["ranked_ids"]]


def from_meta(meta: dict) -> list[int] | None:
    """The ranked ids in a GGUF file's metadata (already read), or None."""
    ranked = meta.get(GGUF_KEY)
    return [int(t) for t in ranked] if ranked is not None else None
