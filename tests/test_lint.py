"""The house style is checked, not hoped for: ruff's lint rules and its formatter at 100 columns
(pyproject.toml [tool.ruff]) pass on the whole tree."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def ruff(*args: str) -> subprocess.CompletedProcess:
    exe = shutil.which("ruff") or sys.executable
    cmd = [exe, *args] if exe != sys.executable else [exe, "-m", "ruff", *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_ruff_finds_nothing():
    done = ruff("check", "hybridmoe", "tests")
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_tree_is_formatted():
    done = ruff("format", "--check", "hybridmoe", "tests")
    assert done.returncode == 0, done.stdout + done.stderr
