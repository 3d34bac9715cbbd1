"""Where the built demo model lives, and building it on first use.

The directory name carries the recipe version and the configuration, so a changed recipe or an
option like `--experts 32` never picks up a stale build.
"""

from __future__ import annotations

import logging
from pathlib import Path

from hybridmoe.demo.build import DEFAULT_SPEC, RECIPE_VERSION, MoESpec, build, is_complete
from hybridmoe.paths import user_cache_dir

log = logging.getLogger("hybridmoe")


def demo_model_path(spec: MoESpec = DEFAULT_SPEC) -> Path:
    """The cache directory of the demo model built with `spec` (it may not exist yet)."""
    return user_cache_dir() / f"demo-smollm2-{spec.tag()}-v{RECIPE_VERSION}"


def ensure_demo_model(spec: MoESpec = DEFAULT_SPEC) -> Path:
    """The path of the built demo model, building it first (with a one-line notice) if needed."""
    path = demo_model_path(spec)
    if not is_complete(path):
        log.warning("building the demo model into %s (once; a few minutes)...", path)
        build(path, spec)
    return path
