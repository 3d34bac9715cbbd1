"""Accelerators carry out the GPU side of a plan: expert slots, a copy stream, a compute stream.

An accelerator owns `slots` expert-sized buffers (the GPU expert cache's memory), a copy stream
that fills them from the store, and a compute stream that runs experts from them. A copy records
an event; a GPU expert waits for the event of the copy that filled its buffer, and a copy into a
buffer waits for the last GPU use of what it overwrites. Three implementations:

- `CUDAAccelerator`: real CUDA streams and events, slots in GPU memory;
- `EmulatedAccelerator`: the same slots, copies and events over CPU tensors, for machines without
  CUDA (and CI). Copies are real memory copies; time is a virtual clock driven by the cost model,
  so plans run exactly as they would on a GPU, and ordering mistakes are caught (`check`);
- `HostOnly`: no accelerator at all (every expert on the CPU); it refuses GPU work.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

import torch

from hybridmoe.experts.plan.cost_model import CostModel
from hybridmoe.experts.plan.shape import Key
from hybridmoe.experts.run.ffn import expert_ffn
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
    h = acc.run(x_rows, layer, expert, buf)   # buf: a slot number or what copy() returned
    ys = acc.gather([h, ...])                 # host tensors [n, H]
    finish = acc.end_layer(cpu_seconds)
    """

    kind: str
    slots: int
    gpu_busy_s: float  # seconds the compute stream worked, in total
    copy_busy_s: float  # seconds the copy stream worked, in total

    def now(self) -> float: ...
    def begin_layer(self) -> float: ...
    def preload(self, layer: int, expert: int, slot: int) -> None: ...
    def copy(self, layer: int, expert: int, slot: int | None) -> Buffer: ...
    def run(self, x: torch.Tensor, layer: int, expert: int, buf: Buffer) -> object: ...
    def gather(self, handles: list) -> list[torch.Tensor]: ...
    def end_layer(self, cpu_seconds: float) -> float: ...
    def check(self) -> None: ...


def _slabs(store: ExpertStore, count: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Buffers for `count` experts: gate_up [count, 2I, H],
    down [count, H, I] in the store's dtype."""
    s = store.shape
    gate_up = torch.empty((count, 2 * s.intermediate, s.hidden), dtype=store.dtype, device=device)
    down = torch.empty((count, s.hidden, s.intermediate), dtype=store.dtype, device=device)
    return gate_up, down


class _Buffers:
    """Slot and staging buffers, numbered together (slots first, then staging buffers as they are
    first needed), and which expert each one holds. Per-buffer state elsewhere is a list indexed
    by `index(buf)` and grown with `grow(list, fill)`."""

    def __init__(self, store: ExpertStore, slots: int, device):
        self.store, self.slots, self.device = store, slots, device
        self.gate_up, self.down = _slabs(store, slots, device)
        self.staging: list[ExpertWeights] = []
        self.holds: list[Key | None] = [None] * slots

    def index(self, buf: Buffer) -> int:
        return self.slots + buf.index if isinstance(buf, Staging) else buf

    def weights(self, buf: Buffer) -> ExpertWeights:
        i = self.index(buf)
        return (
            ExpertWeights(self.gate_up[i], self.down[i])
            if i < self.slots
            else self.staging[i - self.slots]
        )

    def staging_buffer(self, used: int) -> Staging:
        """The `used`-th staging buffer of this layer, allocated the first time it is needed."""
        if used == len(self.staging):
            gu, dn = _slabs(self.store, 1, self.device)
            self.staging.append(ExpertWeights(gu[0], dn[0]))
            self.holds.append(None)
        return Staging(used)

    def grow(self, values: list, fill) -> list:
        """`values`, one per buffer, extended with `fill` for staging buffers made since."""
        values.extend([fill] * (len(self.holds) - len(values)))
        return values

    def fill(self, key: Key, buf: Buffer) -> None:
        """A synchronous copy of the store's weights for `key` into `buf`."""
        src, dst = self.store.get(*key), self.weights(buf)
        dst.gate_up.copy_(src.gate_up)
        dst.down.copy_(src.down)
        self.holds[self.index(buf)] = key

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
    the CPU's measured time), from the slot's copy, with the same function as the CPU path.
    """

    kind = "emulated"

    def __init__(self, store: ExpertStore, slots: int, cost: CostModel, keep_log: bool = False):
        if not cost.has_gpu:
            raise ValueError(
                "the emulated accelerator needs a cost model with GPU and PCIe constants"
            )
        self.cost, self.slots = cost, slots
        self.buffers = _Buffers(store, slots, "cpu")
        self.layer = _Layer(self.buffers)
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

    def now(self) -> float:
        return self.clock

    def begin_layer(self) -> float:
        self.layer = _Layer(self.buffers)
        self._layer_gpu_end = self.clock
        return self.clock

    def preload(self, layer: int, expert: int, slot: int) -> None:
        """Fill a slot before the run starts (placement): ready at time 0."""
        self.buffers.fill((layer, expert), slot)

    def copy(self, layer: int, expert: int, slot: int | None) -> Buffer:
        """Copy expert (layer, expert) from the store into `slot` (or a staging buffer)."""
        buf = self.layer.target(slot)
        i = self.buffers.index(buf)
        free_at = self.buffers.grow(self.last_use, 0.0)[i]
        self.buffers.fill((layer, expert), buf)
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


@dataclass
class _CUDAHandle:
    out: torch.Tensor  # [n, H] pinned host tensor, filled asynchronously
    done: object  # torch.cuda.Event


class CUDAAccelerator:
    """Slots in GPU memory; copies on their own stream from pinned host memory, with events."""

    kind = "cuda"

    def __init__(self, store: ExpertStore, slots: int, cost: CostModel, device: str = "cuda"):
        if not torch.cuda.is_available():
            raise RuntimeError("CUDAAccelerator needs CUDA; use the emulated accelerator instead")
        self.cost, self.slots, self.device = cost, slots, torch.device(device)
        self.buffers = _Buffers(store, slots, self.device)
        self.layer = _Layer(self.buffers)
        self.copy_stream = torch.cuda.Stream(self.device)
        self.compute_stream = torch.cuda.Stream(self.device)
        self.ready: list = [None] * slots  # per buffer: event of the last copy into it
        self.freed: list = [None] * slots  # per buffer: event after its last GPU use
        self._t0 = time.perf_counter()
        self.gpu_busy_s = 0.0  # measured by events per layer
        self.copy_busy_s = 0.0  # predicted (the copy stream is not timed, to avoid syncs)
        self._first = self._last = None

    def now(self) -> float:
        return time.perf_counter() - self._t0

    def begin_layer(self) -> float:
        self.layer = _Layer(self.buffers)
        self._first = self._last = None
        return self.now()

    def preload(self, layer: int, expert: int, slot: int) -> None:
        self.buffers.fill((layer, expert), slot)  # synchronous: before the first step

    def copy(self, layer: int, expert: int, slot: int | None) -> Buffer:
        buf = self.layer.target(slot)
        i = self.buffers.index(buf)
        freed = self.buffers.grow(self.freed, None)[i]
        src, dst = self.buffers.store.get(layer, expert), self.buffers.weights(buf)
        with torch.cuda.stream(self.copy_stream):
            if freed is not None:  # the GPU must be done reading what this copy overwrites
                self.copy_stream.wait_event(freed)
            dst.gate_up.copy_(src.gate_up, non_blocking=True)
            dst.down.copy_(src.down, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.copy_stream)
        self.buffers.grow(self.ready, None)[i] = event
        self.buffers.holds[i] = (layer, expert)
        self.copy_busy_s += self.cost.t_copy()
        return buf

    def run(self, x: torch.Tensor, layer: int, expert: int, buf: Buffer) -> _CUDAHandle:
        self.buffers.check_holder(buf, (layer, expert))
        i = self.buffers.index(buf)
        out = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)  # [n, H]
        with torch.cuda.stream(self.compute_stream):
            if self.ready[i] is not None:
                self.compute_stream.wait_event(self.ready[i])
            self._mark_first()
            y = expert_ffn(
                x.to(self.device, non_blocking=True), self.buffers.weights(buf)
            )  # [n, H]
            out.copy_(y, non_blocking=True)
            done = torch.cuda.Event(enable_timing=True)
            done.record(self.compute_stream)
        self._last = self.freed[i] = done
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
        """Nothing to check: events enforce the order on a real GPU."""


# ---- no accelerator ----------------------------------------------------------------------------


class HostOnly:
    """No accelerator: a wall clock and zero slots. A plan that asks it for GPU work is a planner
    bug."""

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
