"""Whether the Triton kernels run: Triton importable, and tensors on a GPU (or TRITON_INTERPRET=1: the tests run
them on the CPU in Triton's interpreter)."""

from __future__ import annotations

import os
from functools import cache

import torch


@cache
def available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def wanted(t: torch.Tensor) -> bool:
    """Whether work on tensors like `t` goes to the Triton kernels."""
    return (t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1") and available()
