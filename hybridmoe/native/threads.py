"""How many threads a native kernel call takes, and a decode pass's split of the cores.

A decode step is a few large native kernel calls (the weights, streamed over every core) and many
small torch ops (routing, norms' glue, residual sums), each too small to split. With torch on N > 1
threads every such op still opens an OpenMP region and wakes the other threads: on the 2-core
machine the demo's and the Qwen3-shaped models' decode got slower with a second thread, not faster
(docs/notes/2026-11-24-gemv-streams.md). `kernels_only` gives torch one thread for the pass and
keeps N for the native kernels, which take their count from `kernel_threads`.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

_local = threading.local()  # torch's thread count is per thread (OpenMP), and so is this


def kernel_threads() -> int:
    """Threads a native kernel call may use: torch's count, or the one it had before
    `kernels_only` took torch down to one thread."""
    return getattr(_local, "kernels", None) or torch.get_num_threads()


@contextmanager
def kernels_only() -> Iterator[None]:
    """Within: torch's own ops on one thread, the native kernels on the threads torch had."""
    threads = torch.get_num_threads()
    if threads == 1 or getattr(_local, "kernels", None):
        yield
        return
    _local.kernels = threads
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        _local.kernels = None


@contextmanager
def one_torch_thread(on: bool = True) -> Iterator[None]:
    """Within (if `on`: a caller's tensors on the CPU): torch's ops on one thread (this thread's
    OpenMP count), for a layer's small ops beside the native kernels: on the shared 2-core machine
    a second OpenMP thread turned a 15 us index_add_ into 10 ms, waiting for a descheduled core
    (docs/notes/2026-11-24-finetune.md), and a 512-token prefill's KV writes (index_copy_) took
    100-160 ms on two threads against 20 on one (docs/notes/2026-12-07-bf16-prefill.md). Copies
    and in-order sums: the same bits either way."""
    before = torch.get_num_threads()
    if not on or before == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
