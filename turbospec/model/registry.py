"""Model families by architecture name: which class builds a checkpoint, and loading one."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from turbospec.dtypes import parse_dtype
from turbospec.errors import TurboSpecError
from turbospec.model.base import Model
from turbospec.model.config import DENSE_ARCHS, HYBRID_ARCHS, ModelConfig
from turbospec.model.gguf import GGUFFile, is_gguf
from turbospec.model.loader import TensorSource, WeightSource, load_config

Builder = Callable[[ModelConfig, TensorSource, torch.dtype], Model]


def _dense(cfg: ModelConfig, ws: TensorSource, dtype: torch.dtype) -> Model:
    from turbospec.model.dense import DenseModel

    return DenseModel(cfg, ws, dtype)


def _hybrid(cfg: ModelConfig, ws: TensorSource, dtype: torch.dtype) -> Model:
    from turbospec.model.hybrid import HybridModel

    return HybridModel(cfg, ws, dtype)


FAMILIES: dict[str, Builder] = {**dict.fromkeys(DENSE_ARCHS, _dense), **dict.fromkeys(HYBRID_ARCHS, _hybrid)}


def build_model(cfg: ModelConfig, ws: TensorSource, dtype: torch.dtype) -> Model:
    try:
        family = FAMILIES[cfg.arch]
    except KeyError:
        raise TurboSpecError(f"architecture {cfg.arch!r} is not implemented (supported: {', '.join(FAMILIES)})") \
            from None
    return family(cfg, ws, dtype)


def load_gguf(f: GGUFFile, dtype: str | torch.dtype = "float32") -> Model:
    """Build the model of an opened GGUF file."""
    cfg = f.config()
    return build_model(cfg, f.weights(cfg), parse_dtype(dtype))


def load_model(path: str | Path, dtype: str | torch.dtype = "float32") -> Model:
    """Load a checkpoint directory (config.json + safetensors) or a llama.cpp GGUF file into a turbospec model."""
    if is_gguf(path):
        return load_gguf(GGUFFile(path), dtype)
    cfg = load_config(path)
    return build_model(cfg, WeightSource(path), parse_dtype(dtype))
