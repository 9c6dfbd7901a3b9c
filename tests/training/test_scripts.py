"""The training area's scripts start as documented (`python -m training.scripts.NAME` from the repository root)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted(p.stem for p in (ROOT / "training" / "scripts").glob("*.py") if p.stem != "__init__")


@pytest.mark.parametrize("name", ["token_counts", "write_card"])
def test_script_runs_as_a_module(name):
    assert name in SCRIPTS
    r = subprocess.run([sys.executable, "-m", f"training.scripts.{name}", "--help"], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "usage:" in r.stdout
