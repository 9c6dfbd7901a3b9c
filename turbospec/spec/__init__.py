"""Speculative decoding: drafters (MTP, Medusa, n-gram, draft model, chains), draft trees and verification."""

from __future__ import annotations

from dataclasses import dataclass

from turbospec.errors import TurboSpecError

SPEC_TYPES = ("draft-mtp", "medusa", "ngram", "ngram-simple", "ngram-mod", "draft-model")


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
    # the MTP reads only the last N prompt positions: prefill with MTP on stays >= 0.9x of MTP off
    # (benchmarks/spec_prefill.py: 0.86x at a 2K prompt with the whole prompt, 0.93x with 256); 0 = all
    mtp_prompt_window: int = -1  # prompt positions fed to the MTP: -1 auto (a quarter, 64..256), 0 all
    # MTP drafts over N tokens only (plus the request's own): the most frequent (draft_vocab.json) or lowest ids;
    # 0 = full vocabulary, -1 = auto (AUTO_DRAFT_VOCAB when the model ships a ranking, else full)
    draft_vocab: int = -1
    mtp_topk: int = 1  # MTP tree: top-k candidates per depth (the best one continued); 1 = a chain
    draft_kv_dtype: str | None = None  # legacy: a dense dtype for the draft caches
    draft_k_type: str | None = None  # KV format names for the draft/MTP caches (-ctkd / -ctvd)
    draft_v_type: str | None = None
    medusa: str | None = None  # directory (or medusa_heads.safetensors) of Medusa heads; default: the model dir
    tree: str | None = None  # Medusa tree: JSON list of rank paths or "topk:k1,k2,..."; default: DEFAULT_TREE

    @classmethod
    def parse(cls, spec_type: str | None, **kw) -> SpecConfig:
        types = tuple(t.strip() for t in (spec_type or "").split(",") if t.strip() and t.strip() != "none")
        for t in types:
            if t not in SPEC_TYPES:
                raise TurboSpecError(f"unknown --spec-type {t!r} (choose from {', '.join(SPEC_TYPES)})")
        cfg = cls(types=types, **kw)
        if cfg.n_max < 1:
            raise TurboSpecError("--spec-draft-n-max must be >= 1")
        if cfg.tree:
            from turbospec.spec.medusa import parse_tree

            parse_tree(cfg.tree)  # fail early on a malformed tree
        return cfg


# Draft-head rows when the model ships a frequency ranking: on the bundled model 512-2048 rows keep the full
# vocabulary's acceptance (the request's own tokens are added) at a quarter of the head's cost (docs/speculative.md).
AUTO_DRAFT_VOCAB = 1024


def make_drafter(cfg: SpecConfig, target, max_len: int, model_path: str | None = None):
    """Build the drafter (or chain) for a target model; None when speculation is off.

    model_path: the target's checkpoint directory, where Medusa heads and the draft-vocabulary ranking
    (draft_vocab.json) are looked for."""
    if not cfg.types:
        return None
    from turbospec.spec.chain import ChainDrafter

    kv_dtype = None
    if cfg.draft_kv_dtype:
        from turbospec.loader import parse_dtype

        kv_dtype = parse_dtype(cfg.draft_kv_dtype)
    k_type, v_type = _kv_type(cfg.draft_k_type), _kv_type(cfg.draft_v_type)
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
            from turbospec.spec.draft_vocab import load as load_ranked_vocab

            ranked = load_ranked_vocab(model_path) if cfg.draft_vocab else None
            vocab = cfg.draft_vocab if cfg.draft_vocab >= 0 else (AUTO_DRAFT_VOCAB if ranked else 0)
            drafters.append(MTPDrafter(target.mtp, max_len, cfg.p_min, cfg.mtp_prompt_window, kv_dtype,
                                       k_type, v_type, draft_vocab=vocab, topk=cfg.mtp_topk, ranked_vocab=ranked))
        elif t == "medusa":
            from turbospec.spec.medusa import make_medusa_drafter

            path = cfg.medusa or model_path
            if not path:
                raise TurboSpecError("--spec-type medusa needs --spec-medusa PATH (or heads beside the model)")
            drafters.append(make_medusa_drafter(target, path, cfg.tree))
        elif t == "draft-model":
            from turbospec.models import load_model
            from turbospec.spec.draft_model import DraftModelDrafter

            if not cfg.draft_model:
                raise TurboSpecError("--spec-type draft-model needs -md/--spec-draft-model PATH")
            dm = load_model(cfg.draft_model, target.dtype)
            if dm.cfg.vocab_size != target.cfg.vocab_size:
                raise TurboSpecError(
                    f"draft model vocab {dm.cfg.vocab_size} != target vocab {target.cfg.vocab_size}")
            drafters.append(DraftModelDrafter(dm, max_len, cfg.p_min, kv_dtype, k_type, v_type))
    return drafters[0] if len(drafters) == 1 else ChainDrafter(drafters)


_DTYPE_NAMES = {"float32": "f32", "fp32": "f32", "float16": "f16", "fp16": "f16", "half": "f16",
                "bfloat16": "bf16"}


def _kv_type(name: str | None) -> str | None:
    """A KV format name (dtype spellings float16/bfloat16/float32 accepted); TurboSpecError if unknown."""
    if not name:
        return None
    name = _DTYPE_NAMES.get(name.lower(), name)
    from turbospec.kv.formats import get_format

    try:
        return get_format(name).name
    except ValueError as e:
        raise TurboSpecError(str(e)) from None


__all__ = ["SPEC_TYPES", "SpecConfig", "make_drafter"]
