"""Read Hugging Face checkpoint directories: config.json + (sharded) safetensors, tensor by tensor."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import Protocol

import torch
from safetensors import safe_open

from turbospec.errors import TurboSpecError
from turbospec.model.config import ModelConfig
from turbospec.weights import WeightFormat, consume, packable, release, trim_heap


class TensorSource(Protocol):
    """Named tensors of a model, under Hugging Face names: a checkpoint directory (`WeightSource`) or a GGUF file
    (`turbospec.model.gguf.GGUFWeights`)."""

    expert_budget: int | None  # bytes of MoE experts kept in memory; None: every expert, loaded once

    def names(self) -> list[str]: ...

    def has(self, name: str) -> bool: ...

    def get(self, name: str, dtype: torch.dtype | None = None, shape: tuple[int, ...] | None = None
            ) -> torch.Tensor: ...

    def matrix(self, name: str, dtype: torch.dtype, shape: tuple[int, int]) -> torch.Tensor:
        """A linear layer's (or the embedding's) weight: packed blocks (`turbospec.weights`) when the source
        stores them packed or `pack` asks for a format, else a float matrix in `dtype`."""
        ...

    def expert_matrix(self, name: str, index: int, dtype: torch.dtype, shape: tuple[int, int]) -> torch.Tensor:
        """Matrix `index` of a stacked [experts, out, in] tensor (a MoE layer's experts), as `matrix` gives one;
        only that expert's bytes are read."""
        ...

    def value_tiling(self, name: str) -> int:
        """r > 1 when `matrix(name)` (a Gated DeltaNet output projection) came with its columns in llama.cpp's
        tiled value-head order (r value heads per key head) because packed blocks could not be reordered: the
        layer then permutes its activations instead. 1: the checkpoint's order."""
        ...


class IndexedSource:
    """A `TensorSource` whose `index` maps each Hugging Face name to where the tensor lives. `pack`: the weight
    format float matrices are quantized to as they load (`--weights`), None to keep them float."""

    index: dict
    pack: WeightFormat | None = None
    expert_budget: int | None = None  # bytes of MoE experts kept in memory (--moe-cache-mem); None: all
    progress: Callable[[int, int], None] | None = None  # (tensors read, tensors in the index) while a model loads
    seen: set[str] | None = None  # the tensors `progress` was told of

    def names(self) -> list[str]:
        return list(self.index)

    def _reading(self, name: str) -> None:
        """Report `name` (each tensor once) to `progress`."""
        if self.progress is not None:
            if self.seen is None:
                self.seen = set()
            if name not in self.seen:
                self.seen.add(name)
                self.progress(len(self.seen), len(self.index))

    def has(self, name: str) -> bool:
        return name in self.index

    def value_tiling(self, name: str) -> int:
        return 1

    def expert_matrix(self, name: str, index: int, dtype: torch.dtype, shape: tuple[int, int]) -> torch.Tensor:
        t = self.stacked_part(name, index)
        if tuple(t.shape) != tuple(shape):
            raise TurboSpecError(f"shape mismatch for expert {index} of {name!r}: {tuple(t.shape)}, config implies "
                                 f"{tuple(shape)}")
        if self.pack is not None and packable(self.pack, shape):
            return consume(t.contiguous(), self.pack)
        return t if t.dtype == dtype else t.to(dtype)

    def stacked_part(self, name: str, index: int) -> torch.Tensor:
        """Part `index` (first dimension) of a stacked tensor, as stored."""
        t = self.get(name)
        if not 0 <= index < t.shape[0]:
            raise TurboSpecError(f"{name!r} has {t.shape[0]} parts, no part {index}")
        return t[index]

    def matrix(self, name: str, dtype: torch.dtype, shape: tuple[int, int]) -> torch.Tensor:
        trim_heap()  # the previous matrix's conversion buffers (freed, but held by the heap) back to the system
        if self.pack is not None and packable(self.pack, shape):
            return consume(self.get(name, None, shape), self.pack)  # from the stored dtype, chunk by chunk
        return self.get(name, dtype, shape)


class WeightSource(IndexedSource):
    """Lazily reads named tensors from the safetensors files of a checkpoint (one open handle per file).

    Tensors are read one at a time and converted to the target dtype, so at most one extra tensor is alive
    while a model is built.
    """

    def __init__(self, directory: str | Path):
        self.dir = Path(directory)
        self.index: dict[str, Path] = {}
        self._handles: dict[Path, object] = {}
        index_file = self.dir / "model.safetensors.index.json"
        if index_file.exists():
            for name, fname in _weight_map(index_file).items():
                self.index[name] = self.dir / fname
            files = sorted(set(self.index.values()))
            for f in files:
                if not f.exists():
                    raise TurboSpecError(f"missing shard {f.name} listed in {index_file.name}")
                self._open(f)
        else:
            files = sorted(self.dir.glob("*.safetensors"))
            if not files:
                raise TurboSpecError(f"no *.safetensors files in {self.dir}")
            for f in files:
                for name in self._open(f).keys():  # noqa: SIM118 -- safe_open is not iterable
                    self.index[name] = f

    def _open(self, f: Path):
        if f not in self._handles:
            try:
                self._handles[f] = safe_open(str(f), framework="pt")
            except Exception as e:  # noqa: BLE001 -- safetensors raises its own types for corrupt headers
                raise TurboSpecError(f"{f.name}: corrupt or truncated safetensors file ({_one_line(e)})") from None
        return self._handles[f]

    def _file_of(self, name: str) -> Path:
        """The shard file holding `name` (counted as read for the load's progress); a one-line error if none."""
        if name not in self.index:
            raise TurboSpecError(f"missing tensor {name!r} in {self.dir}")
        self._reading(name)
        return self.index[name]

    def _slice(self, name: str):
        """(file, safetensors slice of `name`): reads only the parts indexed."""
        f = self._file_of(name)
        try:
            return f, self._open(f).get_slice(name)
        except Exception as e:  # noqa: BLE001 -- any read failure becomes a one-line error
            raise TurboSpecError(f"{f.name}: cannot read tensor {name!r} ({_one_line(e)})") from None

    def _mapped(self, name: str) -> torch.Tensor:
        """Tensor `name` as a view of its file's mapping (nothing read yet)."""
        f = self._file_of(name)
        try:
            return self._open(f).get_tensor(name)
        except Exception as e:  # noqa: BLE001 -- any read failure becomes a one-line error
            raise TurboSpecError(f"{f.name}: cannot read tensor {name!r} ({_one_line(e)})") from None

    def get(self, name: str, dtype: torch.dtype | None = None, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        t = self._mapped(name)
        if shape is not None and tuple(t.shape) != tuple(shape):
            raise TurboSpecError(f"shape mismatch for {name!r}: file has {tuple(t.shape)}, config implies {shape}")
        if dtype is not None and t.dtype != dtype:
            t = consume(t, None, dtype) if t.dim() >= 1 and t.is_contiguous() else t.to(dtype)
        return t

    def shard(self, name: str, dim: int, ranges: list[tuple[int, int]], dtype: torch.dtype | None,
              shape: tuple[int, ...]) -> torch.Tensor:
        """The index ranges `ranges` ([start, stop) along `dim`) of tensor `name`, put together along `dim`, in
        `dtype` (None: as stored): tensor parallelism's per-rank load. Only those bytes are copied out of the file
        mapping (along dim 1, each row's part) and the pages touched are dropped after, so a rank's memory holds its
        parts alone. `shape`: the whole tensor's, as the config implies."""
        t = self._mapped(name)
        if tuple(t.shape) != tuple(shape):
            raise TurboSpecError(f"shape mismatch for {name!r}: file has {tuple(t.shape)}, config implies "
                                 f"{tuple(shape)}")
        parts = [t.narrow(dim, a, b - a) for a, b in ranges]
        if len(parts) == 1 and dtype is not None and dtype != t.dtype and t.dim() >= 1:
            out = consume(parts[0], None, dtype)  # converted in chunks, a large result in its own huge pages
        else:
            out = torch.cat(parts, dim) if len(parts) > 1 else parts[0].clone(memory_format=torch.contiguous_format)
            out = out if dtype is None else out.to(dtype)
        release(t)  # the file pages the copy touched leave this process's memory
        return out

    def stacked_part(self, name: str, index: int) -> torch.Tensor:
        """Reads only that part's bytes (a safetensors slice)."""
        f, sl = self._slice(name)
        try:
            n = sl.get_shape()[0]
            if not 0 <= index < n:
                raise TurboSpecError(f"{name!r} has {n} parts, no part {index}")
            return sl[index]
        except TurboSpecError:
            raise
        except Exception as e:  # noqa: BLE001 -- any read failure becomes a one-line error
            raise TurboSpecError(f"{f.name}: cannot read part {index} of tensor {name!r} ({_one_line(e)})") from None


def _weight_map(index_file: Path) -> dict[str, str]:
    """The index's tensor -> shard file map. A shard must be a relative `*.safetensors` path without `..` parts
    (checked on the name, so shards that are symlinks, as in a Hugging Face cache, still load)."""
    try:
        weight_map = json.loads(index_file.read_text(encoding="utf-8"))["weight_map"]
    except (ValueError, KeyError, TypeError) as e:  # ValueError: bad JSON, bad UTF-8, huge ints
        raise TurboSpecError(f"{index_file}: invalid safetensors index ({_one_line(e)})") from None
    except (OSError, RecursionError) as e:
        raise TurboSpecError(f"{index_file}: cannot read it ({type(e).__name__})") from None
    if not isinstance(weight_map, dict):
        raise TurboSpecError(f"{index_file.name}: weight_map must be a JSON object")
    for name, fname in weight_map.items():
        parts = PurePosixPath(fname).parts if isinstance(fname, str) else ()
        if (not parts or not fname.endswith(".safetensors") or fname.startswith("/")
                or any(c in "\\:" or ord(c) < 32 for c in fname) or any(p in ("..", ".") for p in parts)):
            shown = repr(fname) if len(repr(fname)) <= 80 else repr(fname)[:77] + "..."
            raise TurboSpecError(f"{index_file.name}: tensor {name[:80]!r} maps to {shown}; shards must be "
                                 f"relative *.safetensors paths inside the model directory")
    return weight_map


def _one_line(e: Exception) -> str:
    return " ".join(str(e).split())[:200]


def load_config(path: str | Path) -> ModelConfig:
    p = Path(path)
    if not p.exists():
        raise TurboSpecError(f"model path {p} does not exist")
    if p.is_file():
        raise TurboSpecError(f"{p} is a file; pass a checkpoint directory (config.json + *.safetensors)")
    return ModelConfig.from_file(p / "config.json")
