"""Real routing traces for the tests: they lie in `shared/traces/` beside the repository (data the
project uses but does not ship), found from the repository root, never through an absolute path."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def shared_trace(name: str) -> Path:
    """The path of `name` in the nearest `shared/traces/` beside the repository root or above it."""
    for parent in ROOT.parents:
        path = parent / "shared" / "traces" / name
        if path.is_file():
            return path
    pytest.fail(
        f"{name} is not in any shared/traces/ beside {ROOT}; the tests need the shared routing "
        "traces"
    )
