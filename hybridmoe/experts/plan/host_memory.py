"""Page-locked host memory the hybrid runtime takes, as a number (no torch): what `hybridmoe plan`
adds to its host-RAM figure and what experts/run/host_staging.py allocates.

Experts stay in ordinary memory; only a ring of `tuning.STAGING_DEPTH` staging buffers of the
largest expert's size, and two buffers of activation rows (the CPU experts' rows up, their outputs
back), are pinned. torch's caching host allocator hands out pinned blocks of a power of two."""

from __future__ import annotations

from hybridmoe import tuning


def pinned_bytes(nbytes: int, pin: bool = True) -> int:
    """What `nbytes` of page-locked memory takes: blocks of a power of two."""
    return 1 << max(int(nbytes) - 1, 0).bit_length() if pin else int(nbytes)


def staging_bytes(largest_expert: float, pin: bool = True) -> int:
    """Host memory the staging ring takes for experts of at most `largest_expert` bytes."""
    return tuning.STAGING_DEPTH * pinned_bytes(largest_expert, pin)


def runtime_pinned_bytes(
    largest_expert: float, hidden: int, tokens: int, top_k: int, act_bytes: int = 2
) -> int:
    """All the pinned memory of a run whose steps take up to `tokens` tokens: the ring, the rows
    going up (at most the step's tokens) and the outputs coming back (at most top_k a token)."""
    row = hidden * act_bytes
    return (
        staging_bytes(largest_expert)
        + pinned_bytes(tokens * row)
        + pinned_bytes(tokens * top_k * row)
    )
