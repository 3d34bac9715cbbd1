"""Host RAM: encoded blocks in a dict, least recently used evicted past the byte budget."""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict

from hybridmoe.engine.prefix_cache.tier import TierStats

log = logging.getLogger("hybridmoe.prefix_cache")


class RamTier:
    name = "ram"

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.stats = TierStats()
        self.used = 0
        self._blocks: OrderedDict[bytes, bytes] = OrderedDict()  # least recently used first
        self._lock = threading.Lock()  # the engine reads, the write-back thread writes

    def get_prefix(self, keys: list[bytes]) -> list[bytes]:
        found = []
        with self._lock:
            for key in keys:
                data = self._blocks.get(key)
                if data is None:
                    break
                self._blocks.move_to_end(key)
                found.append(data)
        return found

    def put(self, key: bytes, data: bytes) -> None:
        if len(data) > self.capacity:
            return
        with self._lock:
            if key in self._blocks:
                self._blocks.move_to_end(key)
                return
            self._blocks[key] = data
            self.used += len(data)
            while self.used > self.capacity:
                _, old = self._blocks.popitem(last=False)
                self.used -= len(old)
        self.stats.writes += 1
        self.stats.bytes_written += len(data)

    def reject(self, key: bytes, why: str) -> None:
        log.warning("prefix cache: dropping RAM block %s: %s", key.hex(), why)
        with self._lock:
            data = self._blocks.pop(key, None)
            self.used -= len(data) if data else 0

    def __len__(self) -> int:
        return len(self._blocks)

    def close(self) -> None:
        pass
