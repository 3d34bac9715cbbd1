"""Executors carry a plan out: a CPU worker pool, and an accelerator with expert slots.

An accelerator owns `slots` expert-sized buffers (the GPU expert cache's memory), a copy stream
that fills them from the store, and a compute stream that runs experts from them. A copy records
an event; a GPU expert waits for the event of the copy that filled its buffer, and a copy into a
slot waits for the last GPU use of what it overwrites. Two accelerators share this interface:

- `CUDAAccelerator`: real CUDA streams and events, pinned host weights, slots in GPU memory;
- `EmulatedAccelerator`: the same slots, copies and events over CPU tensors, for machines without
  CUDA (and CI). Copies are real memory copies; time is a virtual clock driven by the cost model,
  so plans run exactly as they would on a GPU, and ordering mistakes are caught (`check`).

`HostOnly` stands in when there is no accelerator at all (every expert on the CPU).

Interface, per MoE layer (hybrid_runtime.py makes these calls):

    start = acc.begin_layer()
    buf = acc.copy(layer, expert, slot)       # slot None: a staging buffer, valid this layer only
    h = acc.run(x_rows, layer, expert, buf)   # buf: a slot number or what copy() returned
    ys = acc.gather([h, ...])                 # host tensors [n, H]
    finish = acc.end_layer(cpu_seconds)
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

import torch

from hybridmoe.experts.cost_model import CostModel
from hybridmoe.experts.runtime import expert_ffn
from hybridmoe.experts.store import ExpertStore, ExpertWeights

Key = tuple[int, int]


# ---- the CPU side ------------------------------------------------------------------------------


class CPUPool:
    """Worker threads running expert FFNs while the calling thread drives the GPU.

    torch releases the GIL inside its kernels, so a worker computes while the main thread launches
    GPU work. One worker by default: each worker already uses all of torch's intra-op threads, and
    more workers would oversubscribe the cores.
    """

    def __init__(self, workers: int = 1):
        self.workers = max(1, workers)
        self._pool = ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="hybridmoe-cpu")

    def submit(self, jobs: list[Callable[[], torch.Tensor]]) -> "CPUBatch":
        """Start `jobs`, split round-robin over the workers; `.result()` waits for them."""
        bins = [jobs[i :: self.workers] for i in range(self.workers)]
        threads = torch.get_num_threads()
        return CPUBatch(len(jobs), self.workers, [self._pool.submit(_run_bin, b, threads) if b else None for b in bins])

    def close(self) -> None:
        self._pool.shutdown(wait=True)


class CPUBatch:
    """The CPU jobs of one layer, in flight on the pool."""

    def __init__(self, n: int, workers: int, parts: list[Future | None]):
        self.n, self.workers, self.parts = n, workers, parts

    def result(self) -> tuple[list[torch.Tensor], float]:
        """(outputs in job order, busy seconds: the longest worker's wall time)."""
        outs: list = [None] * self.n
        busy = 0.0
        for w, part in enumerate(self.parts):
            if part is not None:
                ys, seconds = part.result()
                outs[w :: self.workers] = ys
                busy = max(busy, seconds)
        return outs, busy


def _run_bin(jobs, threads: int) -> tuple[list[torch.Tensor], float]:
    # The caller's intra-op thread count: a kernel's reduction order can depend on it, and CPU
    # experts must give bit for bit what they give in the calling thread (CPURuntime).
    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    with torch.inference_mode():
        ys = [job() for job in jobs]
    return ys, time.perf_counter() - t0


# ---- shared by both accelerators ---------------------------------------------------------------


@dataclass(frozen=True)
class Staging:
    """A copy into a buffer that is not kept (slot None in the plan): valid for this layer."""

    index: int


def _slabs(store: ExpertStore, count: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Buffers for `count` experts: gate_up [count, 2I, H], down [count, H, I] in the store's dtype."""
    s = store.shape
    gate_up = torch.empty((count, 2 * s.intermediate, s.hidden), dtype=store.dtype, device=device)
    down = torch.empty((count, s.hidden, s.intermediate), dtype=store.dtype, device=device)
    return gate_up, down


class _Slots:
    """Slot and staging buffers, and which expert each one holds (for checks)."""

    def __init__(self, store: ExpertStore, slots: int, device):
        self.store, self.count, self.device = store, slots, device
        self.gate_up, self.down = _slabs(store, slots, device)
        self.holds: list[Key | None] = [None] * slots
        self.staging: list[ExpertWeights] = []
        self.staging_holds: list[Key | None] = []

    def weights(self, buf) -> ExpertWeights:
        if isinstance(buf, Staging):
            return self.staging[buf.index]
        return ExpertWeights(self.gate_up[buf], self.down[buf])

    def holder(self, buf) -> Key | None:
        return self.staging_holds[buf.index] if isinstance(buf, Staging) else self.holds[buf]

    def set_holder(self, buf, key: Key) -> None:
        if isinstance(buf, Staging):
            self.staging_holds[buf.index] = key
        else:
            self.holds[buf] = key

    def new_staging(self, used: int) -> Staging:
        """The `used`-th staging buffer of this layer, allocated the first time it is needed."""
        if used == len(self.staging):
            gu, dn = _slabs(self.store, 1, self.device)
            self.staging.append(ExpertWeights(gu[0], dn[0]))
            self.staging_holds.append(None)
        return Staging(used)


def _fill(slots: _Slots, key: Key, buf) -> None:
    """A synchronous copy of the store's weights for `key` into `buf`."""
    src, dst = slots.store.get(*key), slots.weights(buf)
    dst.gate_up.copy_(src.gate_up)
    dst.down.copy_(src.down)
    slots.set_holder(buf, key)


def _check_holder(slots: _Slots, buf, key: Key) -> None:
    held = slots.holder(buf)
    if held != key:
        raise RuntimeError(f"expert {key} was scheduled on buffer {buf}, which holds {held}: a plan/executor bug")


# ---- the emulated accelerator ------------------------------------------------------------------


@dataclass
class GPURun:
    """One emulated GPU expert, as it ran on the virtual clock (kept for tests and stats)."""

    key: Key
    buffer: object
    start: float
    end: float
    ready: float  # the virtual time of the event it waited for


@dataclass
class CopyRecord:
    key: Key
    buffer: object
    start: float
    end: float
    free_at: float  # when the GPU finished reading the buffer's previous contents


@dataclass
class _Pending:
    x: torch.Tensor  # [n, H]
    weights: ExpertWeights


class EmulatedAccelerator:
    """Slots in host memory, copies as real memory copies, a virtual clock from the cost model.

    The clock is that of a GPU with `cost`'s constants: a copy takes `t_copy`, starts when the copy
    stream is free and the slot's previous contents are no longer in use; a GPU expert takes
    `t_gpu(n)` and starts when the compute stream is free and its buffer's copy event has fired.
    GPU experts are computed in `gather` (after the CPU pool is done, so that they do not disturb
    the CPU's measured time), from the slot's copy, with the same function as the CPU path.
    """

    kind = "emulated"

    def __init__(self, store: ExpertStore, slots: int, cost: CostModel, keep_log: bool = False):
        if not cost.has_gpu:
            raise ValueError("the emulated accelerator needs a cost model with GPU and PCIe constants")
        self.cost, self.slots = cost, slots
        self.buffers = _Slots(store, slots, "cpu")
        self.clock = 0.0
        self.copy_free = 0.0  # when the copy stream has finished what is queued
        self.gpu_free = 0.0  # when the compute stream has finished what is queued
        self.ready = [0.0] * slots  # event time of the last copy into each slot
        self.last_use = [0.0] * slots  # end of the last GPU expert that read each slot
        self._staging_ready: list[float] = []
        self._staging_used = 0
        self.keep_log = keep_log
        self.copies: list[CopyRecord] = []
        self.runs: list[GPURun] = []
        self.gpu_busy_s = 0.0
        self.copy_busy_s = 0.0
        self._layer_gpu_end = 0.0

    def now(self) -> float:
        return self.clock

    def begin_layer(self) -> float:
        self._staging_used = 0
        self._layer_gpu_end = self.clock
        return self.clock

    def preload(self, layer: int, expert: int, slot: int) -> None:
        """Fill a slot before the run starts (placement): ready at time 0."""
        _fill(self.buffers, (layer, expert), slot)

    def copy(self, layer: int, expert: int, slot: int | None):
        """Copy expert (layer, expert) from the store into `slot` (or a staging buffer)."""
        if slot is None:
            buf = self.buffers.new_staging(self._staging_used)
            self._staging_used += 1
            self._staging_ready.extend([0.0] * (len(self.buffers.staging) - len(self._staging_ready)))
            free_at = 0.0  # staging buffers are used within one layer, after the previous layer ended
        else:
            buf, free_at = slot, self.last_use[slot]
        _fill(self.buffers, (layer, expert), buf)
        start = max(self.clock, self.copy_free, free_at)
        end = start + self.cost.t_copy()
        self.copy_free = end
        self.copy_busy_s += end - start
        if isinstance(buf, Staging):
            self._staging_ready[buf.index] = end
        else:
            self.ready[slot] = end
        if self.keep_log:
            self.copies.append(CopyRecord((layer, expert), buf, start, end, free_at))
        return buf

    def run(self, x: torch.Tensor, layer: int, expert: int, buf) -> _Pending:
        """Queue expert (layer, expert) on x [n, H] from `buf`, after its copy's event."""
        _check_holder(self.buffers, buf, (layer, expert))
        ready = self._staging_ready[buf.index] if isinstance(buf, Staging) else self.ready[buf]
        start = max(self.clock, self.gpu_free, ready)
        end = start + self.cost.t_gpu(x.shape[0])
        self.gpu_free = self._layer_gpu_end = end
        self.gpu_busy_s += end - start
        if not isinstance(buf, Staging):
            self.last_use[buf] = end
        if self.keep_log:
            self.runs.append(GPURun((layer, expert), buf, start, end, ready))
        return _Pending(x, self.buffers.weights(buf))

    def gather(self, handles: list[_Pending]) -> list[torch.Tensor]:
        return [expert_ffn(h.x, h.weights) for h in handles]

    def end_layer(self, cpu_seconds: float) -> float:
        """Advance the clock to the layer's end: the later of the CPU and the GPU side."""
        self.clock = max(self.clock + cpu_seconds, self._layer_gpu_end)
        return self.clock

    def check(self) -> None:
        """Invariants for tests: no GPU expert starts before its copy's event, no copy overwrites a
        buffer the GPU is still reading."""
        for r in self.runs:
            assert r.start + 1e-12 >= r.ready, f"{r.key} ran at {r.start} before its copy was ready at {r.ready}"
        for c in self.copies:
            assert c.start + 1e-12 >= c.free_at, f"copy of {c.key} overwrote buffer {c.buffer} while in use"


# ---- CUDA --------------------------------------------------------------------------------------


@dataclass
class _CUDAHandle:
    out: torch.Tensor  # [n, H] pinned host tensor, filled asynchronously
    done: object  # torch.cuda.Event


@dataclass
class _CUDAState:
    ready: list = field(default_factory=list)  # per slot: event of the last copy into it
    freed: list = field(default_factory=list)  # per slot: event after its last GPU use
    staging_ready: list = field(default_factory=list)
    staging_freed: list = field(default_factory=list)


class CUDAAccelerator:
    """Slots in GPU memory; copies on their own stream from pinned host memory, with events."""

    kind = "cuda"

    def __init__(self, store: ExpertStore, slots: int, cost: CostModel, device: str = "cuda"):
        if not torch.cuda.is_available():
            raise RuntimeError("CUDAAccelerator needs CUDA; use the emulated accelerator instead")
        self.cost, self.slots, self.device = cost, slots, torch.device(device)
        self.buffers = _Slots(store, slots, self.device)
        self.copy_stream = torch.cuda.Stream(self.device)
        self.compute_stream = torch.cuda.Stream(self.device)
        self.state = _CUDAState([None] * slots, [None] * slots)
        self._staging_used = 0
        self._t0 = time.perf_counter()
        self._layer_start = 0.0
        self.gpu_busy_s = 0.0  # measured by events per layer
        self.copy_busy_s = 0.0  # predicted (the copy stream is not timed, to avoid syncs)
        self._first = self._last = None

    def now(self) -> float:
        return time.perf_counter() - self._t0

    def begin_layer(self) -> float:
        self._staging_used = 0
        self._first = self._last = None
        self._layer_start = self.now()
        return self._layer_start

    def preload(self, layer: int, expert: int, slot: int) -> None:
        _fill(self.buffers, (layer, expert), slot)  # synchronous: before the first step

    def copy(self, layer: int, expert: int, slot: int | None):
        st = self.state
        if slot is None:
            buf = self.buffers.new_staging(self._staging_used)
            self._staging_used += 1
            while len(st.staging_ready) < len(self.buffers.staging):
                st.staging_ready.append(None)
                st.staging_freed.append(None)
            freed = st.staging_freed[buf.index]
        else:
            buf, freed = slot, st.freed[slot]
        src, dst = self.buffers.store.get(layer, expert), self.buffers.weights(buf)
        with torch.cuda.stream(self.copy_stream):
            if freed is not None:  # the GPU must be done reading what this copy overwrites
                self.copy_stream.wait_event(freed)
            dst.gate_up.copy_(src.gate_up, non_blocking=True)
            dst.down.copy_(src.down, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.copy_stream)
        if isinstance(buf, Staging):
            st.staging_ready[buf.index] = event
        else:
            st.ready[slot] = event
        self.buffers.set_holder(buf, (layer, expert))
        self.copy_busy_s += self.cost.t_copy()
        return buf

    def run(self, x: torch.Tensor, layer: int, expert: int, buf) -> _CUDAHandle:
        _check_holder(self.buffers, buf, (layer, expert))
        st = self.state
        ready = st.staging_ready[buf.index] if isinstance(buf, Staging) else st.ready[buf]
        out = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)  # [n, H]
        with torch.cuda.stream(self.compute_stream):
            if ready is not None:
                self.compute_stream.wait_event(ready)
            self._mark_first()
            y = expert_ffn(x.to(self.device, non_blocking=True), self.buffers.weights(buf))  # [n, H]
            out.copy_(y, non_blocking=True)
            done = torch.cuda.Event(enable_timing=True)
            done.record(self.compute_stream)
        self._last = done
        if isinstance(buf, Staging):
            st.staging_freed[buf.index] = done
        else:
            st.freed[buf] = done
        return _CUDAHandle(out, done)

    def _mark_first(self) -> None:
        if self._first is None:
            self._first = torch.cuda.Event(enable_timing=True)
            self._first.record(self.compute_stream)

    def gather(self, handles: list[_CUDAHandle]) -> list[torch.Tensor]:
        for h in handles:
            h.done.synchronize()
        return [h.out for h in handles]

    def end_layer(self, cpu_seconds: float) -> float:
        self.compute_stream.synchronize()
        if self._first is not None and self._last is not None:
            self.gpu_busy_s += self._first.elapsed_time(self._last) / 1e3
        return self.now()

    def check(self) -> None:
        pass  # events enforce the order on a real GPU


# ---- no accelerator ----------------------------------------------------------------------------


class HostOnly:
    """No accelerator: a wall clock, zero slots; every expert runs on the CPU pool."""

    kind = "cpu"
    slots = 0
    gpu_busy_s = 0.0
    copy_busy_s = 0.0

    def __init__(self):
        self._t0 = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self._t0

    def begin_layer(self) -> float:
        return self.now()

    def preload(self, layer, expert, slot):
        raise RuntimeError("placement on a machine without an accelerator: a planner bug")

    def copy(self, layer, expert, slot):
        raise RuntimeError("a plan asked for a copy on a machine without an accelerator: a planner bug")

    def run(self, x, layer, expert, buf):
        raise RuntimeError("a plan put an expert on the GPU on a machine without one: a planner bug")

    def gather(self, handles):
        return []

    def end_layer(self, cpu_seconds: float) -> float:
        return self.now()

    def check(self) -> None:
        pass


def make_accelerator(device: str, store: ExpertStore, slots: int, cost: CostModel, keep_log: bool = False):
    """device: "cuda" | "emulated" | "cpu" (already resolved from "auto" by the caller)."""
    if device == "cuda":
        return CUDAAccelerator(store, slots, cost)
    if device == "emulated":
        return EmulatedAccelerator(store, slots, cost, keep_log)
    return HostOnly()
