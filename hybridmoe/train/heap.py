"""The C heap's free pages handed back to the system between optimizer steps.

A training step allocates and frees more than a gigabyte of tensors of many sizes (per layer, per
expert tile, on the caller's thread and on the expert workers, each with a heap of its own in
glibc). glibc returns a heap's memory only from its top, so the free chunks between live ones stay
resident, and each step's mix of sizes leaves more of them: the peak RSS of a demo training run grew
by about 100 MB a step (docs/notes/2026-11-24-finetune.md, "Peak memory"). malloc_trim(0) releases
every free page of every heap; the next step faults back only what it uses.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform
from functools import cache


@cache
def _trim():
    """libc's malloc_trim, or None outside glibc (whose allocators keep no such pages)."""
    if platform.libc_ver()[0] != "glibc":
        return None
    return getattr(ctypes.CDLL(ctypes.util.find_library("c")), "malloc_trim", None)


def release_free_heap() -> None:
    """Hand the heaps' free pages back to the system (glibc; nothing elsewhere)."""
    trim = _trim()
    if trim is not None:
        trim(0)
