"""The hybrid expert runtime: per layer and step, plan where each routed expert runs, then run it.

For one MoE layer the runtime (1) groups the routed tokens by expert, (2) asks the planner
(experts/planner.py) for a plan, handing it the next layer's router applied to the current hidden
state as the predictor's input, (3) carries the plan out: copies on the accelerator's copy stream,
CPU experts on the worker pool and GPU experts on the compute stream at the same time, each GPU
expert after its copy's event (experts/executors.py), and (4) combines the weighted outputs in
increasing expert id with fp32 accumulation, exactly as CPURuntime does, so that placement never
changes the output.

It also replays routing traces (--routing-trace), records them (--record-trace), counts expert
activations (--expert-stats-out), and keeps `stats` (experts/runtime_stats.py).
"""

from __future__ import annotations

import atexit
import sys
from dataclasses import dataclass, replace
from functools import partial

import torch

from hybridmoe.experts.cache import ExpertStats, parse_budget, read_stats, write_stats
from hybridmoe.experts.cost_model import CostModel
from hybridmoe.experts.executors import CPUPool, make_accelerator
from hybridmoe.experts.planner import Routed, make_planner
from hybridmoe.experts.policies import make_policy
from hybridmoe.experts.profiles import PROFILES
from hybridmoe.experts.runtime import ExpertRuntime, combine_grouped, combine_token, expert_ffn, group_by_expert
from hybridmoe.experts.runtime_stats import RuntimeStats
from hybridmoe.experts.store import ExpertShape
from hybridmoe.experts.trace_io import RoutingReplay, TraceRecorder

DTYPE_QUANT = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
# The GPU an emulated accelerator pretends to be when the calibration has no GPU constants.
EMULATED_GPU = "rtx4090-ddr5"


@dataclass
class HybridConfig:
    policy: str = "cpu"
    budget: str = "0"  # bytes ("6GB") or a fraction of all routed-expert bytes ("0.1")
    placement: str | None = None  # None: the policy's default
    device: str = "cpu"  # "cuda" | "emulated" | "cpu" (resolved from "auto" by the caller)
    expert_stats: str | None = None  # activation statistics to place and warm up from
    expert_stats_out: str | None = None  # write this run's activation statistics here
    routing_trace: str | None = None  # take expert choices from this trace
    record_trace: str | None = None  # write this run's routing here
    cpu_workers: int = 1
    cpu_clock: str = "measured"  # emulated: the CPU side of the virtual clock, "measured" or "model"
    keep_log: bool = False  # emulated: keep every copy and GPU run (tests)
    history: int = 256  # per-step stats kept


def device_cost(cost: CostModel, device: str) -> CostModel:
    """The constants the planner uses on `device`: no GPU terms on the CPU; a GPU (emulated or real)
    borrows them from a named profile when the calibration measured none."""
    if device == "cpu":
        return cost.without_gpu()
    if not cost.has_gpu:
        if device == "cuda":
            print(f"hybridmoe: the cost profile has no GPU figures; planning with {EMULATED_GPU}'s until "
                  "`hybridmoe calibrate` is run on this machine", file=sys.stderr)
        g = PROFILES[EMULATED_GPU]
        return replace(cost, bw_gpu=g.bw_gpu, f_gpu=g.f_gpu, c_gpu=g.c_gpu, bw_pcie=g.bw_pcie,
                       c_copy=g.c_copy, c_act=g.c_act)
    return cost


def combine(outputs: dict[int, torch.Tensor], groups, x, topk_ids, topk_weights) -> torch.Tensor:
    """The weighted sum of expert outputs [T, H], with CPURuntime's arithmetic to the bit (fp32): one
    token as a [1, K] @ [K, H] product in top-k order, more tokens added in expert order."""
    if x.shape[0] == 1:
        return combine_token(x, [outputs[e] for e in topk_ids[0].tolist()], topk_weights)
    return combine_grouped(x, groups, [outputs[expert] for expert, _, _ in groups], topk_weights)


class HybridRuntime(ExpertRuntime):
    def __init__(self, shape: ExpertShape, dtype: torch.dtype, config: HybridConfig, cost: CostModel):
        super().__init__(shape, dtype)
        self.config = config
        self.quant = DTYPE_QUANT.get(dtype, "bf16")
        self.cost = device_cost(cost, config.device).for_expert(shape, self.quant)
        self.layers = list(shape.moe_layers)
        self.ordinal = {layer: i for i, layer in enumerate(self.layers)}
        self.blocks: dict[int, object] = {}  # layer -> its MoE block (router), see attach_routers
        self.pool = CPUPool(config.cpu_workers)
        self.activations = ExpertStats(self.layers, shape.num_experts)
        self.replay = None
        if config.routing_trace:
            self.replay = RoutingReplay.from_file(config.routing_trace, len(self.layers), shape.num_experts, shape.top_k)
        self.recorder = TraceRecorder(config.record_trace, len(self.layers)) if config.record_trace else None
        self.planner = self.acc = None  # built in finish_loading, once the store is full
        self.stats = RuntimeStats(config.device, config.policy, 0, config.history)
        self._last_ordinal = len(self.layers)
        self._rows = None
        self._closed = False

    # ---- set-up ------------------------------------------------------------------------------
    def finish_loading(self) -> None:
        super().finish_loading()
        cfg, shape = self.config, self.shape
        stats = read_stats(cfg.expert_stats) if cfg.expert_stats else None
        if stats is not None and (stats.layers != self.layers or stats.num_experts != shape.num_experts):
            from hybridmoe.errors import UserError

            raise UserError(f"{cfg.expert_stats} holds statistics of another model (layers or experts differ); "
                            "write them for this model with --expert-stats-out")
        policy = make_policy(cfg.policy)
        slots = 0
        if policy.uses_gpu and self.cost.has_gpu:
            slots = parse_budget(cfg.budget, self.store.total_nbytes(), self.store.expert_nbytes())
        placement = cfg.placement
        if placement is None and stats is None and policy.pin_placement:
            placement = "uniform"  # a static set needs an order; without statistics, spread it evenly
        self.planner = make_planner(self.cost, self.layers, shape.num_experts, shape.top_k, slots, policy,
                                    stats, placement)
        self.acc = make_accelerator(cfg.device, self.store, self.planner.cache.slots, self.cost, cfg.keep_log)
        for key, slot in self.planner.cache.slot_of.items():
            self.acc.preload(key[0], key[1], slot)
        self.stats.slots = self.planner.cache.slots
        self._wants_prediction = policy.uses_gpu and self.cost.has_gpu
        atexit.register(self.close)

    def attach_routers(self, blocks: dict[int, object]) -> None:
        """The model's MoE blocks by layer: their routers feed the predictor (`router_probs(x)` [T, E])
        and routing replay (`weights_at(x, ids)` [T, K]); layers/moe.py defines both."""
        self.blocks = dict(blocks)

    def _block(self, layer: int):
        if layer not in self.blocks:
            raise RuntimeError(f"routing replay needs the router of layer {layer}; the model did not attach its MoE blocks")
        return self.blocks[layer]

    def begin_step(self, num_tokens: int, decode_rows: list[tuple[int, str]]) -> None:
        """For --record-trace: (row, request id) of the decode tokens of the next step."""
        self._rows = decode_rows

    # ---- the seam ----------------------------------------------------------------------------
    def forward(self, layer, x, topk_ids, topk_weights):
        """x: [T, H], topk_ids: [T, K], topk_weights: [T, K] -> [T, H]."""
        o = self.ordinal[layer]
        if o <= self._last_ordinal:
            self._begin_step(x.shape[0])
        self._last_ordinal = o
        if self.replay is not None:
            topk_ids = self.replay.ids(o)  # [T, K]
            topk_weights = self._block(layer).weights_at(x, topk_ids)  # [T, K], the router's own weights
        self._observe(o, topk_ids, topk_weights)
        groups = group_by_expert(topk_ids)
        outputs = self._execute(layer, x, groups, topk_weights)
        return combine(outputs, groups, x, topk_ids, topk_weights)

    def _begin_step(self, n_rows: int) -> None:
        self.refresh_stats()
        self.stats.begin_step(n_rows)
        self.activations.tokens += n_rows
        if self.replay is not None:
            self.replay.begin_step(n_rows)
        if self.recorder is not None:
            self.recorder.begin_step(n_rows, self._rows)
        self._rows = None

    def _observe(self, o: int, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> None:
        self.activations.record(o, topk_ids.reshape(-1).tolist())
        if self.recorder is not None:
            self.recorder.add(o, topk_ids, topk_weights)

    # ---- one layer ---------------------------------------------------------------------------
    def _execute(self, layer, x, groups, topk_weights) -> dict[int, torch.Tensor]:
        """Plan and run one layer; expert id -> its output [n, H]."""
        rows_of = {e: rows for e, rows, _ in groups}
        routed = [Routed(e, len(rows), float(topk_weights[rows, cols].sum())) for e, rows, cols in groups]
        predicted = self._predict_next(layer, x)
        acc, before = self.acc, vars(self.planner.stats).copy()
        gpu_before, copy_before = acc.gpu_busy_s, acc.copy_busy_s
        start = acc.begin_layer()
        plan = self.planner.plan(layer, routed, now=start, predicted=predicted)
        staged = self._issue_copies(plan)
        cpu = self.pool.submit([partial(expert_ffn, x[rows_of[r.expert]], self.store.get(layer, r.expert))
                                for r in plan.cpu])
        gpu_order = plan.gpu_hits + sorted(plan.gpu_copied, key=lambda r: plan.ready[r.expert])
        handles = [acc.run(x[rows_of[r.expert]], layer, r.expert, self._buffer(layer, r.expert, staged))
                   for r in gpu_order]
        cpu_out, cpu_s = cpu.result()
        gpu_out = acc.gather(handles)
        finish = acc.end_layer(self._cpu_clock(plan, cpu_s))
        self.planner.complete(plan, finished_at=finish)
        self.stats.add_layer(before, vars(self.planner.stats), {
            "cpu_busy_s": cpu_s, "gpu_busy_s": acc.gpu_busy_s - gpu_before,
            "copy_busy_s": acc.copy_busy_s - copy_before, "measured_s": finish - start})
        outputs = dict(zip((r.expert for r in plan.cpu), cpu_out))
        outputs.update(zip((r.expert for r in gpu_order), gpu_out))
        return outputs

    def _issue_copies(self, plan) -> dict[int, object]:
        """Demand copies, then prefetches, on the copy stream; the staging buffers of this layer."""
        staged = {}
        for c in plan.copies + plan.prefetches:
            buf = self.acc.copy(c.layer, c.expert, c.slot)
            if c.slot is None and c.layer == plan.layer:
                staged[c.expert] = buf
        return staged

    def _buffer(self, layer: int, expert: int, staged: dict):
        return staged[expert] if expert in staged else self.planner.cache.slot_of[(layer, expert)]

    def _cpu_clock(self, plan, cpu_s: float) -> float:
        """Seconds the CPU side took, for the emulated clock (a real device measures its own)."""
        if not plan.cpu:
            return 0.0
        if self.config.cpu_clock == "model":
            return plan.cpu_finish - plan.now
        return cpu_s + self.cost.t_act(max(r.n_tokens for r in plan.cpu))

    def _predict_next(self, layer: int, x: torch.Tensor):
        """The next MoE layer's router on this layer's input: per-expert probability, or None."""
        o = self.ordinal[layer]
        if not self._wants_prediction or o + 1 >= len(self.layers):
            return None
        block = self.blocks.get(self.layers[o + 1])
        if block is None:
            return None
        return block.router_probs(x).mean(dim=0).tolist()  # [E]

    # ---- the end -----------------------------------------------------------------------------
    def refresh_stats(self) -> RuntimeStats:
        """Bring the predictor's figures into `stats` (they live in the planner's predictor)."""
        p = self.planner.predictor.stats if self.planner else None
        if p is not None:
            self.stats.predictor = {"precision": p.precision, "recall": p.recall}
        return self.stats

    def close(self) -> None:
        """Write what was asked for (trace, activation statistics); idempotent."""
        if self._closed:
            return
        self._closed = True
        self.stats.end_step()
        self.refresh_stats()
        if self.recorder is not None:
            self.recorder.close()
        if self.config.expert_stats_out:
            try:
                write_stats(self.config.expert_stats_out, self.activations)
            except OSError as e:
                print(f"hybridmoe: could not write {self.config.expert_stats_out} ({e.strerror})", file=sys.stderr)
        self.pool.close()
