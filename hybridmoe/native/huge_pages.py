"""Host memory in 2 MB pages for the weights the kernels stream.

A decode step reads every weight it uses once, from RAM, a few MB per kernel call. In 4 KB pages
that is a TLB miss and a page walk every 4 KB, and the hardware prefetchers stop at each page's
end; in 2 MB pages neither happens. Measured on a Sapphire Rapids core, the one-token products
read 9.2 -> 12.8 GB/s (Q4_K in rows of eights), 10.4 -> 14.4 (Q6_K, Q8_0) from the same bytes in
2 MB pages (docs/notes/2026-12-06-decode-step-glue.md).

Linux gives anonymous memory 2 MB pages where it is asked to (madvise MADV_HUGEPAGE) unless
transparent huge pages are off (`/sys/kernel/mm/transparent_hugepage/enabled` = never); torch's
allocations are not asked, and a model file's map is page cache in 4 KB pages. So the loader
copies the weights into an `Arena` of such memory: chunks of anonymous maps, 2 MB aligned,
handed out in 64-byte aligned pieces. A chunk's pages become resident only where written, and a
chunk is unmapped when no tensor views it any more. Where madvise is missing (not Linux) the
arena is plain anonymous memory: the same bytes, in whatever pages the system gives.
"""

from __future__ import annotations

import mmap
import threading

import torch

HUGE = 2 << 20  # bytes in a huge page (x86-64's PMD size)
ALIGN = 64  # a cache line: every piece starts on one
CHUNK = 64 << 20  # bytes mapped at a time: at most one chunk's pages beyond what is written


class Arena:
    """Pieces of 2 MB-paged anonymous memory, handed out one after another."""

    def __init__(self, chunk: int = CHUNK):
        self.chunk = chunk
        self._free: torch.Tensor | None = None  # what is left of the current chunk, uint8 [n]
        self._lock = threading.Lock()

    def empty(self, nbytes: int) -> torch.Tensor:
        """An uninitialised uint8 tensor [nbytes] in the arena, starting on a 64-byte boundary."""
        need = -(-nbytes // ALIGN) * ALIGN
        with self._lock:
            if self._free is None or self._free.numel() < need:
                self._free = _chunk(max(self.chunk, need))
            piece, self._free = self._free[:nbytes], self._free[need:]
        return piece

    def copy(self, t: torch.Tensor) -> torch.Tensor:
        """A contiguous copy of CPU tensor t in the arena: same dtype, shape and values."""
        flat = self.empty(t.numel() * t.element_size())
        out = flat.view(t.dtype).view(t.shape)  # [*t.shape]
        out.copy_(t)
        return out

    def cat(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """torch.cat(tensors) (along dim 0, all of one dtype) in the arena."""
        rows = sum(t.shape[0] for t in tensors)
        first = tensors[0]
        shape = (rows, *first.shape[1:])
        flat = self.empty(rows * first[0].numel() * first.element_size())
        return torch.cat(tensors, out=flat.view(first.dtype).view(shape))  # [rows, ...]


def _chunk(nbytes: int) -> torch.Tensor:
    """A fresh anonymous map of at least nbytes, starting on a 2 MB boundary and asked for 2 MB
    pages: uint8 [n]. The tensor keeps the map alive (torch.frombuffer holds it)."""
    size = -(-nbytes // HUGE) * HUGE
    m = mmap.mmap(-1, size + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(m, dtype=torch.uint8)  # [size + HUGE]
    skip = -whole.data_ptr() % HUGE  # to the first 2 MB boundary
    if hasattr(mmap, "MADV_HUGEPAGE"):  # Linux
        m.madvise(mmap.MADV_HUGEPAGE, skip, size)
    return whole[skip : skip + size]


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed tensor in 2 MB pages of its own (a fresh anonymous map is zeros), unmapped when no
    tensor views it: for memory made and dropped with an engine, as a KV cache's pools."""
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    return _chunk(max(nbytes, 1))[:nbytes].view(dtype).view(shape)


_arena = Arena()


def arena() -> Arena:
    """The process's arena, which the loaders put weights in."""
    return _arena
