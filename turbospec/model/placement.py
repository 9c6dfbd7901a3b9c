"""Tensor sources for models that live off the CPU or have no checkpoint.

`OnDevice(ws, device)`: any `TensorSource` with each tensor moved to `device` as the model reads it (one tensor
at a time, so loading holds one extra host copy at most). `RandomSource(cfg, names)`: random weights of a config
under a checkpoint's tensor names, made on the current default device (`turbospec.device`): the GPU check's
real-size models (benchmarks/gpu_check.py), which no file of 54 GB has to back.
"""

from __future__ import annotations

import re

import torch

from turbospec.errors import TurboSpecError
from turbospec.model.config import ModelConfig
from turbospec.model.loader import TensorSource
from turbospec.weights import WeightFormat, packable, random_blocks


class OnDevice:
    """`inner` with every tensor it gives moved to `device` (packed weight blocks as they are: the GPU multiplies
    them in Triton, turbospec.kernels.packed)."""

    def __init__(self, inner: TensorSource, device: torch.device):
        self.inner, self.device = inner, device

    def __getattr__(self, name: str):  # names, has, value_tiling, expert_budget, index, ...
        return getattr(self.inner, name)

    def get(self, name: str, dtype: torch.dtype | None = None, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        return self.inner.get(name, dtype, shape).to(self.device)

    def matrix(self, name: str, dtype: torch.dtype, shape: tuple[int, int]) -> torch.Tensor:
        return self.inner.matrix(name, dtype, shape).to(self.device)

    def expert_matrix(self, name: str, index: int, dtype: torch.dtype, shape: tuple[int, int]) -> torch.Tensor:
        return self.inner.expert_matrix(name, index, dtype, shape).to(self.device)


_LAYER = re.compile(r"^(model\.layers\.)(\d+)(\..*)$")


def layer_names(template: list[str], cfg: ModelConfig, template_types: list[str]) -> list[str]:
    """The tensor names of a checkpoint of `cfg` (its layer count and layer types) from a smaller checkpoint's
    names `template` of the same family (layer i of `template` has kind template_types[i]): each layer takes the
    names of the template's first layer of its kind; names outside `model.layers.N.` are kept."""
    first: dict[str, int] = {}
    for i, kind in enumerate(template_types):
        first.setdefault(kind, i)
    per_layer: dict[int, list[str]] = {}
    out: list[str] = []
    for n in template:
        m = _LAYER.match(n)
        if m is None:
            out.append(n)
        else:
            per_layer.setdefault(int(m.group(2)), []).append(m.group(3))
    for i, kind in enumerate(cfg.layer_types()):
        if kind not in first:
            raise TurboSpecError(f"the template has no {kind} layer")
        out += [f"model.layers.{i}{tail}" for tail in per_layer[first[kind]]]
    return out


class RandomSource:
    """Random weights (normal, std 0.02; norms near 1; the Gated DeltaNet's decay parameters in their usual range)
    for the tensor names `names`, in the shapes the model asks for, on the current default device. `pack`: matrices
    as random blocks of that format instead (`turbospec.weights.random_blocks`), as `--weights` would give."""

    expert_budget: int | None = None
    pack: WeightFormat | None = None

    def __init__(self, names: list[str], seed: int = 0, shapes: dict[str, tuple[int, ...]] | None = None):
        """`shapes`: the shapes of tensors a model reads without giving one (a MoE's shared-expert gate)."""
        self._names = list(names)
        self._set = set(names)
        self.seed = seed
        self.count = 0
        self.shapes = shapes or {}

    def names(self) -> list[str]:
        return list(self._names)

    def has(self, name: str) -> bool:
        return name in self._set

    def value_tiling(self, name: str) -> int:
        return 1

    def get(self, name: str, dtype: torch.dtype | None = None, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        if name not in self._set:
            raise TurboSpecError(f"missing tensor {name!r}")
        shape = shape or self.shapes.get(name)
        if shape is None:
            raise TurboSpecError(f"random weights need the shape of {name!r}")
        g = self._generator()
        dtype = dtype or torch.float32
        if name.endswith("A_log"):
            return torch.empty(shape, dtype=torch.float32).uniform_(0.0, 2.0, generator=g).to(dtype)
        if name.endswith("dt_bias"):
            return torch.ones(shape, dtype=dtype)
        if "norm" in name.rsplit(".", 2)[-2]:  # (input_layernorm, q_norm, norm, pre_fc_norm_embedding, ...)
            return (1.0 + 0.02 * torch.randn(shape, generator=g)).to(dtype)
        return (0.02 * torch.randn(shape, generator=g)).to(dtype)

    def _generator(self) -> torch.Generator:
        """A generator on the default device, seeded for the next tensor (each tensor its own stream)."""
        self.count += 1
        return torch.Generator(device=torch.get_default_device()).manual_seed(self.seed * 1_000_003 + self.count)

    def matrix(self, name: str, dtype: torch.dtype, shape: tuple[int, int]) -> torch.Tensor:
        if self.pack is not None and packable(self.pack, shape) and self.has(name):
            return random_blocks(self.pack, shape, generator=self._generator())
        return self.get(name, dtype, shape)

    def expert_matrix(self, name: str, index: int, dtype: torch.dtype, shape: tuple[int, int]) -> torch.Tensor:
        return self.matrix(name, dtype, shape)
