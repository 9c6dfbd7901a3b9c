"""Measuring the CPU baseline: peak RSS of `turbospec run` subprocesses (the command is run, never
imported)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from turbospec.errors import TurboSpecError

# run in a child process: the packages `turbospec run` has imported before it loads a model, then the kernel
_IMPORT_PROBE = """
import turbospec.engine, turbospec.model, turbospec.tokenizer
from turbospec.kernels.gemv import load_kernel
load_kernel()
for line in open('/proc/self/status'):
    if line.startswith('VmRSS:'):
        print(int(line.split()[1]) * 1024)
"""


def measure_peak_rss(model: str | Path, ctx: int, ubatch: int = 512, prompt_file: str | Path | None = None,
                     extra: list[str] | None = None, n_predict: int = 8) -> int:
    """Peak RSS (bytes) of a `turbospec run` subprocess, from its --json-stats peak_rss_bytes."""
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as td:
        out = Path(td) / "stats.json"
        cmd = [sys.executable, "-m", "turbospec.cli", "run", "-m", str(model), "-c", str(ctx),
               "-ub", str(ubatch), "-n", str(n_predict), "--temp", "0", "--no-echo", "--json-stats", str(out)]
        if prompt_file:
            cmd += ["-f", str(prompt_file)]
        # Through a shell that forks (no exec of the last command): a child exec'd straight from this process
        # inherits this process's RSS high-water mark in ru_maxrss (Linux keeps the pre-exec mm's peak in the
        # signal struct), so `turbospec run` spawned from a process holding 400 MiB would report >= 400 MiB.
        r = subprocess.run(["sh", "-c", '"$@"; exit $?', "sh"] + cmd + list(extra or []), check=False,
                           capture_output=True, text=True)
        if r.returncode != 0:
            raise TurboSpecError(f"turbospec run failed: {r.stderr.strip()[-500:]}")
        return int(json.loads(out.read_text())["peak_rss_bytes"])


def measure_runtime_overhead() -> tuple[int, int]:
    """(RSS after imports, peak RSS of `turbospec run` on a minimal model) of this machine, in bytes."""
    import subprocess
    import tempfile

    from turbospec.demo import make_demo_model

    r = subprocess.run([sys.executable, "-c", _IMPORT_PROBE], check=False, capture_output=True, text=True)
    if r.returncode != 0 or not r.stdout.strip():
        raise TurboSpecError(f"cannot measure the import baseline: {r.stderr.strip()[-300:]}")
    imported = int(r.stdout.split()[-1])
    with tempfile.TemporaryDirectory() as td:
        m = make_demo_model(Path(td) / "m", hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                            num_attention_heads=2, num_key_value_heads=1, head_dim=32, vocab_size=320)
        prompt = Path(td) / "prompt.txt"
        prompt.write_text(("The quick brown fox jumps over the lazy dog. " * 14)[:600])
        peak = measure_peak_rss(m, 1024, prompt_file=prompt)
    return imported, peak

