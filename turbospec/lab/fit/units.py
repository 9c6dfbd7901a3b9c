"""Memory sizes: parsing (`24GiB`, `24GB`) and printing."""

from __future__ import annotations

import re

from turbospec.errors import TurboSpecError

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_mem(s: str) -> int:
    """'24GiB', '24 GB', '512MiB', '1.5g', '1000000' -> bytes (K/M/G/T alone are decimal, as GB)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(s))
    if not m or m.group(2).lower() not in _UNITS:
        raise TurboSpecError(f"cannot parse memory size {s!r} (e.g. 24GiB, 24GB, 512MiB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def fmt_bytes(n: int) -> str:
    if n >= 2**30:
        return f"{n / 2**30:.2f} GiB"
    return f"{n / 2**20:.1f} MiB"


def fmt_ctx(n: int) -> str:
    return str(n)

