"""The README's Python example runs as written, on the bundled model, and its stats line says what it claims."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def readme_example() -> str:
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    found = [b for b in blocks if "build_engine" in b]
    assert found, "README.md has no Python example using build_engine"
    return found[0]


@pytest.mark.skipif(not (ROOT / "models" / "turbospec-tiny" / "config.json").exists(), reason="no bundled model")
def test_readme_python_example_runs(monkeypatch):
    monkeypatch.chdir(ROOT)  # the example names the bundled model by its path in the repository
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(readme_example(), "README.md", "exec"), {})
    text = out.getvalue()
    assert "decode" in text and "t/s" in text and "ttft" in text
    assert "spec:" in text  # the example turns MTP drafting on, and the stats line reports its acceptance
