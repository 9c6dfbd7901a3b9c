"""Progress bars for the long commands (load, long prefills, bench sweeps, quality runs, export): tqdm on stderr,
drawn only on a terminal and never with --quiet, so that piped output and logs stay clean.

`progress(total, desc, quiet)` is the bar; `Progress` is a `(done, total)` callback drawing one, which is how the
layers below report (model loading, `Engine.prefill`, `export_gguf`): they take a callback and know nothing of
bars.
"""

from __future__ import annotations

import sys
from typing import Any

from tqdm import tqdm

LOAD_DELAY_S = 2.0  # a model load shows its bar only when it lasts longer than this
LONG_PROMPT = 4096  # `turbospec run` shows a prefill bar for prompts of at least this many tokens


def interactive(stream: Any = None) -> bool:
    """Whether `stream` (default: stderr) is a terminal."""
    stream = sys.stderr if stream is None else stream
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):  # replaced by an object without isatty, or closed
        return False


def progress(total: int | float | None = None, desc: str = "", quiet: bool = False, **kw: Any) -> tqdm:
    """A tqdm bar on stderr, disabled when `quiet` or when stderr is not a terminal (piped, a log, a test).
    `kw` goes to tqdm (unit, leave, delay, ...)."""
    kw.setdefault("dynamic_ncols", True)
    return tqdm(total=total, desc=desc, file=sys.stderr, disable=quiet or not interactive(), **kw)


class Progress:
    """A `(done, total)` callback drawing a bar (see `progress`): opened by the first call whose total is at
    least `min_total` (smaller jobs draw nothing), closed when done reaches total, by `close()` or on leaving a
    `with` block."""

    def __init__(self, desc: str, quiet: bool = False, min_total: int = 0, **kw: Any):
        self.desc, self.quiet, self.min_total, self.kw = desc, quiet, min_total, kw
        self.bar: tqdm | None = None

    def __call__(self, done: int, total: int) -> None:
        if self.bar is None:
            if total < self.min_total or self.quiet or not interactive():
                return
            self.bar = progress(total, self.desc, **self.kw)
        if self.bar.total != total:
            self.bar.total = total
        self.bar.update(done - self.bar.n)
        if done >= total:
            self.close()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def loading(quiet: bool = False) -> Progress:
    """The model-load bar: tensors read, shown only when the load lasts over `LOAD_DELAY_S`."""
    return Progress("loading", quiet, unit=" tensors", delay=LOAD_DELAY_S, leave=False)
