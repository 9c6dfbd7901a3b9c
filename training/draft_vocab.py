"""Write `draft_vocab.json` beside a model: its token ids ranked by count over the training split.

    python -m training.draft_vocab --model models/turbospec-tiny   # counts the bundled model's training split
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

from turbospec.model.draft_vocab import FILE


def rank_tokens(tokenizer, texts: list[str], vocab_size: int, batch: int = 256, progress: bool = False
                ) -> tuple[list[int], int]:
    """Token ids by descending count over `texts` (ties: lower id first; unseen ids last), and the tokens
    counted. `tokenizer` is a `tokenizers.Tokenizer`."""
    from tqdm import tqdm

    counts: Counter[int] = Counter()
    for i in tqdm(range(0, len(texts), batch), desc="counting tokens", unit="batch", disable=not progress):
        for enc in tokenizer.encode_batch(texts[i:i + batch]):
            counts.update(enc.ids)
    ranked = sorted(range(vocab_size), key=lambda t: (-counts.get(t, 0), t))
    return ranked, sum(counts.values())


def main() -> None:
    from tokenizers import Tokenizer

    from training.corpus import load_corpus
    from turbospec.model.config import ModelConfig
    from turbospec.model.loader import load_config

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="model directory (tokenizer.json, config.json)")
    ap.add_argument("--docs-dir", default=None, help="Python documentation sources (default: Debian's)")
    a = ap.parse_args()
    cfg: ModelConfig = load_config(a.model)
    tok = Tokenizer.from_file(str(Path(a.model) / "tokenizer.json"))
    corpus = load_corpus(docs_dir=a.docs_dir, require_docs=False)
    texts = corpus.texts(split="train")
    ranked, counted = rank_tokens(tok, texts, cfg.vocab_size, progress=True)
    meta = {"source": "training split of training.corpus (held-out files excluded)",
            "files": len(texts), "tokens_counted": counted, "ranked_ids": ranked}
    (Path(a.model) / FILE).write_text(json.dumps(meta))
    print(f"wrote {Path(a.model) / FILE}: {meta['tokens_counted']} tokens from {len(texts)} files")


if __name__ == "__main__":
    main()
