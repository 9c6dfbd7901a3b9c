"""Whether the Triton kernels run: Triton importable, and tensors on a GPU (or `ON_CPU`: the tests run them on
the CPU in Triton's interpreter, which needs TRITON_INTERPRET=1 set before Triton is first imported: tests/conftest.py
sets it on machines without a GPU)."""

from __future__ import annotations

import sys
from functools import cache

import torch


@cache
def available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


ON_CPU = False  # the tests' switch: CPU tensors take the Triton kernels too (interpreted)


def wanted(t: torch.Tensor) -> bool:
    """Whether work on tensors like `t` goes to the Triton kernels."""
    return (t.is_cuda or ON_CPU) and available()


_FAILED: dict[str, str] = {}


def enabled(kernel: str) -> bool:
    """False once `kernel` failed here (its callers then take the torch path for the rest of the process)."""
    return kernel not in _FAILED


def failed(kernel: str, error: Exception) -> None:
    """Record (and say, once) that `kernel` could not run: a Triton or driver that cannot compile it. Running out of
    device memory is not that: it is raised again (the torch path would need more)."""
    if isinstance(error, torch.cuda.OutOfMemoryError):
        raise error
    if kernel not in _FAILED:
        _FAILED[kernel] = f"{type(error).__name__}: {' '.join(str(error).split())[:200]}"
        print(f"turbospec: Triton {kernel} kernel unavailable ({_FAILED[kernel]}); using torch", file=sys.stderr)
