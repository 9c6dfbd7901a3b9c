"""The engine: one sequence at a time, prefill then decode with speculative steps."""

from turbospec.engine.build import build_engine, default_model, load_parts, model_path
from turbospec.engine.engine import Engine
from turbospec.engine.stats import Chunk, GenStats

__all__ = ["Chunk", "Engine", "GenStats", "build_engine", "default_model", "load_parts", "model_path"]
