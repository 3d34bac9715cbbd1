"""Where hybridmoe keeps what it builds once and reuses: demo models, calibrations,
native kernels."""

from __future__ import annotations

from pathlib import Path

from hybridmoe import env


def user_cache_dir() -> Path:
    """$XDG_CACHE_HOME/hybridmoe, or ~/.cache/hybridmoe."""
    return env.cache_home() / "hybridmoe"
