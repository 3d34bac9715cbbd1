"""Whether a model file's Q4_K blocks may be rewritten into rows of eights at load.

Rearranging a mapped matrix in place (quant/tensor.py for_kernels) turns its file pages into the
process's own memory: with no swap those pages can no longer be dropped and read again, so a file
whose Q4_K bytes do not fit beside what else the machine holds keeps its blocks as they lie (read
in place, at the plain Q4_K kernels' speed) instead of growing until the kernel kills a process.
"""

from __future__ import annotations

from pathlib import Path

from hybridmoe.tuning import REARRANGE_SHARE_OF_FREE


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


def may_rearrange(q4k_bytes: int, available: int | None) -> bool:
    """True where `q4k_bytes` of mapped blocks may become the process's own memory."""
    if q4k_bytes == 0:
        return True
    return available is not None and q4k_bytes <= REARRANGE_SHARE_OF_FREE * available
