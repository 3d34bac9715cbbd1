"""The thread that writes blocks to the tiers, so that no step waits for an encoding or a disk.

The engine hands it a block (its tensors, already copied out of the pool, or bytes read from a
lower tier to promote) and goes on. The queue is bounded: when the tiers cannot keep up, new blocks
are dropped and counted; they are computed again if they are asked for.
"""

from __future__ import annotations

import logging
import queue
import threading

from hybridmoe.engine.prefix_cache.codec import Block, encode
from hybridmoe.engine.prefix_cache.tier import Tier

log = logging.getLogger("hybridmoe.prefix_cache")


class WriteBack:
    def __init__(self, capacity: int):
        self.dropped = 0
        self._queue: queue.Queue = queue.Queue(maxsize=capacity)
        self._thread = threading.Thread(target=self._run, name="hybridmoe-kv-write", daemon=True)
        self._thread.start()

    @property
    def pending(self) -> int:
        return self._queue.qsize()

    def submit(self, key: bytes, block: Block | bytes, tiers: list[Tier]) -> None:
        if not tiers:
            return
        try:
            self._queue.put_nowait((key, block, tiers))
        except queue.Full:
            self.dropped += 1

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            try:
                if job is None:
                    return
                self._write(*job)
            finally:
                self._queue.task_done()

    def _write(self, key: bytes, block: Block | bytes, tiers: list[Tier]) -> None:
        data = block if isinstance(block, (bytes, bytearray)) else encode(key, block)
        for tier in tiers:
            try:
                tier.put(key, data)
            except Exception as e:  # a full disk, a lost connection: the block stays uncached
                tier.stats.errors += 1
                log.warning("prefix cache: cannot write a block to the %s tier: %s", tier.name, e)

    def flush(self) -> None:
        """Wait until every block handed over so far is written."""
        self._queue.join()

    def close(self, timeout: float = 30.0) -> None:
        """Write what is queued (for at most `timeout` seconds), then stop the thread."""
        self._queue.put(None)
        self._thread.join(timeout)
