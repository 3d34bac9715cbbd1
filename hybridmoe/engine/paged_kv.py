"""The paged KV cache: per layer, pools of blocks that sequences address through their block tables.

A layer's pools are allocated at its first `update`, from the shapes of what it caches: (k, v) for
standard attention, (compressed kv, rope key) for MLA; the engine never needs to know which.
"""

from __future__ import annotations

import threading

import torch


class PagedKVCache:
    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.pools: dict[int, tuple[torch.Tensor, ...]] = {}  # layer -> flat views [num_blocks * block_size, ...]
        self._lock = threading.Lock()  # two passes (decode, prefill) may meet a layer's first update together

    def layer_pools(self, layer: int, entries: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        pools = self.pools.get(layer)
        if pools is not None:
            return pools
        with self._lock:
            pools = self.pools.get(layer)
            if pools is None:
                pools = tuple(
                    torch.zeros((self.num_blocks, self.block_size, *e.shape[1:]), dtype=e.dtype, device=e.device)
                    .view(self.num_blocks * self.block_size, *e.shape[1:])  # [num_blocks * block_size, ...]
                    for e in entries
                )
                self.pools[layer] = pools
        return pools

    @property
    def bytes(self) -> int:
        return sum(p.numel() * p.element_size() for pools in self.pools.values() for p in pools)


def history_index(block_table: list[int], length: int, block_size: int) -> torch.Tensor | slice:
    """Slots of a sequence's first `length` tokens: a slice when its blocks are consecutive (no copy)."""
    first = block_table[0]
    if block_table[-1] - first == len(block_table) - 1 and block_table == list(range(first, first + len(block_table))):
        return slice(first * block_size, first * block_size + length)
    pos = torch.arange(length)  # [L]
    return torch.tensor(block_table)[pos // block_size] * block_size + pos % block_size


class PagedKVContext:
    """The KVContext of one step: sequence i brings seq_lens[i] new tokens at positions starts[i].."""

    def __init__(self, cache: PagedKVCache, block_tables: list[list[int]], starts: list[int], seq_lens: list[int]):
        self.cache, self.seq_lens, self.starts = cache, seq_lens, starts
        bs = cache.block_size
        self.history = [history_index(t, s + n, bs) for t, s, n in zip(block_tables, starts, seq_lens)]
        writes = []
        for table, start, n in zip(block_tables, starts, seq_lens):
            pos = torch.arange(start, start + n)  # [n]
            writes.append(torch.tensor(table)[pos // bs] * bs + pos % bs)
        self.write = torch.cat(writes)  # [T]: the slot of each new row

    def update(self, layer: int, *entries: torch.Tensor) -> list[tuple[torch.Tensor, ...]]:
        pools = self.cache.layer_pools(layer, entries)
        for pool, e in zip(pools, entries):
            pool.index_copy_(0, self.write, e.to(pool.dtype))
        return [tuple(pool[idx] for pool in pools) for idx in self.history]
