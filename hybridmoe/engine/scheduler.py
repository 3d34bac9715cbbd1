"""Continuous batching, first come first served, with chunked prefill under a per-step token budget.

Every step: the running sequences that decode take one token each, then those still prefilling take
what the budget leaves, then waiting sequences are admitted in arrival order (their cached prefix
first) while the batch size, the budget and the free blocks allow. All of it is one forward pass.
When a running sequence needs a block and none is free, the newest running sequence is preempted:
its blocks are released and it waits, in front, to be recomputed (prompt and output so far).

The engine can also ask for the two halves apart (decode tokens only, or prefill chunks only) to run
them at the same time on two cores; then the sequences of a pass still in flight are `pinned`: not
scheduled again, and never preempted, since their blocks are being written.
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field

from hybridmoe.engine.block_manager import BlockManager
from hybridmoe.engine.sequence import Sequence, Status


@dataclass
class Batch:
    seqs: list[Sequence] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)  # new tokens of each sequence this step

    def add(self, seq: Sequence, n: int) -> None:
        self.seqs.append(seq)
        self.num_tokens.append(n)

    def remove(self, seq: Sequence) -> int:
        i = self.seqs.index(seq)
        self.seqs.pop(i)
        return self.num_tokens.pop(i)

    def __len__(self) -> int:
        return len(self.seqs)


class Scheduler:
    def __init__(self, blocks: BlockManager, max_batch_size: int, max_tokens_per_step: int):
        if max_batch_size < 1 or max_tokens_per_step < 1:
            raise ValueError("max_batch_size and max_tokens_per_step must be at least 1")
        self.blocks = blocks
        self.max_batch_size, self.max_tokens_per_step = max_batch_size, max_tokens_per_step
        self.waiting: deque[Sequence] = deque()  # arrival order
        self.running: list[Sequence] = []  # arrival order; the last one is the newest
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        if self.blocks.blocks_for(seq.max_len) > self.blocks.num_blocks:
            raise ValueError(f"a sequence of up to {seq.max_len} tokens cannot fit in the KV cache")
        self.waiting.append(seq)

    def finish(self, seq: Sequence) -> None:
        """Remove a running or waiting sequence (finished or aborted) and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.release(seq)
        seq.status = Status.FINISHED

    def schedule(
        self, decode: bool = True, prefill: bool = True, pinned: frozenset = frozenset()
    ) -> Batch:
        """The next forward pass: decode tokens, prefill chunks (admitting waiting sequences),
        or both."""
        batch, budget = Batch(), self.max_tokens_per_step
        chosen = [
            s
            for s in self.running
            if s not in pinned and (decode if not s.is_prefilling else prefill)
        ]
        chosen.sort(
            key=lambda s: s.is_prefilling
        )  # decode first (stable: arrival order within each)
        for seq in chosen:
            if seq.status is not Status.RUNNING or budget == 0:
                continue  # preempted earlier in this loop, or no budget left
            n = min(seq.num_uncomputed, budget)
            if self._reserve(seq, seq.num_computed + n, batch, pinned):
                batch.add(seq, n)
                budget -= n
        # budget returned by preempted sequences is not reused this step: admitting would undo it
        while prefill and self.waiting and len(self.running) < self.max_batch_size and budget > 0:
            seq = self.waiting[0]
            self.blocks.match_prefix(seq)
            n = min(seq.num_uncomputed, budget)
            if not self.blocks.grow(seq, seq.num_computed + n):
                self.blocks.unmatch(seq)
                break
            self.waiting.popleft()
            seq.status = Status.RUNNING
            bisect.insort(self.running, seq, key=lambda s: s.arrival)
            batch.add(seq, n)
            budget -= n
        return batch

    def _reserve(self, seq: Sequence, num_tokens: int, batch: Batch, pinned: frozenset) -> bool:
        """Blocks for `seq` to hold `num_tokens`,
        preempting the newest unpinned sequences as needed."""
        while not self.blocks.grow(seq, num_tokens):
            victim = next(
                s for s in reversed(self.running) if s not in pinned
            )  # `seq` itself at the latest
            self._preempt(victim)
            if victim in batch.seqs:
                batch.remove(victim)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.release(seq)
        seq.reset_for_recompute()
        bisect.insort(
            self.waiting, seq, key=lambda s: s.arrival
        )  # FCFS: it goes back in front of later ones
        self.num_preemptions += 1
