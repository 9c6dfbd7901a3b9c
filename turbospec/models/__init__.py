"""Model registry: build a model object from a checkpoint directory."""

from __future__ import annotations

from pathlib import Path

import torch

from turbospec.config import DENSE_ARCHS, ModelConfig
from turbospec.errors import TurboSpecError
from turbospec.loader import WeightSource, load_config, parse_dtype


def load_model(path: str | Path, dtype: str | torch.dtype = "float32"):
    """Load a checkpoint directory into a turbospec model (dense or hybrid)."""
    cfg = load_config(path)
    dt = parse_dtype(dtype)
    ws = WeightSource(path)
    return build_model(cfg, ws, dt)


def build_model(cfg: ModelConfig, ws: WeightSource, dtype: torch.dtype):
    if cfg.arch in DENSE_ARCHS:
        from turbospec.models.dense import DenseModel

        return DenseModel(cfg, ws, dtype)
    try:
        from turbospec.models.hybrid import HybridModel
    except ImportError:
        raise TurboSpecError(f"architecture {cfg.arch!r} is not implemented yet") from None
    return HybridModel(cfg, ws, dtype)
