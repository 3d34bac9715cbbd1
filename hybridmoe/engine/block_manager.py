"""Paged KV bookkeeping: a pool of fixed-size blocks, a block table per sequence, and a prefix
cache.

Plain Python over ids. A block holds `block_size` consecutive tokens of one sequence. Once a block
is full and its entries are computed, it gets a key: (key of the previous block, its tokens), so
equal keys mean equal token prefixes. A new sequence whose leading full blocks have known keys takes
those blocks (reference counted) instead of recomputing them. A block whose count falls to 0 stays
findable until it is handed out again: free blocks without a key are reused first, keyed ones in
least-recently-freed order, so a repeated system prompt survives while memory allows.
"""

from __future__ import annotations

from collections import OrderedDict

from hybridmoe.engine.sequence import Sequence


class Block:
    __slots__ = ("id", "ref_count", "key")

    def __init__(self, block_id: int):
        self.id = block_id
        self.ref_count = 0
        self.key: int | None = (
            None  # hash of the token prefix up to the end of this block, once full
        )


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"need at least one block of at least one token (got {num_blocks} x {block_size})"
            )
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict(
            (i, None) for i in range(num_blocks)
        )  # next out first
        self.by_key: dict[int, Block] = {}
        self.query_tokens = 0  # prompt tokens looked up in the prefix cache
        self.hit_tokens = 0  # of those, found

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
    def block_keys(
        self, token_ids: list[int], num_blocks: int, adapter: str | None = None
    ) -> list[int]:
        """Keys of the first `num_blocks` full blocks of `token_ids`. A LoRA adapter changes the
        cached keys and values, so a sequence's adapter is part of its blocks' keys."""
        keys, prev, bs = [], 0 if adapter is None else hash(("adapter", adapter)), self.block_size
        for i in range(num_blocks):
            prev = hash((prev, tuple(token_ids[i * bs : (i + 1) * bs])))
            keys.append(prev)
        return keys

    def match_prefix(self, seq: Sequence) -> int:
        """At admission (empty table): take the cached blocks of the sequence's leading full blocks.

        The last token is never taken from the cache: its logits are needed to sample the next one.
        Returns the number of tokens found (now counted as computed).
        """
        assert not seq.block_table, "match_prefix is for a sequence that holds no blocks"
        tokens = seq.token_ids
        self.query_tokens += len(tokens)
        for key in self.block_keys(tokens, (len(tokens) - 1) // self.block_size, seq.adapter):
            block = self.by_key.get(key)
            if block is None:
                break
            if block.ref_count == 0:
                del self.free[block.id]
            block.ref_count += 1
            seq.block_table.append(block.id)
        seq.num_cached = seq.num_computed = len(seq.block_table) * self.block_size
        self.hit_tokens += seq.num_cached
        return seq.num_cached

    def unmatch(self, seq: Sequence) -> None:
        """Undo `match_prefix` for a sequence that could not be admitted after all."""
        self.query_tokens -= len(seq)
        self.hit_tokens -= seq.num_cached
        self.release(seq)
        seq.num_cached = seq.num_computed = 0

    def commit(self, seq: Sequence) -> None:
        """Give keys to the sequence's blocks that are now full and computed,
        so others can share them."""
        full = seq.num_computed // self.block_size
        if full == 0 or self.blocks[seq.block_table[full - 1]].key is not None:
            return
        keys = self.block_keys(seq.token_ids, full, seq.adapter)
        for block_id, key in zip(seq.block_table, keys):
            block = self.blocks[block_id]
            if block.key is None:
                block.key = key
                self.by_key.setdefault(
                    key, block
                )  # an identical block computed at the same time stays private

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
            del self.by_key[block.key]
        block.key, block.ref_count = None, 1
        return block
