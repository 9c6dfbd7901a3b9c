"""Speculative decoding: drafters (MTP, Medusa, n-gram, draft model, chains) propose `DraftTree`s; the one
verifier (`verify`) accepts a path of each, exactly (greedy) or by rejection sampling (lossless)."""

from turbospec.speculative.drafter import Drafter
from turbospec.speculative.registry import DRAFTERS, make_drafter
from turbospec.speculative.stats import SpecStats
from turbospec.speculative.tree import DraftTree
from turbospec.speculative.verify import verify

__all__ = ["DRAFTERS", "DraftTree", "Drafter", "SpecStats", "make_drafter", "verify"]
