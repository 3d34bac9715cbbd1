"""The C heap's free pages handed back to the system between optimizer steps.

A training step allocates and frees more than a gigabyte of tensors of many sizes (per layer, per
expert tile, on the caller's thread and on the expert workers, each with a heap of its own in
glibc). glibc returns a heap's memory only from its top, so the free chunks between live ones stay
resident, and each step's mix of sizes leaves more of them: the peak RSS of a demo training run grew
by about 100 MB a step (docs/notes/2026-11-24-finetune.md, "Peak memory"). malloc_trim(0) releases
every free page of every heap; the next step faults back only what it uses.

Within a step, glibc's defaults hand each large tensor (from 128 kB, rising with what was freed)
its own mapping and unmap it when freed, so the next tensor of that size faults its pages in again,
a few microseconds per 4 kB page: about 25,000 faults a demo step. `keep_freed_memory` makes every
tensor up to the largest a step makes (the head's [128, V] fp32 logits, 25 MB on the demo) come from
the heaps, whose freed chunks the step's next tensors reuse.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform
from functools import cache


def _trim():
    """libc's malloc_trim, or None outside glibc (whose allocators keep no such pages)."""
    libc = _libc()
    return None if libc is None else getattr(libc, "malloc_trim", None)


# mallopt's parameters (malloc.h) and the largest mmap threshold glibc takes on 64-bit systems
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MMAP_THRESHOLD_MAX = 32 << 20


@cache
def _libc():
    """libc, or None outside glibc."""
    if platform.libc_ver()[0] != "glibc":
        return None
    return ctypes.CDLL(ctypes.util.find_library("c"))


def keep_freed_memory() -> None:
    """Serve allocations up to 32 MB from the heaps and keep their freed memory there for the next
    ones (glibc; nothing elsewhere): for a training process, whose steps make and free the same
    tensors again and again. release_free_heap still hands the free pages back between steps."""
    libc = _libc()
    if libc is not None:
        libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX)
        libc.mallopt(_M_TRIM_THRESHOLD, 2 * _MMAP_THRESHOLD_MAX)


def release_free_heap() -> None:
    """Hand the heaps' free pages back to the system (glibc; nothing elsewhere)."""
    trim = _trim()
    if trim is not None:
        trim(0)
