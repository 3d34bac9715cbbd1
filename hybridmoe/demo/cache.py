"""Where the built demo model lives, and building it on first use.

The directory name carries the recipe version and the configuration, so a changed recipe or an
option like `--experts 32` never picks up a stale build.
"""

from __future__ import annotations

import logging
from pathlib import Path

from hybridmoe.demo.build import DEFAULT_SPEC, RECIPE_VERSION, MoESpec, build, is_complete
from hybridmoe.demo.downs import downs_path
from hybridmoe.paths import user_cache_dir

log = logging.getLogger("hybridmoe")

# What the notice promises: the build's measured wall time on 2 cores, alone and with the cores
# shared: applying the shipped fit (docs/benchmarks.md, "First run"), or fitting (a configuration
# whose fit does not ship; "Demo model quality").
SHIPPED_ESTIMATE = "10 to 20 seconds on 2 cores"
FIT_ESTIMATE = "3 to 6 minutes on 2 cores"


def build_estimate(spec: MoESpec = DEFAULT_SPEC) -> str:
    """How long building `spec` takes: seconds where its fit ships, minutes where it does not."""
    return SHIPPED_ESTIMATE if downs_path(spec.tag()).is_file() else FIT_ESTIMATE


def demo_model_path(spec: MoESpec = DEFAULT_SPEC) -> Path:
    """The cache directory of the demo model built with `spec` (it may not exist yet)."""
    return user_cache_dir() / f"demo-smollm2-{spec.tag()}-v{RECIPE_VERSION}"


def ensure_demo_model(spec: MoESpec = DEFAULT_SPEC) -> Path:
    """The path of the built demo model, building it first (with a one-line notice) if needed."""
    path = demo_model_path(spec)
    if not is_complete(path):
        if path.exists():
            log.warning("the demo model in %s is incomplete or corrupt; building it again", path)
        log.warning("building the demo model into %s (once; %s)...", path, build_estimate(spec))
        build(path, spec)
    return path
