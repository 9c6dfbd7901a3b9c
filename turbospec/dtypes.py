"""Float type names: the one map from every accepted spelling (float16, fp16, f16, half, ...) to a torch dtype."""

from __future__ import annotations

import torch

from turbospec.errors import TurboSpecError

_BY_NAME: dict[str, torch.dtype] = {
    "float32": torch.float32, "f32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "f16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}
_SHORT = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
_LONG = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def is_dtype_name(name: str) -> bool:
    return name.lower() in _BY_NAME


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """The torch dtype for any accepted spelling; a one-line error for anything else."""
    if isinstance(name, torch.dtype):
        if name not in _SHORT:
            raise TurboSpecError(f"unsupported dtype {name} (float32, bfloat16, float16)")
        return name
    try:
        return _BY_NAME[name.lower()]
    except (KeyError, AttributeError):
        raise TurboSpecError(f"unknown dtype {name!r} (float32, bfloat16, float16)") from None


def short_name(dtype: str | torch.dtype) -> str:
    """ggml-style name of a float type: f32, f16, bf16 (also the KV format name of a plain cache)."""
    return _SHORT[parse_dtype(dtype)]


def long_name(dtype: str | torch.dtype) -> str:
    """torch-style name of a float type: float32, float16, bfloat16."""
    return _LONG[parse_dtype(dtype)]


def nbytes(dtype: str | torch.dtype) -> int:
    """Bytes per value."""
    return parse_dtype(dtype).itemsize
