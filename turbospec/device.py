"""Which device the engine computes on: `--device cpu|cuda[:N]|auto` (auto: cuda when torch sees a GPU).

`use(name)` makes a device the process's current one: on a GPU, torch's default device (so every tensor the
engine creates lands there) and no C++ CPU kernels (`cpu_kernels()` is False: the kernels' loaders answer None
and the torch paths, with the Triton kernels of turbospec/kernels/triton_*.py where they apply, run instead).
`use("cpu")` puts both back. One device per process at a time: an engine built on one device keeps running there,
but tensors it creates follow the current default.
"""

from __future__ import annotations

import contextlib

import torch

from turbospec.errors import TurboSpecError

_current = torch.device("cpu")


def resolve(name: str | None) -> torch.device:
    """The device `name` means here: auto -> cuda when available, else cpu; a one-line error for an unknown name
    or a GPU torch cannot see."""
    name = (name or "auto").strip().lower()
    if name == "auto":
        return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    try:
        dev = torch.device(name)
    except RuntimeError:
        raise TurboSpecError(f"--device {name!r}: expected cpu, cuda, cuda:N or auto") from None
    if dev.type == "cpu":
        return torch.device("cpu")
    if dev.type != "cuda":
        raise TurboSpecError(f"--device {name!r}: turbospec runs on cpu or cuda")
    if not torch.cuda.is_available():
        raise TurboSpecError(f"--device {name}: torch sees no CUDA GPU here (torch {torch.__version__}); "
                             "use --device cpu")
    if dev.index is not None and dev.index >= torch.cuda.device_count():
        raise TurboSpecError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return dev


def use(name: str | torch.device | None) -> torch.device:
    """Make `name`'s device the current one (torch's default device; the CPU kernels on or off) and return it."""
    global _current
    dev = name if isinstance(name, torch.device) else resolve(name)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    torch.set_default_device(None if dev.type == "cpu" else dev)
    _current = dev
    return dev


def current() -> torch.device:
    """The device `use` chose last (cpu until then)."""
    return _current


def cpu_kernels() -> bool:
    """Whether the C++ CPU kernels may run: only while the current device is the CPU."""
    return _current.type == "cpu"


def on_gpu() -> bool:
    return _current.type == "cuda"


def synchronize() -> None:
    """Wait for the GPU's queued work (before reading a clock); nothing on the CPU."""
    if _current.type == "cuda":
        torch.cuda.synchronize(_current)


def lean():
    """A context for a decode step's hot path on a GPU: torch's default-device hook off (a Python call added to every
    torch call; CHANGELOG, session 28). Code inside passes devices explicitly (tests/test_gpu_syncs.py checks that a
    step creates no tensor without one). A no-op on the CPU."""
    return torch._C.DisableTorchFunction() if _current.type != "cpu" else contextlib.nullcontext()
