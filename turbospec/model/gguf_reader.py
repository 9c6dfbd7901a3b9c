"""A lean GGUF reader: the key/value metadata as python values and the tensors as views of one read-only memory
map, for the `gguf` package's types and block sizes.

`gguf.GGUFReader` builds numpy objects for every part of every field: for a Qwen3.5 file (248,320 tokens and as many
merges) that is ~0.5 GB of resident memory and ~8 s before the first tensor is read. This reader walks the same
format (version 2 and 3, little-endian) with `struct` and keeps python strings and lists only.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

# GGUF value types (gguf.GGUFValueType): struct format of the scalars; 8 = string, 9 = array
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
          7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9
# tensor types stored as plain numpy values (the rest are blocks of bytes, as GGUFReader gives them)
_PLAIN = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8, "I16": np.int16, "I32": np.int32,
          "I64": np.int64}


@dataclass
class GGUFTensor:
    """One tensor: `shape` innermost dimension first (as ggml lists it); `data` a view of the map: values for
    F32 / F16 / integer types, else bytes [.., row bytes]."""

    name: str
    shape: np.ndarray
    tensor_type: Any  # gguf.GGMLQuantizationType
    data: np.ndarray
    n_elements: int
    n_bytes: int


class GGUFContents:
    """`meta`: key -> str / int / float / bool / list (plus GGUF.version, GGUF.tensor_count, GGUF.kv_count);
    `tensors`: in file order. Raises ValueError (or struct.error) on a malformed or truncated header."""

    def __init__(self, path: str | Path):
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        self.map = np.memmap(str(path), mode="r", dtype=np.uint8)
        self.buf = memoryview(self.map)  # type: ignore[arg-type]
        self.pos = 0
        if bytes(self.buf[:4]) != b"GGUF":
            raise ValueError("not a GGUF file (bad magic)")
        self.pos = 4
        version = self._scalar(4)
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} is not supported (2, 3)")
        n_tensors, n_kv = self._scalar(10), self._scalar(10)
        self.meta: dict[str, Any] = {"GGUF.version": version, "GGUF.tensor_count": n_tensors, "GGUF.kv_count": n_kv}
        for _ in range(n_kv):
            key = self._string()
            self.meta[key] = self._value(self._scalar(4))
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            n_dims = self._scalar(4)
            if n_dims > 8:
                raise ValueError(f"tensor {name!r} has {n_dims} dimensions")
            dims = [self._scalar(10) for _ in range(n_dims)]
            infos.append((name, dims, GGMLQuantizationType(self._scalar(4)), self._scalar(10)))
        align = int(self.meta.get("general.alignment", 32))
        start = (self.pos + align - 1) // align * align
        self.tensors: list[GGUFTensor] = []
        for name, dims, qtype, offset in infos:
            block, size = GGML_QUANT_SIZES[qtype]
            n = int(np.prod(dims, dtype=np.int64)) if dims else 1
            if dims and dims[0] % block:
                raise ValueError(f"tensor {name!r}: {dims[0]} values per row is not a whole number of blocks")
            nbytes = n // block * size
            raw = self.map[start + offset:start + offset + nbytes]
            rows = [int(d) for d in reversed(dims)] or [1]
            plain = _PLAIN.get(qtype.name)
            if plain is not None:
                data = raw.view(plain).reshape(rows)
            else:  # blocks: the last dimension in bytes
                data = raw.reshape(*rows[:-1], rows[-1] // block * size)
            self.tensors.append(GGUFTensor(name, np.array(dims, dtype=np.uint64), qtype, data, n, nbytes))

    def _scalar(self, kind: int):
        fmt = _SCALARS[kind]
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return v

    def _string(self) -> str:
        n = self._scalar(10)
        if self.pos + n > len(self.buf):
            raise ValueError("truncated string")
        s = bytes(self.buf[self.pos:self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return s

    def _value(self, kind: int):
        if kind == _STRING:
            return self._string()
        if kind == _ARRAY:
            item, count = self._scalar(4), self._scalar(10)
            if item == _STRING:
                return [self._string() for _ in range(count)]
            if item == _ARRAY:
                return [self._value(_ARRAY) for _ in range(count)]
            dt = np.dtype(_NUMPY[item]).newbyteorder("<")
            end = self.pos + count * dt.itemsize
            if end > len(self.buf):
                raise ValueError("truncated array")
            vals = np.frombuffer(self.buf[self.pos:end], dtype=dt).tolist()
            self.pos = end
            return vals
        if kind not in _SCALARS:
            raise ValueError(f"unknown GGUF value type {kind}")
        return self._scalar(kind)
