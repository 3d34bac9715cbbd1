"""How much of a model file's blocks may be copied into the process's own memory at load.

A copy in 2 MB pages (native/huge_pages.py) is read faster than the file's map, and Q4_K blocks
there are rearranged into rows of eights (quant/tensor.py for_kernels); but with no swap the
process's own pages can no longer be dropped and read again, as the page cache of a map can. So a
file's blocks are copied while they fit in a share of the memory available at load, and the rest
stay in the map, read in place (at the plain kernels' speed), instead of the process growing until
the kernel kills one.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
from pathlib import Path

import torch

from hybridmoe.tuning import COPY_SHARE_OF_FREE


def available_bytes(meminfo: str | Path = "/proc/meminfo") -> int | None:
    """The kernel's estimate of memory available without swapping (MemAvailable), or None where
    it is not reported (not Linux)."""
    try:
        for line in Path(meminfo).read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # reported in kB
    except OSError:
        return None
    return None


class CopyBudget:
    """Bytes of a file's blocks that may still become the process's own: COPY_SHARE_OF_FREE
    of `available` (none where it is unknown), taken tensor by tensor in file order."""

    def __init__(self, available: int | None):
        self.left = 0 if available is None else int(COPY_SHARE_OF_FREE * available)

    def take(self, nbytes: int) -> bool:
        """True, and nbytes fewer left, where nbytes fit; else False and nothing taken."""
        if nbytes > self.left:
            return False
        self.left -= nbytes
        return True


def give_back_heap() -> None:
    """Return the C heap's free pages to the system (glibc's malloc_trim; nothing elsewhere). A
    file's values are read into buffers of the heap and copied into 2 MB pages
    (native/huge_pages.py), so the freed buffers no longer become the weights' own memory: kept,
    they held ~0.8 GB of a BF16 file's 5 GB in the process's resident memory."""
    trim = getattr(_libc(), "malloc_trim", None)
    if trim is not None:
        trim(0)


def let_go(view: torch.Tensor) -> None:
    """Drop the pages wholly under `view`, a part of a file's private map that nothing wrote, from
    this process's memory (madvise MADV_DONTNEED): they stay in the page cache, and a read of them
    maps the file's bytes again."""
    page = mmap.PAGESIZE
    first = -(-view.data_ptr() // page) * page
    end = (view.data_ptr() + view.numel() * view.element_size()) // page * page
    if end > first and hasattr(mmap, "MADV_DONTNEED"):
        _libc().madvise(ctypes.c_void_p(first), ctypes.c_size_t(end - first), mmap.MADV_DONTNEED)


@functools.cache
def _libc():
    return ctypes.CDLL(None, use_errno=True)
