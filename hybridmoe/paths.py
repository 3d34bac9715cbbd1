"""Where hybridmoe keeps what it builds once and reuses: demo models, calibrations, native kernels."""

from __future__ import annotations

import os
from pathlib import Path


def user_cache_dir() -> Path:
    """$XDG_CACHE_HOME/hybridmoe, or ~/.cache/hybridmoe."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
    return Path(base) / "hybridmoe"
