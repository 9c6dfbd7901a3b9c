"""Drafters by `--spec-type` name: one builder each, registered here, and the chain that combines them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from turbospec.config import SpecConfig
from turbospec.errors import TurboSpecError
from turbospec.model.base import Model
from turbospec.speculative.chain import ChainDrafter
from turbospec.speculative.drafter import Drafter

# Draft-head rows when the model ships a frequency ranking: on the bundled model 512-2048 rows keep the full
# vocabulary's acceptance (the request's own tokens are added) at a quarter of the head's cost (docs/speculative.md).
AUTO_DRAFT_VOCAB = 1024


@dataclass(frozen=True)
class DraftContext:
    """What a drafter builder may read: the config, the target model, its checkpoint directory (Medusa heads and
    draft_vocab.json live beside it) and the longest sequence the drafter will see."""

    cfg: SpecConfig
    target: Model
    model_path: str | None
    max_len: int


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


@register("draft-mtp")
def _mtp(c: DraftContext) -> Drafter:
    from turbospec.speculative.draft_vocab import load as load_ranked_vocab
    from turbospec.speculative.mtp import MTPDrafter

    if c.target.mtp is None:
        raise TurboSpecError("--spec-type draft-mtp: this model has no mtp.* weights")
    cfg = c.cfg
    ranked = load_ranked_vocab(c.model_path) if cfg.draft_vocab and c.model_path else None
    vocab = cfg.draft_vocab if cfg.draft_vocab >= 0 else (AUTO_DRAFT_VOCAB if ranked else 0)
    return MTPDrafter(c.target.mtp, c.max_len, cfg.p_min, cfg.mtp_prompt_window, cfg.draft_k_type, cfg.draft_v_type,
                      draft_vocab=vocab, topk=cfg.mtp_topk, ranked_vocab=ranked)


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


def make_drafter(cfg: SpecConfig, target: Model, max_len: int, model_path: str | None = None) -> Drafter | None:
    """The drafter (or chain of drafters) for a target model; None when speculation is off.

    model_path: the target's checkpoint directory, where Medusa heads and the draft-vocabulary ranking
    (draft_vocab.json) are looked for."""
    if not cfg.types:
        return None
    ctx = DraftContext(cfg, target, model_path, max_len)
    # llama.cpp's priority: n-gram drafters first (cheap, only fire on repeats), model-based drafters last
    order = sorted(cfg.types, key=lambda t: 0 if t.startswith("ngram") else 1)
    drafters = [DRAFTERS[t](ctx) for t in order]
    return drafters[0] if len(drafters) == 1 else ChainDrafter(drafters)
