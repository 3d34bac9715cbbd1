"""Running `python -m hybridmoe ...` as a user runs it: a process of its own, from the repo root."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def hybridmoe(
    *args: str, input: str | None = None, timeout: int = 300
) -> subprocess.CompletedProcess:
    """The console command with `args`; its exit code, stdout and stderr as text."""
    return subprocess.run(
        [sys.executable, "-m", "hybridmoe", *map(str, args)],
        input=input,
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=timeout,
    )
