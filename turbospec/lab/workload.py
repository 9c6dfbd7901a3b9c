"""What a speed measurement runs: its options and the shipped prompt set.

Shared by the local measurement (`turbospec.lab.bench`) and the server measurement (`turbospec.lab.client`),
so neither imports the other.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from turbospec.errors import TurboSpecError

PROMPTS_FILE = Path(__file__).resolve().parent.parent / "data" / "prompts.json"
DEPTH_FILLS = ("prefill", "random")  # how a depth is filled: filler tokens read, or random KV values written


@dataclass(frozen=True)
class BenchOptions:
    """One measurement: prompt / output lengths, repetitions, context depths, sweeps, prompt categories.

    The defaults are the seeds' reproducibility checklist (512-token prompt, 512 generated, temperature 0,
    1 warm-up run discarded, 5 measured repetitions)."""

    n_prompt: int = 512  # random prompt tokens (unused with `categories`)
    n_gen: int = 512  # generated tokens
    repetitions: int = 5  # measured repetitions
    warmup: int = 1  # discarded warm-up runs
    depths: tuple[int, ...] = (0,)  # context filled first (llama-bench -d); servers: that many filler words
    sweep: tuple[str, ...] = ()  # "key=v1,v2" items forming a cartesian product; local runs only
    categories: str | None = None  # the shipped prompt set: "all" or a comma list; None: random tokens
    temp: float = 0.0
    seed: int = 0
    quiet: bool = False  # no progress bar
    interleave: bool = False  # sweep points' repetitions round-robin in one process, paired ratios to the first
    depth_fill: str = "prefill"  # one of DEPTH_FILLS

    def __post_init__(self) -> None:
        for n in ("n_prompt", "n_gen", "repetitions"):
            if getattr(self, n) <= 0:
                raise TurboSpecError(f"--{n.replace('_', '-')} must be positive")
        if self.warmup < 0:
            raise TurboSpecError("--warmup must be >= 0")
        if self.depth_fill not in DEPTH_FILLS:
            raise TurboSpecError(f"--depth-fill must be one of {', '.join(DEPTH_FILLS)}")


def load_prompts(categories: str | None) -> dict[str, str]:
    """The shipped prompts by category: all of them for None or "all", else those of a comma list."""
    data = json.loads(PROMPTS_FILE.read_text())["prompts"]
    if not categories or categories == "all":
        return data
    out = {}
    for c in categories.split(","):
        if c not in data:
            raise TurboSpecError(f"unknown prompt category {c!r} (have: {', '.join(data)})")
        out[c] = data[c]
    return out
