"""Batch invariance: whether a pass computes every token row the way it would be computed alone.

With it on (EngineConfig.deterministic, set around each forward by engine/model_runner.py), the
kernels that a row's neighbours would otherwise choose are fixed: every bf16 projection and expert
takes the native row kernel whatever the row count (layers/linear.py, experts/run/ffn.py), and
every query token's attention is the decode kernel's over its own history (engine/paged_kv.py).
Each of these reduces a row in one fixed order, so greedy output no longer depends on batch
composition, prefill chunking or prefix-cache hits. What it costs, and which paths it does not
cover: docs/serving.md, "Reproducible output".

A thread-local: the decode and prefill passes of `overlap_prefill` run on two threads at once.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

_state = threading.local()


def active() -> bool:
    return getattr(_state, "on", False)


@contextmanager
def rows_alone(on: bool = True) -> Iterator[None]:
    """Within it, on this thread, compute every row as if it were alone (if `on`)."""
    before = active()
    _state.on = on
    try:
        yield
    finally:
        _state.on = before
