"""Imports point one way (shared/DESIGN.md): server -> engine -> models -> layers -> experts, and
sim -> experts. A lower package never imports a higher one, at module level or inside a function."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "hybridmoe"
# What each package must not import: everything above it.
FORBIDDEN = {
    "experts": {"layers", "models", "engine", "server", "sim", "cli", "bench", "demo"},
    "layers": {"models", "engine", "server", "sim", "cli", "bench"},
    "models": {"engine", "server", "sim", "cli", "bench"},
    "engine": {"server", "sim", "cli", "bench"},
    "sim": {"layers", "models", "engine", "server", "cli", "bench"},
}


def imported_packages(path: Path) -> set[str]:
    """The hybridmoe sub-packages that `path` imports (hybridmoe.X... -> X)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        for name in names:
            parts = name.split(".")
            if parts[0] == "hybridmoe" and len(parts) > 1:
                found.add(parts[1])
    return found


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_no_package_imports_one_above_it(package):
    wrong = {}
    for path in sorted((PACKAGE / package).rglob("*.py")):
        bad = imported_packages(path) & FORBIDDEN[package]
        if bad:
            wrong[str(path.relative_to(PACKAGE))] = sorted(bad)
    assert not wrong, f"imports pointing upward: {wrong}"
