"""The CPU side of a layer: one pool of worker threads for expert FFNs, and when to use it.

A token's K experts are independent matrix-vector products (at prefill, matrix products).
Splitting each product over the cores (torch's intra-op threads) puts a fork and a barrier in every
one, 16 per layer at decode; on a machine whose cores are shared with other processes a barrier
waits for a descheduled thread. So each worker takes whole experts with one torch thread, one
barrier per layer (docs/notes/2026-11-24-measurements-in-code.md, "Expert workers").
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable

import torch

from hybridmoe import invariance, tuning
from hybridmoe.native.threads import kernel_threads

Job = Callable[[], torch.Tensor]


class CPUBatch:
    """One layer's CPU experts in flight; `result()` waits for them."""

    def __init__(self, n: int, workers: int, done: queue.SimpleQueue | None, outs: list):
        self.n, self.workers, self._done, self._outs = n, workers, done, outs

    def result(self) -> tuple[list[torch.Tensor], float]:
        """(outputs in job order, busy seconds: the longest worker's wall time)."""
        busy, errors = 0.0, []
        for _ in range(self.workers):
            seconds, error = self._done.get()
            busy = max(busy, seconds)
            if error is not None:
                errors.append(error)
        if errors:
            raise errors[0]
        return self._outs, busy


class _InlineBatch:
    """Jobs run in the caller's thread when their result is asked for: after the caller has
    launched whatever else the layer runs (the GPU's experts), so both sides still overlap."""

    def __init__(self, jobs: list[Job]):
        self.jobs = jobs

    def result(self) -> tuple[list[torch.Tensor], float]:
        t0 = time.perf_counter()
        outs = [job() for job in self.jobs]
        return outs, time.perf_counter() - t0


class _CallBatch:
    """One call that runs a whole layer's CPU experts on threads of its own (the native kernels'
    pool), made when the result is asked for, as _InlineBatch does."""

    def __init__(self, call: Callable[[], list[torch.Tensor]]):
        self.call = call

    def result(self) -> tuple[list[torch.Tensor], float]:
        t0 = time.perf_counter()
        outs = self.call()
        return outs, time.perf_counter() - t0


class CPUPool:
    """`workers` threads with one torch thread each;
    `submit(jobs)` gives worker j the jobs j, j+W, ..."""

    def __init__(self, workers: int):
        self.workers = workers
        self._inbox: list[queue.SimpleQueue] = [queue.SimpleQueue() for _ in range(workers)]
        threads = torch.get_num_threads()
        ready = threading.Barrier(workers + 1)
        for inbox in self._inbox:
            threading.Thread(
                target=self._loop, args=(inbox, ready), daemon=True, name="hybridmoe-expert"
            ).start()
        ready.wait()
        # torch.set_num_threads(1) in a worker also lowered the count that threads made later start
        # with (a process-wide default); put the caller's back.
        torch.set_num_threads(threads)

    def _loop(self, inbox: queue.SimpleQueue, ready: threading.Barrier) -> None:
        torch.set_num_threads(1)
        ready.wait()
        while (job := inbox.get()) is not None:
            jobs, outs, start, done, alone = job
            t0, error = time.perf_counter(), None
            try:
                with torch.inference_mode(), invariance.rows_alone(alone):  # as the caller
                    for i in range(start, len(jobs), self.workers):
                        outs[i] = jobs[i]()
            except BaseException as e:  # handed to the caller, who raises it
                error = e
            done.put((time.perf_counter() - t0, error))

    def submit(self, jobs: list[Job]) -> CPUBatch:
        outs: list = [None] * len(jobs)
        used = min(self.workers, len(jobs))
        done: queue.SimpleQueue = queue.SimpleQueue()
        for j in range(used):
            self._inbox[j].put((jobs, outs, j, done, invariance.active()))
        return CPUBatch(len(jobs), used, done, outs)

    def map(self, fn: Callable, items: list) -> list:
        return self.submit([lambda item=item: fn(item) for item in items]).result()[0]

    def close(self) -> None:
        for inbox in self._inbox:
            inbox.put(None)


class CPUExperts:
    """Runs a layer's CPU experts: in the calling thread when a hand-off costs more than it saves
    (one torch thread, one expert, or less than `tuning.WORKERS_MIN_BYTES` of weights), else on the
    pool, one worker per torch thread (or `workers`). Both runtimes use it, so an expert on the CPU
    takes the same path whichever runtime runs it."""

    def __init__(self, workers: int | None = None):
        self.workers = workers
        self.pool: CPUPool | None = None

    def start(self, jobs: list[Job], nbytes: int, heavy: bool = False) -> CPUBatch | _InlineBatch:
        """Start `jobs`, which stream `nbytes` of weights in all (`heavy`: work that dwarfs any
        hand-off whatever the bytes, a training step's experts); `.result()` -> (outputs, busy
        seconds)."""
        workers = self.workers or kernel_threads()
        if min(workers, len(jobs)) <= 1 or (nbytes < tuning.WORKERS_MIN_BYTES and not heavy):
            return _InlineBatch(jobs)
        if self.pool is None or self.pool.workers != workers:
            self.close()
            self.pool = CPUPool(workers)
        return self.pool.submit(jobs)

    def workers_now(self) -> int:
        """The threads a layer's experts take now: `workers`, or torch's count."""
        return self.workers or kernel_threads()

    def start_call(self, call: Callable[[int], list[torch.Tensor]]) -> _CallBatch:
        """A layer's experts as one call(workers) that spreads them over its own threads."""
        workers = self.workers_now()
        return _CallBatch(lambda: call(workers))

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
            self.pool = None
