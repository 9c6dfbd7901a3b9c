"""Frequency-ranked draft vocabulary (as FR-Spec): the token ids the model's *training* text uses most.

A reduced draft head (`--spec-draft-vocab N`) scores only N rows of the lm_head. Byte-level BPE numbers tokens
in merge order, so "the first N ids" is only a rough frequency order; counting the training split's tokens gives
the real order. The ranking is stored beside the model as `draft_vocab.json` (written by
`python -m training.draft_vocab`); verification stays exact whatever the drafter proposes.
"""

from __future__ import annotations

import json
from pathlib import Path

FILE = "draft_vocab.json"


def load(model_dir: str | Path | None) -> list[int] | None:
    """The ranked ids stored beside a model, or None."""
    if not model_dir:
        return None
    path = Path(model_dir) / FILE
    if not path.exists():
        return None
    return [int(t) for t in json.loads(path.read_text())["ranked_ids"]]
