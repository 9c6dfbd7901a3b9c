"""Reports: the environment every result is tied to, and JSON / CSV / Markdown writers (the plots:
`turbospec.lab.plots`)."""

from __future__ import annotations

import csv
import hashlib
import json
import os
import platform
import statistics
import subprocess
import sys
from functools import lru_cache
from pathlib import Path
from typing import Any


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def model_hash(path: str | Path, limit_bytes: int = 1 << 30) -> str:
    """sha256 over config.json and the weight files (first 1 GiB of each), for identifying the model used. Kept
    per process while the files keep their size and modification time: a sweep or `lab seeds` reports the same
    model many times."""
    p = Path(path)
    if p.is_dir():
        files = sorted([*p.glob("config.json"), *p.glob("*.safetensors"), *p.glob("*.gguf")])
    else:
        files = [p]
    stamps = tuple((str(f), st.st_size, st.st_mtime_ns) for f in files for st in (f.stat(),))
    return _hash_files(stamps, limit_bytes)


@lru_cache(maxsize=64)
def _hash_files(stamps: tuple[tuple[str, int, int], ...], limit_bytes: int) -> str:
    h = hashlib.sha256()
    for path, _, _ in stamps:
        f = Path(path)
        h.update(f.name.encode())
        with open(f, "rb") as fh:
            left = limit_bytes
            while left > 0 and (chunk := fh.read(min(1 << 22, left))):
                h.update(chunk)
                left -= len(chunk)
    return h.hexdigest()[:16]


def env_info(model_path: str | None = None) -> dict[str, Any]:
    import torch

    from turbospec import env
    from turbospec.version import __version__

    info: dict[str, Any] = {
        "cpu": cpu_model(), "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
        "os": platform.platform(), "python": sys.version.split()[0], "torch": torch.__version__,
        "turbospec": __version__, "git_commit": _git_commit(),
        # kernel switches (TURBOSPEC_NO_FUSED, TURBOSPEC_NO_KERNEL, ...) change the measured path
        "turbospec_env": env.all_set(),
    }
    try:
        import psutil

        info["ram_gib"] = round(psutil.virtual_memory().total / 2**30, 1)
    except ImportError:
        pass
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    if model_path:
        info["model"] = str(model_path)
        try:
            info["model_sha256_16"] = model_hash(model_path)
        except OSError:
            info["model_sha256_16"] = None
    return info


@lru_cache(maxsize=1)  # the code this process runs does not change under it
def _git_commit() -> str | None:
    try:
        r = subprocess.run(["git", "rev-parse", "--short", "HEAD"], check=False, capture_output=True,
                           text=True, timeout=5, cwd=Path(__file__).resolve().parent)
        return r.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def summarize(values: list[float]) -> dict[str, float]:
    """median, min, max, mean and sd (as llama-bench reports avg +- sd)."""
    if not values:
        return {"median": 0.0, "min": 0.0, "max": 0.0, "mean": 0.0, "sd": 0.0, "n": 0}
    return {
        "median": statistics.median(values), "min": min(values), "max": max(values),
        "mean": statistics.fmean(values), "sd": statistics.stdev(values) if len(values) > 1 else 0.0,
        "n": len(values),
    }


def write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, default=str))


def write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    if not rows:
        path.write_text("")
        return
    keys: list[str] = []
    for r in rows:
        keys += [k for k in r if k not in keys]
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)


def console_table(title: str, cols: list[str], rows: list[list[str]], styles: list[str] | None = None,
                  right_align: bool = False) -> None:
    """A table on stdout with rich: cells as plain text (a label with [brackets] is not markup), folded rather than
    cut on a narrow terminal, up to 160 columns wide when written to a file or pipe (no COLUMNS set);
    tab-separated text when rich is missing. `styles`: a rich style per row for its last cell; `right_align`: every
    column but the first to the right (numbers)."""
    try:
        from rich.console import Console
        from rich.table import Table
        from rich.text import Text
    except ImportError:
        print(title)
        for line in [cols, *rows]:
            print("\t".join(line))
        return
    t = Table(title=Text(title))
    for i, c in enumerate(cols):
        t.add_column(Text(c), overflow="fold", justify="right" if right_align and i else "left")
    for i, line in enumerate(rows):
        t.add_row(*(Text(cell) for cell in line[:-1]), Text(line[-1], style=styles[i] if styles else ""))
    console = Console(stderr=False)
    if not console.is_terminal and "COLUMNS" not in os.environ:
        console = Console(stderr=False, width=160)
    console.print(t)


def markdown_header(title: str, report: dict[str, Any]) -> list[str]:
    """A report.md's opening lines: the title, the environment as a list, the settings as JSON."""
    md = [f"# {title}", "", "## Environment", ""]
    md += [f"- {k}: {v}" for k, v in report["env"].items()]
    return md + ["", "## Settings", "", "```", json.dumps(report["settings"], indent=1, default=str), "```", ""]


def markdown_table(rows: list[dict[str, Any]], cols: list[str]) -> str:
    def fmt(v: Any) -> str:
        if isinstance(v, float):
            if v == 0 or 0.1 <= abs(v) < 1000:
                return f"{v:.2f}"
            return f"{v:.3g}" if abs(v) < 0.1 else f"{v:.0f}"
        return str(v)

    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    out += ["| " + " | ".join(fmt(r.get(c, "")) for c in cols) + " |" for r in rows]
    return "\n".join(out)

