"""The seam between the models and the experts: an MoE block hands its routed tokens to a runtime.

A runtime owns an ExpertStore and, for one layer, turns (hidden states, top-k ids, top-k weights)
into the weighted sum of the chosen experts' outputs. Two runtimes implement `ExpertRuntime`:
`CPURuntime` (here: every expert on the CPU, the reference every other runtime must agree with to
the bit) and `HybridRuntime` (hybrid_runtime.py: a planner puts each expert on the CPU or the GPU).

Steps. The model's forward pass calls `begin_step` before its first layer, on the thread that runs
the pass (the engine may run two passes at once on two threads; each has its own `Step`). Every
MoE layer then calls `forward`; after the last one the step ends.

Observers watch a runtime without changing what it runs: its `stats` (always there), and what a
caller attaches with `add_observer` (trace recording and replay, activation counts: observers.py).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Protocol

import torch

from hybridmoe import native
from hybridmoe.experts.plan.shape import ExpertShape
from hybridmoe.experts.run.cpu_pool import CPUExperts
from hybridmoe.experts.run.expert_grad import TrainLoRA, expert_layer
from hybridmoe.experts.run.ffn import (
    bf16_kernels_take,
    blocks_together,
    combine_grouped,
    combine_token,
    expert_ffn,
    experts_ffn,
    group_by_expert,
)
from hybridmoe.experts.run.lora import RowLoRA, expert_rows
from hybridmoe.experts.run.runtime_stats import RuntimeStats
from hybridmoe.experts.run.store import ExpertStore
from hybridmoe.native import quant as quant_kernels
from hybridmoe.quant.tensor import QTensor

# hint(h=1): the h-th next MoE layer's router applied to this layer's input, [T, E] probabilities
# (None past the last layer), computed only if asked (the predictor asks for h = 1, a trace
# recorder for more): what layers/moe.py hands `forward` as `hint`.
Hint = Callable[..., torch.Tensor | None]


@dataclass
class Step:
    """One forward pass of the batch, as the runtime and its observers see it."""

    num_tokens: int
    decode_rows: list[tuple[int, str]]  # (row, request id) of its decode tokens
    notes: dict = field(
        default_factory=dict
    )  # each observer's state for this step, under its own key


class Observer(Protocol):
    """Watches a runtime's steps and layers; never changes what runs."""

    def begin_step(self, step: Step) -> None: ...
    def on_layer(
        self,
        step: Step,
        ordinal: int,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        report: dict[str, float],
        hint: Hint | None = None,
    ) -> None: ...
    def end_step(self, step: Step) -> None: ...
    def close(self) -> None: ...


class ExpertRuntime(Protocol):
    """What models, the engine and the CLI use of a runtime; nothing else is probed for."""

    shape: ExpertShape
    store: ExpertStore
    stats: RuntimeStats
    reentrant: bool  # whether two forward passes may run at once (the engine's overlap_prefill)
    device: torch.device  # where the dense model lives (CausalLM.place)

    def finish_loading(self) -> None: ...
    def place(self, t: torch.Tensor) -> torch.Tensor: ...  # a dense weight or KV pool, on `device`
    def begin_step(self, num_tokens: int, decode_rows: list[tuple[int, str]]) -> None: ...
    def forward(
        self,
        layer: int,
        x: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        hint: Hint | None = None,
        lora: RowLoRA | TrainLoRA | None = None,
    ) -> torch.Tensor: ...
    def add_observer(self, observer: Observer) -> None: ...
    def close(self) -> None: ...


_DEFERRED = "deferred experts"  # Step.notes key: the previous layer's deferred experts


def _all_decode(step: Step) -> bool:
    return bool(step.decode_rows) and len(step.decode_rows) == step.num_tokens


def _split_deferred(topk_ids: torch.Tensor, topk_weights: torch.Tensor, n: int):
    """Expert deferral (KTransformers, SOSP'25): each token's `n` experts of lowest router weight
    leave this layer and join the next one's output, so that the CPU computes them while the next
    layer's attention runs. (ids [T, K-n], weights [T, K-n]) kept, and (ids, weights) [T, n]
    deferred, each in the original top-k order."""
    n = min(n, topk_ids.shape[1] - 1)  # a token keeps at least one expert in its own layer
    low = torch.argsort(topk_weights, dim=1, stable=True)[:, :n]  # [T, n]
    deferred = torch.zeros_like(topk_ids, dtype=torch.bool).scatter_(1, low, True)  # [T, K]
    keep, later = ~deferred, deferred
    t, k = topk_ids.shape
    return (
        topk_ids[keep].view(t, k - n),
        topk_weights[keep].view(t, k - n),
        (topk_ids[later].view(t, n), topk_weights[later].view(t, n)),
    )


def _in_blocks(w) -> bool:
    """Whether an expert's weights are QTensors the integer kernels read in place (on the CPU)."""
    return (
        isinstance(w.gate_up, QTensor)
        and isinstance(w.down, QTensor)
        and w.gate_up.parts[0].is_cpu
        and w.down.parts[0].is_cpu
        and quant_kernels.available()
    )


class _ThreadStep(threading.local):
    step: Step | None = None  # the step in progress on this thread


class BaseRuntime:
    """Steps, observers, stats and the CPU side, shared by both runtimes; subclasses say in `_layer`
    where each expert of a layer runs."""

    reentrant = False

    def __init__(
        self,
        shape: ExpertShape,
        dtype: torch.dtype,
        stats: RuntimeStats,
        cpu_workers: int | None = None,
    ):
        self.shape = shape
        self.store = ExpertStore(shape, dtype)
        self.layers = list(shape.moe_layers)
        self.ordinal = {layer: i for i, layer in enumerate(self.layers)}
        self.cpu = CPUExperts(cpu_workers)
        self.stats = stats
        self.observers: list[Observer] = [stats]
        self._local = _ThreadStep()
        self._closed = False
        self.defer_experts = 0  # expert deferral in decode steps (set by make_runtime)

    def finish_loading(self) -> None:
        """Called once every expert is in the store."""
        missing = self.store.missing()
        if missing:
            layer, expert = missing[0]
            raise ValueError(
                f"no weights were loaded for expert {expert} of layer {layer} ({len(missing)} "
                "missing)"
            )

    # Where the rest of the model (embeddings, attention, KV cache, norms, routers, shared experts,
    # the head) lives, and how a tensor is put there: the host here; the accelerator's device with
    # the hybrid runtime.
    device = torch.device("cpu")

    def place(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def add_observer(self, observer: Observer) -> None:
        self.observers.append(observer)

    def begin_step(self, num_tokens: int, decode_rows: list[tuple[int, str]]) -> None:
        self._local.step = step = Step(num_tokens, list(decode_rows))
        for observer in self.observers:
            observer.begin_step(step)

    def forward(self, layer, x, topk_ids, topk_weights, hint=None, lora=None):
        """x: [T, H], topk_ids: [T, K], topk_weights: [T, K] -> [T, H] weighted sum of expert
        outputs. `lora`: the rows' expert adapters (RowLoRA), or a training step's (TrainLoRA:
        every expert on the CPU, differentiable, experts/run/expert_grad.py)."""
        step = self._step()
        o = self.ordinal[layer]
        if isinstance(lora, TrainLoRA):
            out, report = self._train_layer(layer, x, topk_ids, topk_weights, lora)
        else:
            out, report = self._defer_layer(step, o, layer, x, topk_ids, topk_weights, hint, lora)
        self._observe(step, o, topk_ids, topk_weights, report, hint)
        return out

    def decode_key(self) -> tuple:
        """What token_experts' answers depend on that may change between two steps: the store's
        version, the deferral, the experts' threads now (a model's decode plans are kept under it:
        models/base.py CausalLM._plan)."""
        return (self.store.version, self.defer_experts, self.cpu.workers_now())

    def token_experts(self, layer: int) -> tuple[torch.Tensor, int, bool] | None:
        """(the layer's expert table, threads, whether its experts are in blocks) where a model's
        block may run a decode token's routed experts in its own native calls exactly as this
        runtime would run them (_expert_table says which table: native.moe_tokens' and
        native.shared_moe_token's for plain bf16 experts, quant_kernels.moe_tokens' for blocks);
        else None, and the block calls `forward`. The block then calls `ran_token`."""
        return None

    def ran_token(
        self,
        layer: int,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        seconds: float,
        hint: Hint | None = None,
    ) -> None:
        """What `forward` tells the observers, for tokens whose experts ran through
        `token_experts`' table (ids [T, K], weights [T, K]: each a router's top-k, distinct
        experts; hint as `forward` takes it): as `_layer` reports them, every distinct expert run
        once on the CPU."""
        n = topk_ids.shape[1] if topk_ids.shape[0] == 1 else len(set(topk_ids.view(-1).tolist()))
        report = {
            "routed": n,
            "misses": n,
            "cpu_runs": n,
            "cpu_busy_s": seconds,
            "measured_s": seconds,
        }
        self._observe(self._step(), self.ordinal[layer], topk_ids, topk_weights, report, hint)

    def _step(self) -> Step:
        step = self._local.step
        if step is None:
            raise RuntimeError(
                "an MoE layer ran outside a step: the model's forward must call begin_step first"
            )
        return step

    def _observe(self, step: Step, o: int, topk_ids, topk_weights, report: dict, hint) -> None:
        """The observers see layer ordinal o; after the last layer the step ends."""
        for observer in self.observers:
            observer.on_layer(step, o, topk_ids, topk_weights, report, hint)
        if o == len(self.layers) - 1:
            self._local.step = None
            for observer in self.observers:
                observer.end_step(step)

    def _layer(
        self, layer, x, topk_ids, topk_weights, hint, lora: RowLoRA | None = None
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """The layer's output [T, H], and what happened (RuntimeStats' fields) for the observers."""
        raise NotImplementedError

    def _defer_layer(self, step, o, layer, x, topk_ids, topk_weights, hint, lora):
        """`_layer`, with each decode token's `defer_experts` lowest-weight experts started on the
        CPU to join the next MoE layer's output, and the previous layer's joined to this one's.
        Rows with LoRA adapters run every expert in their layer."""
        ids, weights = topk_ids, topk_weights
        defer = self.defer_experts and lora is None and o < len(self.layers) - 1
        if defer and _all_decode(step):
            ids, weights, later = _split_deferred(topk_ids, topk_weights, self.defer_experts)
        out, report = self._layer(layer, x, ids, weights, hint, lora)
        earlier = step.notes.pop(_DEFERRED, None)
        if earlier is not None:  # the previous layer's deferred experts join the stream here
            out = out + earlier()
        if ids is not topk_ids:
            step.notes[_DEFERRED] = self._defer(layer, x, *later)
        return out, report

    def _defer(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor):
        """Start the deferred experts ids [T, N] on the CPU; a callable that waits for them and
        returns their weighted sum [T, H] (what the next MoE layer adds to its output)."""
        groups, host = group_by_expert(ids.to("cpu")), x.to("cpu")  # [T, H] on the host
        job = self._run_cpu(layer, [(e, host[rows]) for e, rows, _ in groups])
        weights = weights.to("cpu")
        return lambda: combine_grouped(host, groups, job.result()[0], weights).to(x)

    def _train_layer(self, layer, x, topk_ids, topk_weights, lora: TrainLoRA):
        """A training step's layer: every expert on the CPU through expert_grad.expert_layer."""
        t0 = time.perf_counter()
        out = expert_layer(self.cpu, self.store, layer, x, topk_ids, topk_weights, lora.lora)
        n, seconds = len(topk_ids.unique()), time.perf_counter() - t0
        return out, {
            "routed": n,
            "misses": n,
            "cpu_runs": n,
            "cpu_busy_s": seconds,
            "measured_s": seconds,
        }

    def _run_cpu(
        self,
        layer: int,
        inputs: list[tuple[int, torch.Tensor]],
        rows: list[torch.Tensor] | None = None,
        lora: RowLoRA | None = None,
    ):
        """Start (expert, rows [n, H]) pairs on the CPU; `.result()` -> (outputs, busy seconds).
        With `lora`, the pairs' row indices `rows` say which rows use which adapter."""
        pairs = [(x, self.store.get(layer, e)) for e, x in inputs]
        if lora is None and blocks_together(pairs):  # the integer kernels take them in one call
            return self.cpu.start_call(partial(experts_ffn, pairs))
        jobs = []
        for i, ((e, _), (x, w)) in enumerate(zip(inputs, pairs)):
            which = lora.rows(rows[i]) if lora is not None else None
            if which is None:
                jobs.append(partial(expert_ffn, x, w))
            else:
                jobs.append(partial(expert_rows, x, w, e, which, lora.loras))
        return self.cpu.start(jobs, len(jobs) * self.store.expert_nbytes())

    def close(self) -> None:
        """Close the observers (write what they were asked to) and the CPU pool; idempotent."""
        if self._closed:
            return
        self._closed = True
        for observer in self.observers:
            observer.close()
        self.cpu.close()


def mix_tokens(table, blocks: bool, ids, weights, x, inter: int, workers: int):
    """Tokens x [T, H] through their routed experts and the weighted sums, [T, H], in one native
    call where the kernels take x: quant_kernels.moe_tokens for experts in blocks (bf16 or fp32
    rows, any count), native.moe_tokens for plain bf16 experts (bf16 rows where expert_ffn gives
    every expert's rows to the bf16 kernels: one, up to native.MAX_ROWS, any count where each row
    is computed as if alone); else None. table: CPURuntime._expert_table's; ids [T, K] int64,
    weights [T, K] fp32, contiguous."""
    if blocks and x.dtype in (torch.bfloat16, torch.float32):
        return quant_kernels.moe_tokens(table, ids, weights, x, inter, workers)
    if not blocks and bf16_kernels_take(x):
        return native.moe_tokens(table, ids, weights, x, inter, workers)
    return None


class CPURuntime(BaseRuntime):
    """Every routed expert runs on the CPU (cpu_pool.py says where: inline or on the workers)."""

    reentrant = True  # no state between calls but the observers', which keep theirs per step

    def __init__(
        self, shape: ExpertShape, dtype: torch.dtype = torch.float32, cpu_workers: int | None = None
    ):
        super().__init__(shape, dtype, RuntimeStats("cpu", "cpu", 0), cpu_workers)
        self._tables: dict[int, tuple[int, tuple]] = {}  # _expert_table's

    def _mix_tokens(self, layer, x, topk_ids, topk_weights):
        """The tokens' experts and their weighted sums in one native call: a decode token's
        (native.moe_tokens for bf16 experts) and a decode token's or prefill chunk's in blocks
        (quant_kernels.moe_tokens): the bits of experts_ffn then combine_token or combine_grouped;
        or None where that does not apply: (output [T, H], expert ids, busy seconds)."""
        if not (
            x.is_contiguous()
            and x.is_cpu
            and topk_ids.dtype == torch.int64
            and topk_weights.dtype == torch.float32
            and topk_ids.is_contiguous()
            and topk_weights.is_contiguous()
        ):
            return None
        table, blocks = self._expert_table(layer)
        if table is None:
            return None
        inter, workers = self.shape.intermediate, self.cpu.workers_now()
        t0 = time.perf_counter()
        out = mix_tokens(table, blocks, topk_ids, topk_weights, x, inter, workers)
        if out is None:
            return None
        experts = topk_ids[0].tolist() if x.shape[0] == 1 else topk_ids.unique().tolist()
        return out, experts, time.perf_counter() - t0

    def token_experts(self, layer: int) -> tuple[torch.Tensor, int, bool] | None:
        if self.defer_experts:  # _defer_layer moves experts between layers
            return None
        table, blocks = self._expert_table(layer)
        return None if table is None else (table, self.cpu.workers_now(), blocks)

    def _expert_table(self, layer: int) -> tuple[torch.Tensor | None, bool]:
        """The layer's expert table and whether its experts are in blocks: int64 [E, 2] of each
        expert's gate_up and down pointers where every expert is a plain bf16 matrix pair, quant.c's
        [E, 7] (quant_kernels.expert_table) where every one is a pair of QTensors the integer
        kernels take; else None. Kept until the store changes."""
        cached = self._tables.get(layer)
        if cached is not None and cached[0] == self.store.version:
            return cached[1]
        pairs = [self.store.records.get((layer, e)) for e in range(self.shape.num_experts)]
        table, blocks = None, False
        if all(w is not None and native.weights_apply(w.gate_up, w.down) for w in pairs):
            ptrs = [[w.gate_up.data_ptr(), w.down.data_ptr()] for w in pairs]
            table = torch.tensor(ptrs, dtype=torch.int64)  # [E, 2]
        elif all(w is not None and _in_blocks(w) for w in pairs):
            table, blocks = quant_kernels.expert_table([(w.gate_up, w.down) for w in pairs]), True
        self._tables[layer] = (self.store.version, (table, blocks))
        return table, blocks

    def _layer(self, layer, x, topk_ids, topk_weights, hint, lora=None):
        t0 = time.perf_counter()
        mixed = self._mix_tokens(layer, x, topk_ids, topk_weights) if lora is None else None
        if mixed is not None:
            out, experts, busy = mixed
        elif x.shape[0] == 1:
            # Decode: one token, so no grouping, gathering or scattering.
            experts = topk_ids[0].tolist()
            row = [torch.zeros(1, dtype=torch.long)] * len(experts)
            ys, busy = self._run_cpu(
                layer, [(e, x) for e in experts], row, lora
            ).result()  # [1, H] each
            out = combine_token(x, ys, topk_weights, topk_ids)
        else:
            groups = group_by_expert(topk_ids)
            experts = [e for e, _, _ in groups]
            ys, busy = self._run_cpu(
                layer, [(e, x[rows]) for e, rows, _ in groups], [g[1] for g in groups], lora
            ).result()  # [n, H] each
            out = combine_grouped(x, groups, ys, topk_weights)
        n = len(set(experts))
        return out, {
            "routed": n,
            "misses": n,
            "cpu_runs": n,
            "cpu_busy_s": busy,
            "measured_s": time.perf_counter() - t0,
        }
