"""The paged KV cache: per layer, pools of blocks that sequences address through their block tables.

A layer's pools are allocated at its first `update`, from the shapes of what it caches: (k, v) for
standard attention, (compressed kv, rope key) for MLA; the engine never needs to know which.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass

import torch

from hybridmoe.native import huge_pages
from hybridmoe.native.threads import one_torch_thread


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A pool: on the CPU in 2 MB pages (native/huge_pages.py), as the weights, since the decode
    kernel reads its rows scattered by the block tables."""
    if device.type == "cpu":
        return huge_pages.zeros(shape, dtype)
    return torch.zeros(shape, dtype=dtype, device=device)


_SERIALS = itertools.count()


class PagedKVCache:
    """`place` puts a new pool where the model lives (CausalLM.place_tensor: the accelerator's
    memory with the hybrid runtime); pools are made on the device of the entries they hold."""

    def __init__(self, num_blocks: int, block_size: int, place=None):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.serial = next(_SERIALS)  # this cache among all made (a decode plan's key)
        self.place = place or (lambda t: t)
        self.pools: dict[
            int, tuple[torch.Tensor, ...]
        ] = {}  # layer -> flat views [num_blocks * block_size, ...]
        self._lock = (
            threading.Lock()
        )  # two passes (decode, prefill) may meet a layer's first update together

    def layer_pools(
        self, layer: int, entries: tuple[torch.Tensor, ...]
    ) -> tuple[torch.Tensor, ...]:
        pools = self.pools.get(layer)
        if pools is not None:
            return pools
        with self._lock:
            pools = self.pools.get(layer)
            if pools is None:
                rows = self.num_blocks * self.block_size
                pools = tuple(
                    self.place(_zeros((rows, *e.shape[1:]), e.dtype, e.device)) for e in entries
                )  # [num_blocks * block_size, ...] each
                self.pools[layer] = pools
        return pools

    @torch.inference_mode()
    def read_block(self, block_id: int) -> dict[int, tuple[torch.Tensor, ...]]:
        """A copy of block `block_id`'s entries: layer -> ([block_size, ...] per pool)."""
        rows = slice(block_id * self.block_size, (block_id + 1) * self.block_size)
        return {layer: tuple(p[rows].clone() for p in pools) for layer, pools in self.pools.items()}

    @torch.inference_mode()  # the pools are inference tensors, made in the model's forward
    def write_block(self, block_id: int, block: dict[int, tuple[torch.Tensor, ...]]) -> bool:
        """Put `block` (as read_block gives it) in block `block_id`; False, and nothing written, if
        its layers, shapes or dtypes are not this cache's. Before the first pass the pools are
        made from it, as the first pass would make them from its entries."""
        if not self.pools:
            for layer, entries in block.items():
                self.layer_pools(layer, entries)
        pools = dict(self.pools)  # a pass may be making them: then the sets differ, a miss
        if set(pools) != set(block) or any(
            len(pools[layer]) != len(entries)
            or any(
                e.shape != (self.block_size, *p.shape[1:]) or e.dtype != p.dtype
                for p, e in zip(pools[layer], entries)
            )
            for layer, entries in block.items()
        ):
            return False
        rows = slice(block_id * self.block_size, (block_id + 1) * self.block_size)
        for layer, entries in block.items():
            for pool, e in zip(pools[layer], entries):
                pool[rows] = e
        return True

    @property
    def bytes(self) -> int:
        return sum(p.numel() * p.element_size() for pools in self.pools.values() for p in pools)


def history_index(block_table: list[int], length: int, block_size: int) -> torch.Tensor | slice:
    """Slots of a sequence's first `length` tokens: a slice when its blocks are consecutive (no
    copy)."""
    first = block_table[0]
    if block_table[-1] - first == len(block_table) - 1 and block_table == list(
        range(first, first + len(block_table))
    ):
        return slice(first * block_size, first * block_size + length)
    pos = torch.arange(length)  # [L]
    return torch.tensor(block_table)[pos // block_size] * block_size + pos % block_size


@dataclass(frozen=True)
class DecodeTables:
    """The query rows of a step that a kernel attends one at a time, reading their histories
    straight from the pools (native.decode_attention): block tables, not gathered copies. Those of
    the sequences that bring one token each; with `every_token`, every row of every sequence, each
    over its own positions (batch invariance, hybridmoe/invariance.py). int32 tensors [R]."""

    seqs: list[int]  # the indices in the step of the sequences whose rows are all here
    rows: torch.Tensor  # each query's row in the step's [T] rows
    lengths: torch.Tensor  # its history's length, its own position included
    table_starts: torch.Tensor  # where its sequence's table begins in `tables`
    tables: torch.Tensor  # the sequences' block tables, one after another
    block_size: int

    @staticmethod
    def of(
        block_tables: list[list[int]],
        starts: list[int],
        seq_lens: list[int],
        block_size: int,
        every_token: bool = False,
    ) -> DecodeTables:
        seqs, rows, lengths, first, tables, row = [], [], [], [], [], 0
        for i, (table, start, n) in enumerate(zip(block_tables, starts, seq_lens)):
            if n == 1 or every_token:
                seqs.append(i)
                rows += range(row, row + n)
                lengths += range(start + 1, start + n + 1)
                first += [len(tables)] * n
                # the blocks of positions 0..start+n-1
                tables += table[: (start + n - 1 + block_size) // block_size]
            row += n
        r, t = len(rows), len(tables)
        every = torch.tensor(rows + lengths + first + tables, dtype=torch.int32)  # [3R + tables]
        return DecodeTables(
            seqs,
            every[:r],
            every[r : 2 * r],
            every[2 * r : 3 * r],
            every[3 * r : 3 * r + t],
            block_size,
        )


class PagedKVContext:
    """The KVContext of one step: sequence i brings seq_lens[i] new tokens at positions starts[i]..

    Besides `update`, layers may take the paged view: `write` the step's entries, then read the
    one-token sequences (`decode`) through their block tables and the others through `histories`.
    Everything per step is computed here once, not per layer; the context holds no state that a
    layer changes, so a decode pass and a prefill pass may run at once, each with its own
    context."""

    def __init__(
        self,
        cache: PagedKVCache,
        block_tables: list[list[int]],
        starts: list[int],
        seq_lens: list[int],
        every_token: bool = False,
    ):
        """`every_token`: attend every row alone (DecodeTables), as batch invariance needs."""
        self.cache, self.seq_lens, self.starts = cache, seq_lens, starts
        bs = cache.block_size
        # the blocks of each sequence's positions so far, as they are now (history's)
        self.block_tables = [
            t[: (s + n + bs - 1) // bs] for t, s, n in zip(block_tables, starts, seq_lens)
        ]
        slots = [
            table[p // bs] * bs + p % bs
            for table, start, n in zip(block_tables, starts, seq_lens)
            for p in range(start, start + n)
        ]  # a few torch ops fewer a step than in tensors: a decode step's start runs cold
        self.slots = torch.tensor(slots, dtype=torch.int64)  # [T]: the slot of each new row
        self.decode = DecodeTables.of(block_tables, starts, seq_lens, bs, every_token)
        self._history: list | None = None

    @property
    def history(self) -> list[torch.Tensor | slice]:
        """Each sequence's slots of its positions so far (history_index), made when first asked
        for: only the steps that gather histories (prefill chunks) do."""
        if self._history is None:
            bs = self.cache.block_size
            self._history = [
                history_index(table, start + n, bs)
                for table, start, n in zip(self.block_tables, self.starts, self.seq_lens)
            ]
        return self._history

    def write(self, layer: int, *entries: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Append this step's entries ([T, ...] each) to `layer`'s cache; its pools [slots, ...]."""
        pools = self.cache.layer_pools(layer, entries)
        if self.slots.device != pools[0].device:  # the pools live on an accelerator: once a step
            self.slots = self.slots.to(pools[0].device)
        with one_torch_thread(pools[0].is_cpu):
            for pool, e in zip(pools, entries):
                pool.index_copy_(0, self.slots, e.to(pool.dtype))
        return pools

    def pools_of(self, layer: int) -> tuple[torch.Tensor, ...] | None:
        """`layer`'s pools if its first write has made them, else None."""
        return self.cache.pools.get(layer)

    def histories(
        self, pools: tuple[torch.Tensor, ...], seqs=None
    ) -> list[tuple[torch.Tensor, ...]]:
        """Each sequence's history in the pools (of `seqs`, default all): a view when its blocks are
        consecutive, else a gathered copy."""
        seqs = range(len(self.history)) if seqs is None else seqs
        return [tuple(pool[self.history[i]] for pool in pools) for i in seqs]

    def update(self, layer: int, *entries: torch.Tensor) -> list[tuple[torch.Tensor, ...]]:
        return self.histories(self.write(layer, *entries))
