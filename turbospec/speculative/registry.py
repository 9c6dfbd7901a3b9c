"""Drafters by `--spec-type` name: one builder each, registered here, and the chain that combines them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from turbospec.config import SpecConfig
from turbospec.errors import TurboSpecError
from turbospec.model.base import Model
from turbospec.speculative.chain import ChainDrafter
from turbospec.speculative.drafter import Drafter
from turbospec.speculative.suffix import SuffixStore

# Draft-head rows when the model ships a frequency ranking: on the bundled model 512-2048 rows keep the full
# vocabulary's acceptance (the request's own tokens are added) at a quarter of the head's cost (docs/speculative.md).
AUTO_DRAFT_VOCAB = 1024


@dataclass(frozen=True)
class DraftContext:
    """What a drafter builder may read: the config, the target model, its checkpoint directory (Medusa heads and
    draft_vocab.json live beside it), the longest sequence the drafter will see, and the suffix drafter's store of
    earlier requests (one per server, shared by its drafters)."""

    cfg: SpecConfig
    target: Model
    model_path: str | None
    max_len: int
    store: SuffixStore | None = None


DRAFTERS: dict[str, Callable[[DraftContext], Drafter]] = {}


def register(*names: str):
    def add(builder: Callable[[DraftContext], Drafter]) -> Callable[[DraftContext], Drafter]:
        for n in names:
            DRAFTERS[n] = builder
        return builder

    return add


@register("ngram", "ngram-simple")
def _prompt_lookup(c: DraftContext) -> Drafter:
    from turbospec.speculative.ngram import PromptLookup

    return PromptLookup(c.cfg.ngram_n_min, c.cfg.ngram_n_max)


@register("ngram-mod")
def _ngram_mod(c: DraftContext) -> Drafter:
    from turbospec.speculative.ngram import NgramMod

    return NgramMod(c.cfg.ngram_mod_n_match, 1, c.cfg.ngram_mod_n_max, shared=c.cfg.ngram_mod_shared)


@register("suffix")
def _suffix(c: DraftContext) -> Drafter:
    from turbospec.speculative.suffix import SuffixDrafter

    cfg = c.cfg
    return SuffixDrafter(cfg.suffix_n_max, cfg.suffix_factor, cfg.suffix_p_min, cfg.ngram_n_min, store=c.store)


@register("draft-mtp")
def _mtp(c: DraftContext) -> Drafter:
    from turbospec.model.draft_vocab import load as load_ranked_vocab
    from turbospec.speculative.mtp import MTPDrafter

    if c.target.mtp is None:
        raise TurboSpecError("--spec-type draft-mtp: this model has no mtp.* weights")
    cfg = c.cfg
    ranked = None
    if cfg.draft_vocab:  # a GGUF file's ranking came with the model; a directory's is draft_vocab.json beside it
        ranked = c.target.mtp.ranked_vocab
        if ranked is None and c.model_path:
            ranked = load_ranked_vocab(c.model_path)
        ranked = ranked or None
    vocab = cfg.draft_vocab if cfg.draft_vocab >= 0 else (AUTO_DRAFT_VOCAB if ranked else 0)
    return MTPDrafter(c.target.mtp, c.max_len, cfg.p_min, cfg.mtp_prompt_window, cfg.draft_k_type, cfg.draft_v_type,
                      draft_vocab=vocab, topk=cfg.mtp_topk, ranked_vocab=ranked,
                      sample=cfg.draft_sample)


@register("medusa")
def _medusa(c: DraftContext) -> Drafter:
    from turbospec.speculative.medusa import make_medusa_drafter

    path = c.cfg.medusa or c.model_path
    if not path:
        raise TurboSpecError("--spec-type medusa needs --spec-medusa PATH (or heads beside the model)")
    return make_medusa_drafter(c.target, path, c.cfg.tree)


@register("draft-model")
def _draft_model(c: DraftContext) -> Drafter:
    from turbospec.model.registry import load_model
    from turbospec.speculative.draft_model import DraftModelDrafter

    assert c.cfg.draft_model  # SpecConfig requires it with draft-model
    dm = load_model(c.cfg.draft_model, c.target.dtype)
    if dm.cfg.vocab_size != c.target.cfg.vocab_size:
        raise TurboSpecError(f"draft model vocab {dm.cfg.vocab_size} != target vocab {c.target.cfg.vocab_size}")
    return DraftModelDrafter(dm, c.max_len, c.cfg.p_min, c.cfg.draft_k_type, c.cfg.draft_v_type)


def make_drafter(cfg: SpecConfig, target: Model, max_len: int, model_path: str | None = None,
                 store: SuffixStore | None = None) -> Drafter | None:
    """The drafter (or chain of drafters) for a target model; None when speculation is off.

    model_path: the target's checkpoint directory, where Medusa heads and the draft-vocabulary ranking
    (draft_vocab.json) are looked for. store: earlier requests' tokens for the suffix drafter (default: a new store
    when `cfg.suffix_shared`, else none); a server passes one store to all its drafters."""
    if not cfg.types:
        return None
    ctx = DraftContext(cfg, target, model_path, max_len, store if store is not None else new_store(cfg))
    # llama.cpp's priority: n-gram drafters first (cheap, only fire on repeats), model-based drafters last
    order = sorted(cfg.types, key=lambda t: 0 if t.startswith("ngram") or t == "suffix" else 1)
    drafters = [DRAFTERS[t](ctx) for t in order]
    return drafters[0] if len(drafters) == 1 else ChainDrafter(drafters, [cfg.cap(t) for t in order], cfg.merge)


def new_store(cfg: SpecConfig) -> SuffixStore | None:
    """The suffix drafter's store of earlier requests when `cfg` shares one (--spec-suffix-shared), else None."""
    if not (cfg.suffix_shared and "suffix" in cfg.types):
        return None
    return SuffixStore(cfg.suffix_store_tokens, cfg.ngram_n_min)
