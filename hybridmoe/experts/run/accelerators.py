"""Accelerators carry out the GPU side of a plan: expert slots, a copy stream, a compute stream.

An accelerator owns `slots` expert-sized buffers (the GPU expert cache's memory: uint8 of the
largest expert's stored size, holding an expert's bytes as stored, so experts in blocks cross the
bus and sit in the cache quantised; expert_bytes.py), a copy stream that fills them from the store
through a small ring of pinned staging buffers (host_staging.py), and a compute stream that runs
experts from them. A copy records an event; a GPU expert waits for the event of the copy that
filled its buffer, and a copy into a buffer waits for the last GPU use of what it overwrites.

It is also where the rest of the model lives (`device`, `place`: the dense weights and KV pools),
and the bus the CPU experts' activations cross (`to_host`, `to_device`: one copy each way a layer,
through pinned buffers). Three implementations:

- `CUDAAccelerator`: real CUDA streams and events, slots in GPU memory;
- `EmulatedAccelerator`: the same slots, copies and events over CPU tensors, for machines without
  CUDA (and CI). Copies are real memory copies; time is a virtual clock driven by the cost model,
  so plans run exactly as they would on a GPU, and ordering mistakes are caught (`check`);
- `HostOnly`: no accelerator at all (every expert on the CPU); it refuses GPU work.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

import torch

from hybridmoe.experts.plan.cost_model import CostModel
from hybridmoe.experts.plan.shape import Key
from hybridmoe.experts.run.expert_bytes import Layout, layout, pack, view
from hybridmoe.experts.run.ffn import expert_ffn
from hybridmoe.experts.run.host_staging import GrowingBuffer, HostAllocator, StagingRing
from hybridmoe.experts.run.store import ExpertStore, ExpertWeights


@dataclass(frozen=True)
class Staging:
    """A copy into a buffer that is not kept (slot None in the plan): valid for this layer."""

    index: int


Buffer = int | Staging  # a cache slot, or a staging buffer


class Accelerator(Protocol):
    """What the hybrid runtime calls, per MoE layer:

    start = acc.begin_layer()
    buf = acc.copy(layer, expert, slot)       # slot None: a staging buffer, valid this layer only
    xh = acc.to_host(x[cpu_rows])             # the CPU experts' rows, one batched copy
    h = acc.run(x_rows, layer, expert, buf)   # buf: a slot number or what copy() returned
    ys = acc.gather([h, ...])                 # device tensors [n, H]
    y_cpu = acc.to_device(cpu_outputs)        # the CPU experts' outputs, one batched copy
    finish = acc.end_layer(cpu_seconds)

    and, once, `place(tensor)` for each dense weight and KV pool: device memory.
    """

    kind: str
    device: torch.device  # where the dense model, its KV cache and its activations live
    slots: int
    gpu_busy_s: float  # seconds the compute stream worked, in total
    copy_busy_s: float  # seconds the copy stream worked, in total

    def place(self, t: torch.Tensor) -> torch.Tensor: ...
    def on_device(self, t: torch.Tensor) -> bool: ...
    def to_host(self, x: torch.Tensor) -> torch.Tensor: ...
    def to_device(self, ys: list[torch.Tensor]) -> torch.Tensor: ...
    def now(self) -> float: ...
    def begin_layer(self) -> float: ...
    def preload(self, layer: int, expert: int, slot: int) -> None: ...
    def copy(self, layer: int, expert: int, slot: int | None) -> Buffer: ...
    def run(self, x: torch.Tensor, layer: int, expert: int, buf: Buffer) -> object: ...
    def gather(self, handles: list) -> list[torch.Tensor]: ...
    def end_layer(self, cpu_seconds: float) -> float: ...
    def check(self) -> None: ...


def _span(t: torch.Tensor) -> tuple[int, int]:
    """Addresses of t's first byte and one past its last (t contiguous, as placed weights are)."""
    start = t.data_ptr()
    return start, start + t.numel() * t.element_size()


def slot_bytes(store: ExpertStore) -> int:
    """Bytes of one slot: the largest expert as packed (expert_bytes.py), whatever its format."""
    return max(layout(w).nbytes for w in store.records.values())


class _Buffers:
    """Slot and staging buffers on the device, numbered together (slots first, then staging
    buffers as they are first needed): uint8 [slot_bytes] each, an expert's bytes as they are
    stored (blocks stay blocks), and which expert each holds with its layout. Per-buffer state
    elsewhere is a list indexed by `index(buf)` and grown with `grow(list, fill)`."""

    def __init__(self, store: ExpertStore, slots: int, device):
        self.store, self.slots, self.device = store, slots, device
        self.size = slot_bytes(store)
        self.memory = torch.empty(
            (slots, self.size), dtype=torch.uint8, device=device
        )  # [slots, size]: the GPU expert cache
        self.staging: list[torch.Tensor] = []  # [size] each
        self.holds: list[Key | None] = [None] * slots
        self.layouts: list[Layout | None] = [None] * slots

    def index(self, buf: Buffer) -> int:
        return self.slots + buf.index if isinstance(buf, Staging) else buf

    def bytes_of(self, buf: Buffer) -> torch.Tensor:
        i = self.index(buf)
        return self.memory[i] if i < self.slots else self.staging[i - self.slots]

    def weights(self, buf: Buffer) -> ExpertWeights:
        """The expert `buf` holds, as views of its bytes."""
        return view(self.bytes_of(buf), self.layouts[self.index(buf)])

    def staging_buffer(self, used: int) -> Staging:
        """The `used`-th staging buffer of this layer, allocated the first time it is needed."""
        if used == len(self.staging):
            self.staging.append(torch.empty(self.size, dtype=torch.uint8, device=self.device))
            self.holds.append(None)
            self.layouts.append(None)
        return Staging(used)

    def grow(self, values: list, fill) -> list:
        """`values`, one per buffer, extended with `fill` for staging buffers made since."""
        values.extend([fill] * (len(self.holds) - len(values)))
        return values

    def mark(self, key: Key, buf: Buffer, lay: Layout) -> None:
        i = self.index(buf)
        self.holds[i], self.layouts[i] = key, lay

    def check_holder(self, buf: Buffer, key: Key) -> None:
        held = self.holds[self.index(buf)]
        if held != key:
            raise RuntimeError(
                f"expert {key} was scheduled on buffer {buf}, which holds {held}: a plan/executor "
                "bug"
            )


class _Layer:
    """Staging buffers handed out in the current layer, shared by both real accelerators."""

    def __init__(self, buffers: _Buffers):
        self.buffers = buffers
        self.staging_used = 0

    def target(self, slot: int | None) -> Buffer:
        if slot is not None:
            return slot
        buf = self.buffers.staging_buffer(self.staging_used)
        self.staging_used += 1
        return buf


class _Bus:
    """The host side of the bus, shared by both real accelerators: the staging ring experts cross
    by and the buffers of the CPU experts' activations, all taken through one HostAllocator
    (host_staging.py); and, for tests, the rows of every activation transfer."""

    def __init__(self, store: ExpertStore, size: int, pin: bool):
        self.store = store
        self.alloc = HostAllocator(pin)
        self.ring = StagingRing(self.alloc, size)
        self.up, self.back = GrowingBuffer(self.alloc), GrowingBuffer(self.alloc)
        self.moved: list[tuple[str, int]] = []  # ("up" | "back", rows) of each transfer

    def stage(self, key: Key) -> tuple[int, Layout]:
        """Gather expert `key`'s bytes from the store (pageable) into the next ring buffer."""
        i = self.ring.take()
        return i, pack(self.store.get(*key), self.ring.buffers[i])

    def rows(self, buffer: GrowingBuffer, n: int, like: torch.Tensor) -> torch.Tensor:
        """[n, H] rows of `like`'s dtype in `buffer`."""
        h, dtype = like.shape[-1], like.dtype
        self.moved.append(("up" if buffer is self.up else "back", n))
        return buffer.take(n * h * dtype.itemsize).view(dtype).view(n, h)


# ---- the emulated accelerator ------------------------------------------------------------------


@dataclass
class GPURun:
    """One emulated GPU expert, as it ran on the virtual clock (kept for tests and stats)."""

    key: Key
    buffer: Buffer
    start: float
    end: float
    ready: float  # the virtual time of the event it waited for


@dataclass
class CopyRecord:
    key: Key
    buffer: Buffer
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
    stream is free and the buffer's previous contents are no longer in use; a GPU expert takes
    `t_gpu(n)` and starts when the compute stream is free and its buffer's copy event has fired.
    GPU experts are computed in `gather` (after the CPU side is done, so that they do not disturb
    the CPU's measured time), from the slot's bytes, with the same function as the CPU path (the
    native kernels, for experts in blocks).

    Its "device memory" is host memory with a tag: what `place` was given (the dense model, the
    KV cache) is remembered (`on_device`), and every activation that crosses the bus goes through
    `to_host` / `to_device` (counted in `bus.moved`), so that tests can check where each tensor
    lives and what moves.
    """

    kind = "emulated"
    device = torch.device("cpu")

    def __init__(self, store: ExpertStore, slots: int, cost: CostModel, keep_log: bool = False):
        if not cost.has_gpu:
            raise ValueError(
                "the emulated accelerator needs a cost model with GPU and PCIe constants"
            )
        self.cost, self.slots = cost, slots
        self.buffers = _Buffers(store, slots, "cpu")
        self.bus = _Bus(store, self.buffers.size, pin=False)
        self.layer = _Layer(self.buffers)
        # the bytes of what `place` was given (not their storages: weights share the arena's)
        self.placed: list[tuple[int, int]] = []
        self.clock = 0.0
        self.copy_free = 0.0  # when the copy stream has finished what is queued
        self.gpu_free = 0.0  # when the compute stream has finished what is queued
        self.ready = [0.0] * slots  # per buffer: event time of the last copy into it
        self.last_use = [0.0] * slots  # per buffer: end of the last GPU expert that read it
        self.keep_log = keep_log
        self.copies: list[CopyRecord] = []
        self.runs: list[GPURun] = []
        self.gpu_busy_s = 0.0
        self.copy_busy_s = 0.0
        self._layer_gpu_end = 0.0

    # ---- memory ----
    def place(self, t: torch.Tensor) -> torch.Tensor:
        self.placed.append(_span(t))
        return t

    def on_device(self, t: torch.Tensor) -> bool:
        start, end = _span(t)
        return any(a <= start and end <= b for a, b in self.placed)

    def to_host(self, x: torch.Tensor) -> torch.Tensor:
        host = self.bus.rows(self.bus.up, x.shape[0], x)  # [n, H]
        return host.copy_(x)

    def to_device(self, ys: list[torch.Tensor]) -> torch.Tensor:
        host = self.bus.rows(self.bus.back, sum(len(y) for y in ys), ys[0])  # [sum n, H]
        return torch.cat(ys, out=host).clone()

    def _fill(self, key: Key, buf: Buffer) -> None:
        i, lay = self.bus.stage(key)
        self.buffers.bytes_of(buf)[: lay.nbytes].copy_(self.bus.ring.buffers[i][: lay.nbytes])
        self.buffers.mark(key, buf, lay)

    # ---- the layer ----
    def now(self) -> float:
        return self.clock

    def begin_layer(self) -> float:
        self.layer = _Layer(self.buffers)
        self._layer_gpu_end = self.clock
        return self.clock

    def preload(self, layer: int, expert: int, slot: int) -> None:
        """Fill a slot before the run starts (placement): ready at time 0."""
        self._fill((layer, expert), slot)

    def copy(self, layer: int, expert: int, slot: int | None) -> Buffer:
        """Copy expert (layer, expert) from the store into `slot` (or a staging buffer)."""
        buf = self.layer.target(slot)
        i = self.buffers.index(buf)
        free_at = self.buffers.grow(self.last_use, 0.0)[i]
        self._fill((layer, expert), buf)
        start = max(self.clock, self.copy_free, free_at)
        end = start + self.cost.t_copy()
        self.copy_free = self.buffers.grow(self.ready, 0.0)[i] = end
        self.copy_busy_s += end - start
        if self.keep_log:
            self.copies.append(CopyRecord((layer, expert), buf, start, end, free_at))
        return buf

    def run(self, x: torch.Tensor, layer: int, expert: int, buf: Buffer) -> _Pending:
        """Queue expert (layer, expert) on x [n, H] from `buf`, after its copy's event."""
        self.buffers.check_holder(buf, (layer, expert))
        i = self.buffers.index(buf)
        ready = self.ready[i]
        start = max(self.clock, self.gpu_free, ready)
        end = start + self.cost.t_gpu(x.shape[0])
        self.gpu_free = self._layer_gpu_end = self.last_use[i] = end
        self.gpu_busy_s += end - start
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
            assert r.start + 1e-12 >= r.ready, (
                f"{r.key} ran at {r.start} before its copy was ready at {r.ready}"
            )
        for c in self.copies:
            assert c.start + 1e-12 >= c.free_at, (
                f"copy of {c.key} overwrote buffer {c.buffer} while in use"
            )


# ---- CUDA --------------------------------------------------------------------------------------


class CUDAAccelerator:
    """Slots in GPU memory; experts copied on their own stream from the pinned staging ring, each
    gathered into it from pageable memory on the stager thread while the copy before it runs;
    experts run on a compute stream, each after its copy's event; the CPU experts' activations
    cross in one batched copy each way, through pinned buffers."""

    kind = "cuda"

    def __init__(self, store: ExpertStore, slots: int, cost: CostModel, device: str = "cuda"):
        if not torch.cuda.is_available():
            raise RuntimeError("CUDAAccelerator needs CUDA; use the emulated accelerator instead")
        self.cost, self.slots, self.device = cost, slots, torch.device(device)
        self.buffers = _Buffers(store, slots, self.device)
        self.bus = _Bus(store, self.buffers.size, pin=True)
        self.layer = _Layer(self.buffers)
        self.copy_stream = torch.cuda.Stream(self.device)
        self.compute_stream = torch.cuda.Stream(self.device)
        self.stager = ThreadPoolExecutor(1, "hybridmoe-stager")  # pageable -> pinned, in order
        self.ready: list = [None] * slots  # per buffer: (a future of) its last copy's event
        self.freed: list = [None] * slots  # per buffer: event after its last GPU use
        self._t0 = time.perf_counter()
        self.gpu_busy_s = 0.0  # measured by events per layer
        self.copy_busy_s = 0.0  # predicted (the copy stream is not timed, to avoid syncs)
        self._first = self._last = None

    # ---- memory ----
    def place(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.device)

    def on_device(self, t: torch.Tensor) -> bool:
        return t.device == self.device

    def to_host(self, x: torch.Tensor) -> torch.Tensor:
        """x [n, H] on the GPU -> the same rows in the pinned buffer, once they are there."""
        host = self.bus.rows(self.bus.up, x.shape[0], x)
        host.copy_(x, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        done.synchronize()  # the CPU experts read them now
        return host

    def to_device(self, ys: list[torch.Tensor]) -> torch.Tensor:
        """The CPU experts' outputs ([n, H] each), one after another, in one copy to the GPU."""
        host = self.bus.rows(self.bus.back, sum(len(y) for y in ys), ys[0])
        torch.cat(ys, out=host)
        out = torch.empty(host.shape, dtype=host.dtype, device=self.device)  # [sum n, H]
        out.copy_(host, non_blocking=True)
        self.bus.back.done = torch.cuda.Event()
        self.bus.back.done.record()  # the buffer is refilled only after this copy
        return out

    def _copy_job(self, key: Key, dst: torch.Tensor, freed) -> object:
        """On the stager thread: gather `key`'s bytes into a ring buffer (beside the DMA of the one
        before), then copy them to `dst` on the copy stream; the copy's event."""
        i, lay = self.bus.stage(key)
        with torch.cuda.stream(self.copy_stream):
            if freed is not None:  # the GPU must be done reading what this copy overwrites
                self.copy_stream.wait_event(freed)
            dst[: lay.nbytes].copy_(self.bus.ring.buffers[i][: lay.nbytes], non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.copy_stream)
        self.bus.ring.done[i] = event
        return event

    # ---- the layer ----
    def now(self) -> float:
        return time.perf_counter() - self._t0

    def begin_layer(self) -> float:
        self.layer = _Layer(self.buffers)
        self._first = self._last = None
        return self.now()

    def preload(self, layer: int, expert: int, slot: int) -> None:
        key = (layer, expert)
        self.buffers.mark(key, slot, layout(self.bus.store.get(*key)))
        self._copy_job(key, self.buffers.bytes_of(slot), None).synchronize()  # before any step

    def copy(self, layer: int, expert: int, slot: int | None) -> Buffer:
        key, buf = (layer, expert), self.layer.target(slot)
        i = self.buffers.index(buf)
        freed = self.buffers.grow(self.freed, None)[i]
        self.buffers.mark(key, buf, layout(self.bus.store.get(*key)))
        job = self.stager.submit(self._copy_job, key, self.buffers.bytes_of(buf), freed)
        self.buffers.grow(self.ready, None)[i] = job
        self.copy_busy_s += self.cost.t_copy()
        return buf

    def run(self, x: torch.Tensor, layer: int, expert: int, buf: Buffer) -> torch.Tensor:
        """Queue expert (layer, expert) on x [n, H] (on the GPU) from `buf`; its output [n, H]."""
        self.buffers.check_holder(buf, (layer, expert))
        i = self.buffers.index(buf)
        ready = self.ready[i]
        if isinstance(ready, Future):  # staged on the stager thread: wait until it is recorded
            ready = self.ready[i] = ready.result()
        self.compute_stream.wait_stream(torch.cuda.current_stream(self.device))  # x is ready
        with torch.cuda.stream(self.compute_stream):
            if ready is not None:
                self.compute_stream.wait_event(ready)
            self._mark_first()
            y = expert_ffn(x, self.buffers.weights(buf))  # [n, H]; blocks: quant/triton_dequant.py
            x.record_stream(self.compute_stream)
            done = torch.cuda.Event(enable_timing=True)
            done.record(self.compute_stream)
        self._last = self.freed[i] = done
        return y

    def _mark_first(self) -> None:
        if self._first is None:
            self._first = torch.cuda.Event(enable_timing=True)
            self._first.record(self.compute_stream)

    def gather(self, handles: list[torch.Tensor]) -> list[torch.Tensor]:
        main = torch.cuda.current_stream(self.device)
        main.wait_stream(self.compute_stream)
        for y in handles:
            y.record_stream(main)
        return handles

    def end_layer(self, cpu_seconds: float) -> float:
        self.compute_stream.synchronize()
        if self._first is not None and self._last is not None:
            self.gpu_busy_s += self._first.elapsed_time(self._last) / 1e3
        return self.now()

    def check(self) -> None:
        """Nothing to check: events enforce the order on a real GPU."""


# ---- no accelerator ----------------------------------------------------------------------------


class HostOnly:
    """No accelerator: a wall clock and zero slots. A plan that asks it for GPU work is a planner
    bug."""

    kind = "cpu"
    device = torch.device("cpu")
    slots = 0
    gpu_busy_s = 0.0
    copy_busy_s = 0.0

    def __init__(self):
        self._t0 = time.perf_counter()

    def place(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def on_device(self, t: torch.Tensor) -> bool:
        return True

    def to_host(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def to_device(self, ys: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat(ys)

    def now(self) -> float:
        return time.perf_counter() - self._t0

    def begin_layer(self) -> float:
        return self.now()

    def preload(self, layer, expert, slot):
        raise RuntimeError("placement on a machine without an accelerator: a planner bug")

    def copy(self, layer, expert, slot):
        raise RuntimeError(
            "a plan asked for a copy on a machine without an accelerator: a planner bug"
        )

    def run(self, x, layer, expert, buf):
        raise RuntimeError(
            "a plan put an expert on the GPU on a machine without one: a planner bug"
        )

    def gather(self, handles):
        return []

    def end_layer(self, cpu_seconds: float) -> float:
        return self.now()

    def check(self) -> None:
        """Nothing to check: no GPU work ever runs."""


def make_accelerator(
    device: str, store: ExpertStore, slots: int, cost: CostModel, keep_log: bool = False
) -> Accelerator:
    """device: "cuda" | "emulated" | "cpu" (already resolved from "auto" by the caller)."""
    if device == "cuda":
        return CUDAAccelerator(store, slots, cost)
    if device == "emulated":
        return EmulatedAccelerator(store, slots, cost, keep_log)
    return HostOnly()
