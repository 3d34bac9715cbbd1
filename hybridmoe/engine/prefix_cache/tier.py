"""What every tier below the device pool is: a store of encoded blocks (codec.py) by key.

The tiers hold bytes and know nothing of tensors; the hierarchy (tiered_cache.py) decodes and
verifies what they return, and tells a tier (`reject`) when a block it gave was bad.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol


@dataclass
class TierStats:
    """Counters of one tier, read by /metrics from another thread (plain numbers, no lock)."""

    hits: int = 0  # blocks found and loaded
    misses: int = 0  # lookups that ended at this tier: the next block was not there
    bytes_read: int = 0
    load_s: float = 0.0  # time spent reading (and verifying) blocks from this tier
    writes: int = 0  # blocks stored
    bytes_written: int = 0
    errors: int = 0  # failed reads or writes: I/O errors, corrupt blocks, remote failures
    timeouts: int = 0  # remote calls abandoned after the timeout


class Tier(Protocol):
    name: str  # "ram", "disk", "remote": the metrics' names
    stats: TierStats

    def get_prefix(self, keys: list[bytes]) -> Iterable[bytes]:
        """The stored bytes of the leading `keys` this tier has, stopping at the first it lacks
        (a list, or an iterator that fetches as it is read)."""
        ...

    def put(self, key: bytes, data: bytes) -> None:
        """Store `data` as `key` (a no-op if it is there); may evict other blocks."""
        ...

    def reject(self, key: bytes, why: str) -> None:
        """The block `key` this tier returned failed verification: drop it, say so."""
        ...

    def close(self) -> None: ...
