"""The tiers below the device pool, as the block manager sees them.

    fetch(keys)        the decoded, verified blocks of the longest prefix of `keys` in the tiers
    install(id, block) the block into the device pool
    computed(id, key)  a block of the pool got its key: write it through to disk and remote
    evicted(id, key)   a keyed block of the pool is reused: write it back to RAM

Lookups go tier by tier, fastest first, each taking up where the ones above stopped, and what a
lower tier returns is promoted to the tiers above it. Writes go through the write-back thread.
Blocks reach the persistent tiers when they are computed, not when they are evicted: a server
killed at any moment has already written them, and another replica can use them at once.
"""

from __future__ import annotations

import time

from hybridmoe.engine.paged_kv import PagedKVCache
from hybridmoe.engine.prefix_cache.codec import Block, CorruptBlock, decode
from hybridmoe.engine.prefix_cache.tier import Tier
from hybridmoe.engine.prefix_cache.write_back import WriteBack


class TieredPrefixCache:
    def __init__(
        self, kv: PagedKVCache, ram: Tier | None, persistent: list[Tier], queue_blocks: int
    ):
        self.kv, self.ram, self.persistent = kv, ram, persistent
        self.tiers: list[Tier] = ([ram] if ram is not None else []) + persistent  # fastest first
        self.writer = WriteBack(queue_blocks)

    def fetch(self, keys: list[bytes]) -> list[Block]:
        found: list[Block] = []
        progress = True
        while progress and len(found) < len(keys):
            progress = False
            for i, tier in enumerate(self.tiers):
                got = self._load(tier, keys[len(found) :], self.tiers[:i])
                found += got
                progress = progress or bool(got)
                if len(found) == len(keys):
                    break
        return found

    def _load(self, tier: Tier, keys: list[bytes], above: list[Tier]) -> list[Block]:
        """The leading blocks of `keys` that `tier` has, verified; promoted to the tiers `above`."""
        t0 = time.perf_counter()
        blocks = []
        for key, data in zip(keys, tier.get_prefix(keys)):
            try:
                blocks.append(decode(data, key))
            except CorruptBlock as e:
                tier.reject(key, str(e))
                break
            tier.stats.bytes_read += len(data)
            self.writer.submit(key, data, above)
        tier.stats.hits += len(blocks)
        tier.stats.misses += len(blocks) < len(keys)
        tier.stats.load_s += time.perf_counter() - t0
        return blocks

    def install(self, block_id: int, block: Block) -> bool:
        return self.kv.write_block(block_id, block)

    def computed(self, block_id: int, key: bytes) -> None:
        if self.persistent:
            self.writer.submit(key, self.kv.read_block(block_id), self.persistent)

    def evicted(self, block_id: int, key: bytes) -> None:
        if self.ram is not None:
            self.writer.submit(key, self.kv.read_block(block_id), [self.ram])

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
        for tier in self.tiers:
            tier.close()
