"""Model families by architecture name: which class builds a checkpoint, and loading one."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch

from turbospec import device
from turbospec.dtypes import parse_dtype
from turbospec.errors import TurboSpecError
from turbospec.model import draft_vocab
from turbospec.model.base import Model
from turbospec.model.config import DENSE_ARCHS, HYBRID_ARCHS, ModelConfig
from turbospec.model.gguf import GGUFFile, GGUFWeights, is_gguf
from turbospec.model.loader import IndexedSource, TensorSource, WeightSource, load_config
from turbospec.model.placement import OnDevice
from turbospec.weights import PACKED, WEIGHT_CHOICES, trim_heap

Builder = Callable[[ModelConfig, TensorSource, torch.dtype], Model]
Progress = Callable[[int, int], None]  # (done, total)
# (config, source) -> what one part of a split model builds from (tensor parallelism's rank: turbospec.parallel.tp)
Shard = Callable[[ModelConfig, IndexedSource], tuple[ModelConfig, TensorSource]]


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


def load_gguf(f: GGUFFile, dtype: str | torch.dtype = "float32", weights: str = "auto",
              moe_cache_mem: int | None = None, progress: Progress | None = None, shard: Shard | None = None) -> Model:
    """Build the model of an opened GGUF file (`weights`, `moe_cache_mem`, `progress`, `shard`: as `load_model`)."""
    cfg = f.config()
    model = _build(cfg, _packing(f.weights(cfg), weights, moe_cache_mem), dtype, progress, shard)
    if model.mtp is not None:  # the MTP drafter's ranking, read here with the rest of the header ([]: none)
        model.mtp.ranked_vocab = draft_vocab.from_meta(f.meta) or []
    return model


def load_model(path: str | Path, dtype: str | torch.dtype = "float32", weights: str = "auto",
               moe_cache_mem: int | None = None, progress: Progress | None = None, shard: Shard | None = None) -> Model:
    """Load a checkpoint directory (config.json + safetensors) or a llama.cpp GGUF file into a turbospec model.
    `weights`: "auto" keeps matrices as stored (float ones in `dtype`, a GGUF file's Q8_0 / Q4_0 / Q4_K blocks
    packed); "q8_0" / "q4_0" / "q4_k" quantize the float matrices as they load (llama.cpp's reference blocks).
    `moe_cache_mem`: bytes of mixture-of-experts experts kept in memory, loaded when first routed to and dropped
    least recently used first (None: every expert loaded at once). `progress(done, total)`: told the tensors read
    so far while the model is built (a load bar), and (total, total) at the end. `shard`: builds one part of the
    model instead (the config and the tensors it reads through)."""
    if is_gguf(path):
        return load_gguf(GGUFFile(path), dtype, weights, moe_cache_mem, progress, shard)
    return _build(load_config(path), _packing(WeightSource(path), weights, moe_cache_mem), dtype, progress, shard)


def _build(cfg: ModelConfig, ws: WeightSource | GGUFWeights, dtype: str | torch.dtype, progress: Progress | None,
           shard: Shard | None = None) -> Model:
    ws.progress = progress
    dev = device.current()
    try:
        cfg_, src = shard(cfg, ws) if shard is not None else (cfg, ws)
        model = build_model(cfg_, src if dev.type == "cpu" else OnDevice(src, dev), parse_dtype(dtype))
    finally:
        ws.progress = None  # experts loaded later (--moe-cache-mem) are no longer the load's
        ws.seen = None
    if progress is not None:
        progress(len(ws.index), len(ws.index))
    trim_heap()
    return model


Source = TypeVar("Source", bound=IndexedSource)


def _packing(ws: Source, weights: str, moe_cache_mem: int | None = None) -> Source:
    """`ws` with `--weights` set (the format float matrices are packed to as they load, None for auto) and the
    experts' memory budget."""
    if weights not in WEIGHT_CHOICES:
        raise TurboSpecError(f"weights {weights!r}: expected one of {', '.join(WEIGHT_CHOICES)}")
    if moe_cache_mem is not None and moe_cache_mem < 0:
        raise TurboSpecError(f"--moe-cache-mem must be >= 0, got {moe_cache_mem}")
    ws.pack = PACKED.get(weights)
    ws.expert_budget = moe_cache_mem
    return ws
