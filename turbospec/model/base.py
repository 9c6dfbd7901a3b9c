"""The model interface: what the engine, the drafters and the lab call on any model family."""

from __future__ import annotations

from typing import Protocol

import torch

from turbospec.kv.base import Cache
from turbospec.kv.plan import AttentionPlan
from turbospec.layers.linear import Linear
from turbospec.layers.moe import ExpertCache
from turbospec.layers.rope import Rope
from turbospec.model.config import ModelConfig
from turbospec.model.mtp import MTPModule


class Model(Protocol):
    """A loaded checkpoint. `forward` returns final-normed hidden states, `logits` turns the rows that need them
    into float32 logits; `mtp` is the native multi-token-prediction block, when the checkpoint has one."""

    cfg: ModelConfig
    dtype: torch.dtype
    lm_head: Linear  # the output projection (Medusa heads and MTP drafting share it)
    mtp: MTPModule | None
    experts: ExpertCache  # mixture-of-experts models' routed experts (empty for other models)
    rope: Rope  # the rotary tables (the MTP block shares them)

    def new_cache(self, max_len: int, *, k_type: str | None = None, v_type: str | None = None,
                  checkpoints: int = 0) -> Cache:
        """A cache for one sequence of up to max_len positions; K/V formats by name (None: the model dtype);
        `checkpoints`: recurrent states kept for prefix reuse (hybrids; attention KV resumes at any prefix)."""
        ...

    def forward(self, tokens: torch.Tensor, plan: AttentionPlan, cache: Cache, out_rows: int | None = None
                ) -> torch.Tensor:
        """Hidden rows [N, H] for tokens [N] placed by `plan`; only the last `out_rows` rows when given."""
        ...

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits [N, vocab] of hidden rows [N, H]."""
        ...

    @property
    def weight_bytes(self) -> int:
        """Bytes of the weights as held in memory."""
        ...
