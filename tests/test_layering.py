"""The package's layers only point down, and no two modules import each other (directly or in a circle).

Every import in turbospec/ counts, also those inside functions: a lazy import that runs up the layers is the same
design bug as one at the top of the file. The ranks are the diagram in docs/design.md.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "turbospec"

# (module prefix, rank): a module may import only modules of a lower or equal rank; the longest prefix wins
RANKS = {
    "turbospec.errors": 0, "turbospec.env": 0, "turbospec.device": 0, "turbospec.dtypes": 0, "turbospec.version": 0,
    "turbospec.tokens": 0,
    "turbospec.kernels": 1,
    "turbospec.kv": 2, "turbospec.weights": 2,
    "turbospec.config": 3,
    "turbospec.layers": 4, "turbospec.sampling": 4, "turbospec.tokenizer": 4,
    "turbospec.model": 5, "turbospec.demo": 5,
    "turbospec.speculative": 6, "turbospec.parallel": 6,
    "turbospec.engine": 7,
    "turbospec.server": 8, "turbospec.lab": 8,
    "turbospec.cli": 9,
    "turbospec": 10,  # the package's __init__: the public API
}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    """turbospec modules imported anywhere in the file (`from a.b import c` counts a.b.c when that is a module)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            subs = {f"{node.module}.{a.name}" for a in node.names} & MODULES
            out |= subs if subs else {node.module}
    return {m for m in out if m.split(".")[0] in ("turbospec", "training") and (m in MODULES or m.startswith("training"))}


def rank(module: str) -> int:
    best = max((p for p in RANKS if module == p or module.startswith(p + ".")), key=len)
    return RANKS[best]


FILES = {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}
MODULES = set(FILES)
GRAPH = {m: imports(p) - {m} for m, p in FILES.items()}


def test_every_module_has_a_rank():
    assert all(any(m == p or m.startswith(p + ".") for p in RANKS) for m in MODULES)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_point_down(module):
    assert not any(m.startswith("training") for m in GRAPH[module]), "the runtime never imports training/"
    up = sorted(m for m in GRAPH[module] if rank(m) > rank(module))
    assert not up, f"{module} (rank {rank(module)}) imports higher layers: {up}"


def test_no_import_circles():
    # a package's __init__ re-exporting its own modules is not a circle
    def edges(m):
        return {d for d in GRAPH[m] if not (FILES[m].name == "__init__.py" and d.startswith(m + "."))}

    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for d in sorted(edges(m)):
            if state.get(d) == 1:
                raise AssertionError("import circle: " + " -> ".join(stack[stack.index(d):] + [d]))
            if d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(MODULES):
        if m not in state:
            visit(m)
