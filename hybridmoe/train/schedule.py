"""The learning rate over a run: a linear warm-up, then a cosine down to 0 (the shape of
transformers' get_cosine_schedule_with_warmup, whose first step has rate 0; here it has
1 / (warmup + 1) of the peak, so that no step is wasted)."""

from __future__ import annotations

import math


def cosine_with_warmup(step: int, total: int, warmup: int) -> float:
    """The multiplier of the peak rate for optimizer step `step` (0-based) of `total`."""
    if step < warmup:
        return (step + 1) / (warmup + 1)
    progress = (step - warmup) / max(1, total - warmup)
    return 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))
