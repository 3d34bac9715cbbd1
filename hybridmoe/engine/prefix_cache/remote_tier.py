"""A shared store several servers read and write: Mooncake Store or Redis/Valkey (a `KVStore`).

A remote tier may be down or slow; a request must then be computed, never fail. So every call runs
on a thread of this tier's own and is waited for at most `timeout` seconds; a call that fails or
times out counts in the metrics, and the tier is skipped for `tuning.REMOTE_BACKOFF_S` seconds
before it is tried again (a hung store would otherwise cost every request the timeout).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Protocol

from hybridmoe import tuning
from hybridmoe.engine.prefix_cache.tier import TierStats

log = logging.getLogger("hybridmoe.prefix_cache")

PREFIX = "hybridmoe:kv:"


class KVStore(Protocol):
    """The little a remote tier needs of a key-value store."""

    def get_many(self, keys: list[str]) -> list[bytes | None]: ...

    def put(self, key: str, data: bytes) -> None:  # a no-op if the key exists
        ...

    def close(self) -> None: ...


class RemoteTier:
    name = "remote"

    def __init__(self, store: KVStore, timeout: float, url: str):
        self.store, self.timeout, self.url = store, timeout, url
        self.stats = TierStats()
        self._down_until = 0.0
        self._reads = ThreadPoolExecutor(1, "hybridmoe-remote-read")
        self._writes = ThreadPoolExecutor(1, "hybridmoe-remote-write")

    def _call(self, pool: ThreadPoolExecutor, fn, *args):
        """(True, fn(*args)) run on `pool` and waited for at most the timeout; (False, None) after a
        failure, or while the store is taken for down."""
        if time.monotonic() < self._down_until:
            return False, None
        try:
            return True, pool.submit(fn, *args).result(timeout=self.timeout)
        except FutureTimeout:
            self.stats.timeouts += 1
            why = f"no answer in {self.timeout:g} s"
        except Exception as e:  # the store's own errors: connection refused, reset, full...
            self.stats.errors += 1
            why = str(e) or type(e).__name__
        log.warning(
            "prefix cache: remote %s: %s; computing without it for %g s",
            self.url,
            why,
            tuning.REMOTE_BACKOFF_S,
        )
        self._down_until = time.monotonic() + tuning.REMOTE_BACKOFF_S
        return False, None

    def get_prefix(self, keys: list[bytes]) -> list[bytes]:
        _, values = self._call(self._reads, self.store.get_many, [PREFIX + k.hex() for k in keys])
        found = []
        for value in values or ():
            if not value:
                break
            found.append(value)
        return found

    def put(self, key: bytes, data: bytes) -> None:
        ok, _ = self._call(self._writes, self.store.put, PREFIX + key.hex(), data)
        if ok:
            self.stats.writes += 1
            self.stats.bytes_written += len(data)

    def reject(self, key: bytes, why: str) -> None:
        # Not deleted: another server may be writing it; it is refused again on every read.
        log.warning("prefix cache: remote block %s skipped: %s", key.hex(), why)
        self.stats.errors += 1

    def close(self) -> None:
        for pool in (self._reads, self._writes):
            pool.shutdown(wait=False, cancel_futures=True)
        try:
            self.store.close()
        except Exception:  # closing a store that is down: nothing left to do
            pass
