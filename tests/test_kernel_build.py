"""The first-run kernel build says so, once, before compiling; a cached load says nothing (no compiler runs here:
torch's `load` is replaced)."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from turbospec.kernels import gemv

SRC = Path(gemv.__file__).with_name("encode.cpp")
FLAGS = ["-O3", "-mavx2", "-DTURBOSPEC_SIMD=abc"]


def cached(build: Path, name: str, flags=FLAGS) -> None:
    """A build folder as torch leaves it after building `name` from SRC with `flags`."""
    build.mkdir(parents=True, exist_ok=True)
    (build / "build.ninja").write_text(f"cflags = {' '.join(flags)}\nbuild x.o: compile {SRC}\n")
    lib = build / f"{name}.so"
    lib.write_bytes(b"")
    newest = max(f.stat().st_mtime for f in gemv.local_includes(SRC))
    os.utime(lib, (newest + 10, newest + 10))


def test_needs_build(tmp_path):
    assert gemv.needs_build(tmp_path / "empty", "m", SRC, FLAGS)
    cached(tmp_path / "ok", "m")
    assert not gemv.needs_build(tmp_path / "ok", "m", SRC, FLAGS)
    assert gemv.needs_build(tmp_path / "ok", "m", SRC, [*FLAGS, "-DTURBOSPEC_DEPS=new"])  # flags changed
    assert gemv.needs_build(tmp_path / "ok", "other", SRC, FLAGS)  # no library of that name
    os.utime(tmp_path / "ok" / "m.so", (0, 0))
    assert gemv.needs_build(tmp_path / "ok", "m", SRC, FLAGS)  # a source newer than the library
    gemv_cpp = SRC.with_name("gemv.cpp")
    assert {f.name for f in gemv.local_includes(gemv_cpp)} >= {"gemv.cpp", "simd.h", "attention.cpp", "quant.cpp"}


@pytest.fixture
def fake_torch_build(tmp_path, monkeypatch):
    """load_extension with torch's build folder under tmp_path and its `load` a stub; the names loaded."""
    from torch.utils import cpp_extension

    loaded: list[str] = []
    monkeypatch.setattr(cpp_extension, "_get_build_directory", lambda name, verbose: str(tmp_path / name))
    monkeypatch.setattr(cpp_extension, "load", lambda name, **kw: loaded.append(name) or object())
    monkeypatch.setattr(gemv, "cpu_has_avx2", lambda: True)
    monkeypatch.setattr(gemv, "_announced", threading.Event())
    monkeypatch.setattr(gemv.sys, "platform", "linux")
    monkeypatch.delenv("TURBOSPEC_NO_KERNEL", raising=False)
    return loaded


def test_build_message_once(fake_torch_build, capsys):
    load = gemv._load_extension.__wrapped__  # past the per-process cache
    for name in ("ts_test_a", "ts_test_b"):  # nothing cached: two builds, one message
        assert load(name, "encode.cpp", "test") is not None
    assert fake_torch_build == ["ts_test_a", "ts_test_b"]
    assert capsys.readouterr().err.count(gemv.BUILD_MESSAGE) == 1


def test_no_message_when_cached(fake_torch_build, tmp_path, capsys, monkeypatch):
    import hashlib

    simd = hashlib.sha1(SRC.with_name("simd.h").read_bytes()).hexdigest()[:16]
    flags = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", f"-DTURBOSPEC_SIMD={simd}", "-DX=1"]
    cached(tmp_path / "ts_test_c", "ts_test_c", flags)
    monkeypatch.setattr(gemv, "BUILD_NOTICE_AFTER_S", 60.0)
    assert gemv._load_extension.__wrapped__("ts_test_c", "encode.cpp", "test", ("-DX=1",)) is not None
    assert gemv.BUILD_MESSAGE not in capsys.readouterr().err


def test_a_killed_builds_lock_is_dropped(tmp_path, capsys):
    """torch waits forever on the lock of a build whose process was killed (Ctrl-C on the first run): the lock goes
    when the process that took it is gone, stays while it runs or when the owner cannot be told (then only its age
    counts)."""
    import subprocess
    import sys

    lock, owner = tmp_path / "lock", tmp_path / "turbospec.pid"
    gemv._drop_stale_lock(lock)  # no lock: this process is about to take it
    assert owner.read_text() == str(os.getpid())
    lock.touch()
    gemv._drop_stale_lock(lock)  # taken by a live process (this one): kept
    assert lock.exists()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    owner.write_text(dead.stdout.strip())
    gemv._drop_stale_lock(lock)
    assert not lock.exists() and "removed a stale kernel build lock" in capsys.readouterr().err
    assert owner.read_text() == str(os.getpid())
    lock.touch()
    owner.write_text("not a pid")
    gemv._drop_stale_lock(lock)  # owner unknown, lock fresh: kept
    assert lock.exists()
    os.utime(lock, (0, 0))
    gemv._drop_stale_lock(lock)  # ... but not once older than any build
    assert not lock.exists()
