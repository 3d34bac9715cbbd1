"""Host memory for the bus: the one place accelerators allocate it, and the ring experts cross by.

Experts stay in ordinary (pageable, mmap-able) memory, the store's. A DMA engine reads only
page-locked memory at full speed, and pinning every expert page-locks all of them (torch's caching
host allocator also rounds each pinned block up to a power of two), so a model that fits RAM would
not. Instead an expert's bytes are first gathered into one of a few pinned buffers of the largest
expert's size (a ring, `STAGING_DEPTH` deep) and copied to the GPU from there; while one buffer's
DMA runs the next is being filled. Pinned memory then depends on the largest expert and the
largest batch, never on how many experts there are.

`HostAllocator` is the seam every such buffer is taken through (the ring, the activation buffers):
page-locked with CUDA, ordinary memory in the emulator, counted in both (`count`, `nbytes`), which
is what `hybridmoe plan` adds to its host-RAM report and what the tests check.
"""

from __future__ import annotations

import torch

from hybridmoe import tuning
from hybridmoe.experts.plan.host_memory import pinned_bytes


class HostAllocator:
    """Host buffers for transfers: page-locked where `pin` (CUDA), counted either way."""

    def __init__(self, pin: bool):
        self.pin = pin
        self.count = 0  # buffers allocated
        self.nbytes = 0  # their bytes, as the allocator rounds them

    def empty(self, nbytes: int) -> torch.Tensor:
        """A uint8 [nbytes] host buffer."""
        self.count += 1
        self.nbytes += pinned_bytes(nbytes, self.pin)
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin)

    def release(self, buffer: torch.Tensor) -> None:
        """`buffer` (from `empty`) is no longer used: it no longer counts."""
        self.count -= 1
        self.nbytes -= pinned_bytes(buffer.numel(), self.pin)


class StagingRing:
    """`depth` host buffers of `nbytes` each, handed out in turn. A buffer's `done` is whatever
    must finish before it is filled again (the event of the DMA out of it; None: nothing)."""

    def __init__(self, alloc: HostAllocator, nbytes: int, depth: int = tuning.STAGING_DEPTH):
        self.buffers = [alloc.empty(nbytes) for _ in range(depth)]
        self.done: list = [None] * depth
        self.next = 0

    def take(self) -> int:
        """The next buffer's index, once what it was last used for is done."""
        i = self.next
        self.next = (i + 1) % len(self.buffers)
        if self.done[i] is not None:
            self.done[i].synchronize()
            self.done[i] = None
        return i


class GrowingBuffer:
    """One host buffer for activations, reallocated (to a power of two) only when a layer needs
    more: its size follows the largest batch, not the number of experts."""

    def __init__(self, alloc: HostAllocator):
        self.alloc = alloc
        self.buffer: torch.Tensor | None = None
        self.done = None  # the event of the last transfer that reads it

    def take(self, nbytes: int) -> torch.Tensor:
        """The buffer's first `nbytes` (uint8), once the last transfer out of it is done."""
        if self.done is not None:
            self.done.synchronize()
            self.done = None
        if self.buffer is None or nbytes > self.buffer.numel():
            if self.buffer is not None:
                self.alloc.release(self.buffer)
            self.buffer = self.alloc.empty(pinned_bytes(nbytes, True))
        return self.buffer[:nbytes]
