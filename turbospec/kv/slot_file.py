"""Slot files: a sequence's context (its tokens, the K/V of their positions in the cache's own formats, and a hybrid
model's recurrent states after them) saved to disk and read back (`/slots/{id}?action=save|restore`).

One safetensors file: `tokens` int64 [n]; `k.<field>` / `v.<field>` [layers, kv heads, n, ...] (the format's
stored fields, bytes as they are in the cache: restoring is a copy, not a re-encode); `conv` [gdn layers, K-1, C]
and `ssm` [gdn layers, Hv, Dk, Dv] on hybrids. Its metadata names the file format and version, the model
(a fingerprint of its config, dtype and first weights) and the K/V formats; a file that does not match the server
is refused with a one-line error. Writes go to a temporary file in the same folder, renamed into place.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from turbospec.errors import TurboSpecError

# version 2: turbo3/turbo4 caches decode with centroids on an int8 grid (turbospec/kv/formats/turbo.py), so files of
# version 1 would resume a turbo context with slightly different values than a cold run
FORMAT, VERSION = "turbospec-slot", "2"


@dataclass
class SlotData:
    tokens: list[int]
    k: dict[str, torch.Tensor]  # field -> [layers, kv heads, n, ...]
    v: dict[str, torch.Tensor]
    conv: torch.Tensor | None = None  # hybrids: [gdn layers, K-1, C]
    ssm: torch.Tensor | None = None  # [gdn layers, Hv, Dk, Dv] float32
    save_id: str = ""  # tensor parallelism: the save the file came from (every rank's file of one save has it)


def model_fingerprint(model) -> str:
    """Identifies a model's weights well enough to refuse a file from another one: config, dtype, and the first
    64 KiB of the embedding table."""
    h = hashlib.sha256()
    h.update(json.dumps(model.cfg.raw, sort_keys=True, default=str).encode())
    h.update(str(model.dtype).encode())
    emb = model.embed if isinstance(model.embed, torch.Tensor) else None
    if emb is not None:
        flat = emb.reshape(-1)[: 65536 // emb.element_size()].contiguous()
        h.update(flat.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:32]


def save(path: Path, data: SlotData, *, model: str, k_type: str, v_type: str, part: str = "", save_id: str = ""
         ) -> int:
    """Write `data` atomically; the bytes written. `part` ("rank/ranks") and `save_id`: a tensor-parallel rank's
    file, one of a save's set."""
    from safetensors.torch import save_file

    tensors = {"tokens": torch.tensor(data.tokens, dtype=torch.int64)}
    tensors |= {f"k.{f}": t.contiguous() for f, t in data.k.items()}
    tensors |= {f"v.{f}": t.contiguous() for f, t in data.v.items()}
    if data.conv is not None and data.ssm is not None:
        tensors |= {"conv": data.conv.contiguous(), "ssm": data.ssm.contiguous()}
    meta = {"format": FORMAT, "version": VERSION, "model": model, "k_type": k_type, "v_type": v_type,
            "n_tokens": str(len(data.tokens))}
    if part:
        meta |= {"part": part, "save_id": save_id}
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata=meta)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path.stat().st_size


def load(path: Path, *, model: str, k_type: str, v_type: str, hybrid: bool, part: str = "") -> SlotData:
    """Read a slot file written for this model and these K/V formats (and this tensor-parallel `part`: "rank/ranks",
    "" for one process) -- one-line errors otherwise."""
    from safetensors import safe_open

    if not path.is_file():
        raise TurboSpecError(f"slot file {path.name!r} not found")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 - safe_open has no __iter__
    except Exception as e:  # noqa: BLE001 - truncated or not a safetensors file
        raise TurboSpecError(f"slot file {path.name!r} is not readable ({str(e).splitlines()[0][:120]})") from None
    if meta.get("format") != FORMAT:
        raise TurboSpecError(f"{path.name!r} is not a turbospec slot file")
    if meta.get("version") != VERSION:
        raise TurboSpecError(f"slot file {path.name!r} has version {meta.get('version')}, this server reads {VERSION}")
    if meta.get("part", "") != part:
        raise TurboSpecError(f"slot file {path.name!r} holds {_part(meta.get('part', ''))}, this server's "
                             f"{'rank ' if part else ''}needs {_part(part)}")
    if meta.get("model") != model:
        raise TurboSpecError(f"slot file {path.name!r} was saved from another model")
    if (meta.get("k_type"), meta.get("v_type")) != (k_type, v_type):
        raise TurboSpecError(f"slot file {path.name!r} holds K/V as {meta.get('k_type')}/{meta.get('v_type')}, the "
                             f"server runs {k_type}/{v_type} (-ctk/-ctv)")
    if "tokens" not in tensors or ("conv" in tensors) != hybrid or ("ssm" in tensors) != hybrid:
        raise TurboSpecError(f"slot file {path.name!r} is incomplete")
    tokens = tensors.pop("tokens").tolist()
    n = len(tokens)
    k = {name[2:]: t for name, t in tensors.items() if name.startswith("k.")}
    v = {name[2:]: t for name, t in tensors.items() if name.startswith("v.")}
    if not k or not v or any(t.dim() < 3 or t.shape[2] != n for t in (*k.values(), *v.values())):
        raise TurboSpecError(f"slot file {path.name!r} is incomplete")
    return SlotData(tokens, k, v, tensors.get("conv"), tensors.get("ssm"), meta.get("save_id", ""))


def _part(part: str) -> str:
    """Whose context a file's `part` ("rank/ranks"; "" for one process) is, in words."""
    if not part:
        return "a one-process server's context"
    rank, _, ranks = part.partition("/")
    return f"tensor-parallel rank {rank} of {ranks}'s part"


def check_fields(data: SlotData, k_like: dict[str, torch.Tensor], v_like: dict[str, torch.Tensor]) -> None:
    """The file's K/V fields have the cache's names, dtypes and shapes (but for the position count)."""
    for got, like in ((data.k, k_like), (data.v, v_like)):
        for name, t in like.items():
            g = got.get(name)
            if g is None or g.dtype != t.dtype or g.shape[:2] != t.shape[:2] or g.shape[3:] != t.shape[3:]:
                raise TurboSpecError("the slot file's K/V layout does not match this server's cache")
        if set(got) != set(like):
            raise TurboSpecError("the slot file's K/V layout does not match this server's cache")
