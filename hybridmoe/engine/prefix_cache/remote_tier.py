"""A shared store several servers read and write: Mooncake Store or Redis/Valkey (a `KVStore`).

A remote tier may be down or slow; a request must then be computed, never fail. So every call runs
on a thread of this tier's own and is waited for at most `timeout` seconds; a call that fails or
times out counts in the metrics, and the tier is skipped for `tuning.REMOTE_BACKOFF_S` seconds
before it is tried again (a hung store would otherwise cost every request the timeout).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
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

    def _submit(self, pool: ThreadPoolExecutor, fn, *args) -> Future | None:
        """fn(*args) started on `pool`; None while the store is taken for down."""
        return None if time.monotonic() < self._down_until else pool.submit(fn, *args)

    def _wait(self, future: Future | None) -> tuple[bool, object]:
        """(True, its result) within the timeout; (False, None) after a failure, counted, and the
        store is then left alone for the back-off."""
        if future is None:
            return False, None
        try:
            return True, future.result(timeout=self.timeout)
        except (FutureTimeout, TimeoutError):  # the wait's, or the store's own (one in 3.11+)
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

    def get_prefix(self, keys: list[bytes]) -> Iterator[bytes]:
        """Batches of keys asked one ahead: the caller verifies a batch while the next one comes."""
        step = tuning.REMOTE_BATCH_BLOCKS
        batches = [
            [PREFIX + k.hex() for k in keys[i : i + step]] for i in range(0, len(keys), step)
        ]
        pending = self._submit(self._reads, self.store.get_many, batches[0]) if batches else None
        for i in range(len(batches)):
            ok, values = self._wait(pending)
            whole = ok and all(values)
            more = whole and i + 1 < len(batches)
            pending = (
                self._submit(self._reads, self.store.get_many, batches[i + 1]) if more else None
            )
            for value in values or ():
                if not value:
                    return
                yield value
            if not more:
                return

    def put(self, key: bytes, data: bytes) -> None:
        ok, _ = self._wait(self._submit(self._writes, self.store.put, PREFIX + key.hex(), data))
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
