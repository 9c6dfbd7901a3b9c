"""Linear layers with the weight layout that runs fastest for the dtype on this CPU."""

from __future__ import annotations

import torch
import torch.nn.functional as F


class Linear:
    """y = x W^T + b. Several HF projections can be fused into one (rows concatenated)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.weight = weight.contiguous()
        self.bias = bias
        self.out_features, self.in_features = self.weight.shape

    @classmethod
    def fused(cls, weights: list[torch.Tensor], biases: list[torch.Tensor | None]) -> Linear:
        w = torch.cat(weights, 0) if len(weights) > 1 else weights[0]
        if all(b is None for b in biases):
            return cls(w, None)
        bs = [b if b is not None else torch.zeros(wi.shape[0], dtype=w.dtype) for b, wi in zip(biases, weights)]
        return cls(w, torch.cat(bs, 0))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    @property
    def nbytes(self) -> int:
        n = self.weight.numel() * self.weight.element_size()
        return n + (self.bias.numel() * self.bias.element_size() if self.bias is not None else 0)
