"""Paged KV bookkeeping: a pool of fixed-size blocks, a block table per sequence, and a prefix
cache.

Plain Python over ids. A block holds `block_size` consecutive tokens of one sequence. Once a block
is full and its entries are computed, it gets a key: a hash of (key of the previous block, its
tokens) whose chain starts from the model's namespace (prefix_cache/identity.py), so equal keys mean
equal token prefixes through the same model. A new sequence whose leading full blocks have known
keys takes those blocks (reference counted) instead of recomputing them. A block whose count falls
to 0 stays findable until it is handed out again: free blocks without a key are reused first, keyed
ones in least-recently-freed order, so a repeated system prompt survives while memory allows.

With tiers below the pool (`lower`, a prefix_cache.TieredPrefixCache), a sequence's blocks past
those in the pool are looked up there and loaded into free blocks; a block that gets its key is
handed down (`computed`), and a keyed block about to be reused too (`evicted`).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Protocol

from hybridmoe.engine.prefix_cache.identity import adapter_seed, chain_keys
from hybridmoe.engine.sequence import Sequence


class LowerTiers(Protocol):
    """What the block manager asks of the tiers below the pool (prefix_cache/tiered_cache.py)."""

    def fetch(self, keys: list[bytes]) -> list: ...  # the cached blocks of a prefix of `keys`

    def install(self, block_id: int, block) -> bool: ...  # False: it does not fit this pool

    def computed(self, block_id: int, key: bytes) -> None: ...

    def evicted(self, block_id: int, key: bytes) -> None: ...


class Block:
    __slots__ = ("id", "ref_count", "key")

    def __init__(self, block_id: int):
        self.id = block_id
        self.ref_count = 0
        self.key: bytes | None = None  # its chain key (identity.py), once full and computed


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        seed: bytes = b"",
        lower: LowerTiers | None = None,
    ):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"need at least one block of at least one token (got {num_blocks} x {block_size})"
            )
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict(
            (i, None) for i in range(num_blocks)
        )  # next out first
        self.by_key: dict[bytes, Block] = {}
        self.seed, self.lower = seed, lower  # the chain's namespace; the tiers below, if any
        self.query_tokens = 0  # prompt tokens looked up in the prefix cache
        self.hit_tokens = 0  # of those, found (in the pool or below)
        self.loaded_tokens = 0  # of those, loaded from the tiers below the pool

    # ---- sizes ----
    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_used(self) -> int:
        return len(self.blocks) - len(self.free)

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- the prefix cache ----
    def block_keys(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """Keys of the sequence's first `num_blocks` full blocks (kept on it: tokens only grow). A
        LoRA adapter changes the cached keys and values, so the chain of a sequence with an adapter
        starts from a seed salted by the adapter's name."""
        known = seq.block_keys
        if len(known) < num_blocks:
            prev = known[-1] if known else None
            seed = self.seed if seq.adapter is None else adapter_seed(self.seed, seq.adapter)
            known += chain_keys(seed, seq.token_ids, self.block_size, len(known), num_blocks, prev)
        return known[:num_blocks]

    def match_prefix(self, seq: Sequence) -> int:
        """At admission (empty table): take the cached blocks of the sequence's leading full blocks.

        The last token is never taken from the cache: its logits are needed to sample the next one.
        Returns the number of tokens found (now counted as computed).
        """
        assert not seq.block_table, "match_prefix is for a sequence that holds no blocks"
        self.query_tokens += len(seq)
        keys = self.block_keys(seq, (len(seq) - 1) // self.block_size)
        for key in keys:
            block = self.by_key.get(key)
            if block is None:
                break
            if block.ref_count == 0:
                del self.free[block.id]
            block.ref_count += 1
            seq.block_table.append(block.id)
        if self.lower is not None and len(seq.block_table) < len(keys):
            self._load(seq, keys[len(seq.block_table) : len(seq.block_table) + len(self.free)])
        seq.num_cached = seq.num_computed = len(seq.block_table) * self.block_size
        self.hit_tokens += seq.num_cached
        return seq.num_cached

    def _load(self, seq: Sequence, keys: list[bytes]) -> None:
        """Take free blocks for the leading `keys` the tiers below have, and fill them."""
        loaded = 0
        for key, data in zip(keys, self.lower.fetch(keys)):
            block = self._take()
            if not self.lower.install(block.id, data):
                self._untake(block)
                break
            block.key = key
            self.by_key[key] = block
            seq.block_table.append(block.id)
            loaded += 1
        self.loaded_tokens += loaded * self.block_size

    def unmatch(self, seq: Sequence) -> None:
        """Undo `match_prefix` for a sequence that could not be admitted after all."""
        self.query_tokens -= len(seq)
        self.hit_tokens -= seq.num_cached  # blocks it loaded stay in the pool, keyed
        self.release(seq)
        seq.num_cached = seq.num_computed = 0

    def commit(self, seq: Sequence) -> None:
        """Give keys to the sequence's blocks that are now full and computed,
        so others can share them."""
        full = seq.num_computed // self.block_size
        if full == 0 or self.blocks[seq.block_table[full - 1]].key is not None:
            return
        keys = self.block_keys(seq, full)
        for block_id, key in zip(seq.block_table, keys):
            block = self.blocks[block_id]
            if block.key is None:
                block.key = key
                # an identical block computed at the same time stays private
                if self.by_key.setdefault(key, block) is block and self.lower is not None:
                    self.lower.computed(block_id, key)

    # ---- allocation ----
    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """New blocks for the sequence's table to cover `num_tokens` tokens."""
        return max(0, self.blocks_for(num_tokens) - len(seq.block_table))

    def grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Extend the table to cover `num_tokens` tokens;
        False (and nothing taken) if blocks are short."""
        need = self.blocks_needed(seq, num_tokens)
        if need > len(self.free):
            return False
        for _ in range(need):
            seq.block_table.append(self._take(self._preferred(seq.block_table)).id)
        return True

    def release(self, seq: Sequence) -> None:
        """Drop the sequence's references (finished, aborted or preempted)."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free[block_id] = None
                if block.key is None or self.by_key.get(block.key) is not block:
                    block.key = None
                    self.free.move_to_end(block_id, last=False)  # nothing to keep: reuse it first
        seq.block_table = []

    # A sequence whose blocks are consecutive is attended to in place (paged_kv.history_index),
    # without gathering its history into a copy. So a new sequence starts in the middle of the
    # longest run of free blocks (the sequence before the run can grow into the first half), and a
    # growing one takes the block after its last when that is free. Cached (keyed) blocks are left
    # to the LRU order.
    def _preferred(self, table: list[int]) -> int | None:
        if table:
            nxt = table[-1] + 1
            return nxt if nxt < len(self.blocks) and self._open(nxt) else None
        best_start, best_len, start = 0, 0, None
        for i in range(len(self.blocks) + 1):
            if i < len(self.blocks) and self._open(i):
                start = i if start is None else start
            elif start is not None:
                if i - start > best_len:
                    best_start, best_len = start, i - start
                start = None
        if best_len == 0:
            return None
        return best_start if best_start == 0 else best_start + best_len // 2

    def _open(self, block_id: int) -> bool:
        return block_id in self.free and self.blocks[block_id].key is None

    def _take(self, preferred: int | None = None) -> Block:
        if preferred is None:
            block_id, _ = self.free.popitem(last=False)
        else:
            block_id = preferred
            del self.free[block_id]
        block = self.blocks[block_id]
        if block.key is not None and self.by_key.get(block.key) is block:
            if self.lower is not None:
                self.lower.evicted(
                    block_id, block.key
                )  # its entries are still there until the pass
            del self.by_key[block.key]
        block.key, block.ref_count = None, 1
        return block

    def _untake(self, block: Block) -> None:
        """Give back a block `_take` gave, unused: first to be taken again."""
        block.ref_count = 0
        self.free[block.id] = None
        self.free.move_to_end(block.id, last=False)
