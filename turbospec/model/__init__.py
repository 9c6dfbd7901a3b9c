"""Models: the `Model` protocol, the families (dense, hybrid) and loading checkpoints."""

from turbospec.model.base import Model
from turbospec.model.config import ModelConfig
from turbospec.model.registry import build_model, load_model

__all__ = ["Model", "ModelConfig", "build_model", "load_model"]
