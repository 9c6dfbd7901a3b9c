"""`--tp N`: a command split over N processes on this host, launched through `torchrun` (torch.distributed.run)
as if the user had typed it, so that the ranks are the same processes a `torchrun` launch starts."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from turbospec.errors import TurboSpecError


def tensor_parallel(ranks: int, argv: list[str], threads: int | None) -> int | None:
    """Run `turbospec ARGV` as `ranks` ranks under torchrun and return its exit status, or None when this process
    already is one of the ranks (torchrun's WORLD_SIZE set: then it must equal `ranks`). Each rank runs `threads`
    threads (-t), by default this machine's cores split evenly. Ctrl-C reaches every rank (they share the
    terminal's process group); this process waits for them to end."""
    if ranks < 1:
        raise TurboSpecError(f"--tp must be >= 1, got {ranks}")
    world = os.environ.get("WORLD_SIZE")
    if world is not None:
        if int(world) != ranks:
            raise TurboSpecError(f"--tp {ranks} under torchrun with {world} processes: give one or the other")
        return None
    if ranks == 1:
        return None
    per_rank = threads or max(1, (os.cpu_count() or 1) // ranks)
    # --standalone: torchrun binds its rendezvous store to a port of the system's choosing while it holds it (a port
    # picked here and released could be taken before torchrun binds it)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks), "-m",
           "turbospec.cli", *argv]
    if threads is None:
        cmd += ["-t", str(per_rank)]
    env = {**os.environ, "OMP_NUM_THREADS": str(per_rank)}
    proc = subprocess.Popen(cmd, env=env)
    while True:
        try:
            return proc.wait()
        except KeyboardInterrupt:  # the ranks got the same Ctrl-C (one process group): wait for them to end
            if not sys.stdin.isatty():  # not from a terminal (a signal to this process alone): pass it on
                proc.send_signal(signal.SIGINT)
