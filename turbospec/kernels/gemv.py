"""Build (once, cached) and load the AVX2 skinny-GEMM kernel; None when it cannot be built here."""

from __future__ import annotations

import hashlib
import os
import re
import sys
import threading
import time
from functools import cache
from pathlib import Path

from turbospec import device, env


def cpu_has_avx2() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return all(f" {f}" in flags for f in ("avx2", "fma", "f16c"))


def load_extension(name: str, source: str, what: str, cflags: tuple[str, ...] = ()):
    """Build (once per machine, cached by torch) and load the C++ extension `name` from `source` in this
    folder; None when it cannot be built here (no AVX2, no compiler, TURBOSPEC_NO_KERNEL=1) or the engine runs
    on a GPU (turbospec.device)."""
    return _load_extension(name, source, what, cflags) if device.cpu_kernels() else None


@cache
def _load_extension(name: str, source: str, what: str, cflags: tuple[str, ...] = ()):
    if env.on("TURBOSPEC_NO_KERNEL") or not sys.platform.startswith("linux") or not cpu_has_avx2():
        return None
    try:
        from torch.utils.cpp_extension import _get_build_directory, load

        src = Path(__file__).with_name(source)
        build = Path(_get_build_directory(name, False))
        _drop_stale_lock(build / "lock")
        # torch rebuilds when the source or the flags change, not when a header does: hash the shared header in
        simd = hashlib.sha1(src.with_name("simd.h").read_bytes()).hexdigest()[:16]
        flags = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", f"-DTURBOSPEC_SIMD={simd}", *cflags]
        # say so before a build (nothing cached, or stale); a build the check missed is announced once it runs long
        slow = threading.Timer(BUILD_NOTICE_AFTER_S, announce_build)
        slow.daemon = True
        if needs_build(build, name, src, flags):
            announce_build()
        else:
            slow.start()
        try:
            return load(name=name, sources=[str(src)], verbose=False, extra_cflags=flags,
                        extra_ldflags=["-fopenmp"])
        finally:
            slow.cancel()
    except Exception as e:  # noqa: BLE001 -- no compiler or headers: fall back to torch's kernels
        print(f"turbospec: {what} kernel unavailable ({' '.join(str(e).split())[:120]}); "
              "using torch kernels", file=sys.stderr)
        return None


BUILD_MESSAGE = "turbospec: building the C++ kernels for this machine (first run only, about a minute)\u2026"
BUILD_NOTICE_AFTER_S = 3.0  # a cached load takes well under a second
_announced = threading.Event()


def announce_build() -> None:
    """Print `BUILD_MESSAGE` to stderr, once per process (several kernels may build one after another)."""
    if not _announced.is_set():
        _announced.set()
        print(BUILD_MESSAGE, file=sys.stderr, flush=True)


def local_includes(src: Path) -> list[Path]:
    """`src` and the files of this folder it #includes ("..."), recursively."""
    seen: list[Path] = []
    todo = [src]
    while todo:
        f = todo.pop()
        if f in seen or not f.exists():
            continue
        seen.append(f)
        todo += [f.with_name(m) for m in re.findall(r'^\s*#\s*include\s+"([^"]+)"', f.read_text(), re.M)]
    return seen


def needs_build(build: Path, name: str, src: Path, flags: list[str]) -> bool:
    """Whether loading `name` will compile: no library in torch's build folder `build`, a build file without
    these sources or flags (torch rewrites it, ninja then rebuilds), or a source or included file newer than the
    library (ninja rebuilds on times)."""
    lib, ninja = build / f"{name}.so", build / "build.ninja"
    try:
        built = lib.stat().st_mtime
        text = ninja.read_text()
    except OSError:
        return True
    if str(src) not in text or any(f not in text for f in flags):
        return True
    return any(f.stat().st_mtime > built for f in local_includes(src))


STALE_LOCK_S = 600  # a build takes about a minute; an older lock was left by a killed build


def _drop_stale_lock(lock: Path) -> None:
    """torch waits forever on a build lock left behind by a process killed while compiling (a Ctrl-C during the
    first run's build): remove it when the process that took it (`owner`, beside the lock: the last one to find no
    lock) is gone, or when it is older than any real build. Finding no lock, this process is about to take it."""
    owner = lock.with_name("turbospec.pid")
    try:
        if lock.exists() and (not _alive(owner) or time.time() - lock.stat().st_mtime > STALE_LOCK_S):
            lock.unlink()
            print(f"turbospec: removed a stale kernel build lock ({lock})", file=sys.stderr)
        if not lock.exists():
            owner.parent.mkdir(parents=True, exist_ok=True)
            owner.write_text(str(os.getpid()))
    except OSError:
        pass


def _alive(owner: Path) -> bool:
    """Whether the process whose id `owner` holds is running (True when it cannot be told: then only the lock's
    age decides)."""
    try:
        pid = int(owner.read_text())
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (OSError, ValueError):
        return True
    return True


def load_kernel():
    """The skinny-GEMM / fused-layer module, or None. gemv.cpp includes attention.cpp, deltanet.cpp and quant.cpp: their hash
    goes into the build flags, so that torch rebuilds the module when any of the files changes. Cached: callers (RMSNorm, every
    `Linear`) ask per call."""
    return _load_kernel() if device.cpu_kernels() else None


def host_kernel():
    """The same module whatever the current device, for work on CPU tensors (quantizing weights as they load for a
    GPU), or None."""
    return _load_kernel()


@cache
def _load_kernel():
    here = Path(__file__).parent
    deps = hashlib.sha1(b"".join((here / f).read_bytes() for f in ("attention.cpp", "deltanet.cpp", "quant.cpp", "bf16dot.cpp", "encode.cpp"))).hexdigest()[:16]
    return _load_extension("turbospec_gemv", "gemv.cpp", "skinny-GEMM", (f"-DTURBOSPEC_DEPS={deps}",))
