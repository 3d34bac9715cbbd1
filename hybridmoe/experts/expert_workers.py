"""Worker threads that split one layer's experts between them, each with one intra-op thread.

A token's K experts are independent matrix-vector products (at prefill, matrix products).
Splitting each product over the cores (torch's intra-op threads) puts a fork and a barrier in
every one, 16 per layer at decode; on a machine whose cores are shared with other processes a
barrier waits for a descheduled thread, and 8 Qwen3-30B-A3B experts measured a median of 20-320 ms
instead of 3 ms (2 cores, load average 8). Whole experts per worker, one barrier per layer: median
5-14 ms under the same load, and the same best case, 2.8-2.9 ms.
"""

from __future__ import annotations

import queue
import threading
from typing import Callable

import torch


class ExpertWorkers:
    """`workers` threads; `map(fn, items)` runs fn over items, worker j taking items j, j+W, ..."""

    def __init__(self, workers: int):
        self.workers = workers
        self._inbox: list[queue.SimpleQueue] = [queue.SimpleQueue() for _ in range(workers)]
        self._done: queue.SimpleQueue = queue.SimpleQueue()
        threads = torch.get_num_threads()
        ready = threading.Barrier(workers + 1)
        for inbox in self._inbox:
            threading.Thread(target=self._loop, args=(inbox, ready), daemon=True, name="hybridmoe-expert").start()
        ready.wait()
        # torch.set_num_threads(1) in a worker also lowered the count that threads made later start
        # with (a process-wide default); put the caller's back.
        torch.set_num_threads(threads)

    def _loop(self, inbox: queue.SimpleQueue, ready: threading.Barrier) -> None:
        torch.set_num_threads(1)
        ready.wait()
        while True:
            job = inbox.get()
            if job is None:
                return
            fn, items, outs, start = job
            try:
                with torch.inference_mode():
                    for i in range(start, len(items), self.workers):
                        outs[i] = fn(items[i])
                self._done.put(None)
            except BaseException as e:  # handed to the caller, who raises it
                self._done.put(e)

    def map(self, fn: Callable, items: list) -> list:
        outs: list = [None] * len(items)
        used = min(self.workers, len(items))
        for j in range(used):
            self._inbox[j].put((fn, items, outs, j))
        errors = [e for e in (self._done.get() for _ in range(used)) if e is not None]
        if errors:
            raise errors[0]
        return outs

    def close(self) -> None:
        for inbox in self._inbox:
            inbox.put(None)
