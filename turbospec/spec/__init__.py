"""Speculative decoding: drafters (MTP, n-gram, draft model, chains), draft trees and verification."""

from __future__ import annotations

from dataclasses import dataclass

from turbospec.errors import TurboSpecError

SPEC_TYPES = ("draft-mtp", "ngram", "ngram-simple", "ngram-mod", "draft-model")


@dataclass
class SpecConfig:
    types: tuple[str, ...] = ()
    n_max: int = 3
    p_min: float = 0.0
    draft_model: str | None = None
    ngram_n_min: int = 2
    ngram_n_max: int = 4
    ngram_mod_n_match: int = 8
    ngram_mod_n_max: int = 16
    mtp_prompt_window: int = 0
    draft_kv_dtype: str | None = None

    @classmethod
    def parse(cls, spec_type: str | None, **kw) -> SpecConfig:
        types = tuple(t.strip() for t in (spec_type or "").split(",") if t.strip() and t.strip() != "none")
        for t in types:
            if t not in SPEC_TYPES:
                raise TurboSpecError(f"unknown --spec-type {t!r} (choose from {', '.join(SPEC_TYPES)})")
        cfg = cls(types=types, **kw)
        if cfg.n_max < 1:
            raise TurboSpecError("--spec-draft-n-max must be >= 1")
        return cfg


def make_drafter(cfg: SpecConfig, target, max_len: int):
    """Build the drafter (or chain) for a target model; None when speculation is off."""
    if not cfg.types:
        return None
    from turbospec.spec.chain import ChainDrafter

    kv_dtype = None
    if cfg.draft_kv_dtype:
        from turbospec.loader import parse_dtype

        kv_dtype = parse_dtype(cfg.draft_kv_dtype)
    drafters = []
    # llama.cpp's priority: n-gram drafters first (cheap, only fire on repeats), model-based drafters last
    order = sorted(cfg.types, key=lambda t: 0 if t.startswith("ngram") else 1)
    for t in order:
        if t in ("ngram", "ngram-simple"):
            from turbospec.spec.ngram import PromptLookup

            drafters.append(PromptLookup(cfg.ngram_n_min, cfg.ngram_n_max))
        elif t == "ngram-mod":
            from turbospec.spec.ngram import NgramMod

            d = NgramMod(cfg.ngram_mod_n_match, 1, cfg.ngram_mod_n_max)
            d.n_max_override = cfg.ngram_mod_n_max
            drafters.append(d)
        elif t == "draft-mtp":
            from turbospec.spec.mtp import MTPDrafter

            if getattr(target, "mtp", None) is None:
                raise TurboSpecError("--spec-type draft-mtp: this model has no mtp.* weights")
            drafters.append(MTPDrafter(target.mtp, max_len, cfg.p_min, cfg.mtp_prompt_window, kv_dtype))
        elif t == "draft-model":
            from turbospec.models import load_model
            from turbospec.spec.draft_model import DraftModelDrafter

            if not cfg.draft_model:
                raise TurboSpecError("--spec-type draft-model needs -md/--spec-draft-model PATH")
            dm = load_model(cfg.draft_model, target.dtype)
            if dm.cfg.vocab_size != target.cfg.vocab_size:
                raise TurboSpecError(
                    f"draft model vocab {dm.cfg.vocab_size} != target vocab {target.cfg.vocab_size}")
            drafters.append(DraftModelDrafter(dm, max_len, cfg.p_min, kv_dtype))
    return drafters[0] if len(drafters) == 1 else ChainDrafter(drafters)


__all__ = ["SpecConfig", "make_drafter", "SPEC_TYPES"]
