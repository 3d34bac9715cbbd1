"""The hybrid expert runtime: per layer and step, plan where each routed expert runs, then run it.

For one MoE layer the runtime (1) groups the routed tokens by expert, (2) asks the planner
(experts/plan/planner.py) for a plan, handing it the next layer's router applied to the current
hidden state (the hint its MoE block gives) as the predictor's input, (3) carries the plan out:
copies on the accelerator's copy stream, CPU experts on the CPU side (cpu_pool.py, as the CPU
runtime runs them) and GPU experts on the compute stream at the same time, each GPU expert after
its copy's event (accelerators.py), and (4) combines the weighted outputs exactly as the CPU
runtime does, so that placement never changes the output.

`make_runtime` is the one place that chooses a runtime: this one where there is an accelerator (CUDA
or emulated), else the CPU runtime. What is observed never chooses it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace

import torch

from hybridmoe import tuning
from hybridmoe.errors import UserError
from hybridmoe.experts.plan.cache import PLACEMENTS, parse_budget
from hybridmoe.experts.plan.cost_model import CostModel
from hybridmoe.experts.plan.planner import Plan, Routed, make_planner
from hybridmoe.experts.plan.policies import RUN_POLICIES, make_policy
from hybridmoe.experts.plan.profiles import PROFILES
from hybridmoe.experts.plan.shape import ExpertShape
from hybridmoe.experts.plan.stats import read_stats
from hybridmoe.experts.run.accelerators import make_accelerator
from hybridmoe.experts.run.ffn import combine, group_by_expert
from hybridmoe.experts.run.runtime import BaseRuntime, CPURuntime, ExpertRuntime
from hybridmoe.experts.run.runtime_stats import PLANNER_FIELDS, RuntimeStats

log = logging.getLogger("hybridmoe")


@dataclass
class HybridConfig:
    """Where experts run. A field with a help text is also a flag of the model commands
    (cli/options.py)."""

    policy: str | None = field(
        default=None,
        metadata={
            "help": "where experts run and what the GPU keeps (default: value with a budget, else "
            "cpu)",
            "choices": RUN_POLICIES,
        },
    )
    budget: str | None = field(
        default=None,
        metadata={
            "flag": "--gpu-expert-budget",
            "metavar": "SIZE",
            "help": "GPU memory for routed experts: bytes (6GB) or a fraction of all expert bytes "
            "(0.1)",
        },
    )
    placement: str | None = field(
        default=None,
        metadata={
            "help": "experts placed on the GPU at start (default: the policy's own)",
            "choices": PLACEMENTS,
        },
    )
    defer_experts: int = field(
        default=0,
        metadata={
            "metavar": "N",
            "help": "in decode, each token's N lowest-weight experts join the next MoE layer's "
            "output instead of their own (expert deferral; approximate, 0 = exact)",
        },
    )
    device: str = "cpu"  # "cuda" | "emulated" | "cpu" (resolved from --device auto by the caller)
    expert_stats: str | None = field(
        default=None,
        metadata={"metavar": "FILE", "help": "activation statistics for placement and warm start"},
    )
    cpu_workers: int | None = None  # CPU expert workers (None: one per torch thread)
    cpu_clock: str = (
        "measured"  # emulated: the CPU side of the virtual clock, "measured" or "model"
    )
    keep_log: bool = False  # emulated: keep every copy and GPU run (tests)
    history: int = 256  # per-step stats kept

    def __post_init__(self):
        self.budget = "0" if self.budget is None else self.budget
        if self.policy is None:
            self.policy = "cpu" if self.budget in ("0", 0) else "value"


def make_runtime(
    shape: ExpertShape, dtype: torch.dtype, config: HybridConfig, cost: CostModel | None
) -> ExpertRuntime:
    """The runtime `config` asks for: the hybrid one when there is an accelerator (CUDA or
    emulated), else the CPU one (cost: the calibrated cost model, needed only by the hybrid one)."""
    if config.defer_experts < 0:
        raise UserError("--defer-experts takes 0 or more experts")
    if config.device != "cpu":
        runtime = HybridRuntime(shape, dtype, config, cost)
    else:
        runtime = CPURuntime(shape, dtype, config.cpu_workers)
    runtime.defer_experts = config.defer_experts
    return runtime


def device_cost(cost: CostModel, device: str) -> CostModel:
    """The constants the planner uses on `device`: no GPU terms on the CPU; a GPU (emulated or real)
    borrows them from a named profile when the calibration measured none."""
    if device == "cpu":
        return cost.without_gpu()
    if not cost.has_gpu:
        if device == "cuda":
            log.warning(
                "the cost profile has no GPU figures; planning with %s's until `hybridmoe "
                "calibrate` is run on this machine",
                tuning.EMULATED_GPU,
            )
        g = PROFILES[tuning.EMULATED_GPU]
        return replace(
            cost,
            bw_gpu=g.bw_gpu,
            f_gpu=g.f_gpu,
            c_gpu=g.c_gpu,
            bw_pcie=g.bw_pcie,
            c_copy=g.c_copy,
            c_act=g.c_act,
        )
    return cost


class HybridRuntime(BaseRuntime):
    def __init__(
        self, shape: ExpertShape, dtype: torch.dtype, config: HybridConfig, cost: CostModel
    ):
        super().__init__(
            shape,
            dtype,
            RuntimeStats(config.device, config.policy, 0, config.history),
            config.cpu_workers,
        )
        self.config = config
        self.device_cost = device_cost(cost, config.device)
        # costed for the experts' format and bytes once the store is full (finish_loading)
        self.quant: str | None = None
        self.cost: CostModel | None = None
        self.planner = self.acc = None  # built in finish_loading, once the store is full

    def finish_loading(self) -> None:
        super().finish_loading()
        cfg, shape = self.config, self.shape
        # the format the experts are kept in and their bytes as stored (a file's mix of formats)
        self.quant = self.store.format()
        # Activations cross the bus in the model's dtype (t_act charges what _cpu_inputs moves).
        self.cost = replace(
            self.device_cost.for_expert(shape, self.quant, self.store.expert_nbytes()),
            act_bytes=self.store.dtype.itemsize,
        )
        stats = read_stats(cfg.expert_stats) if cfg.expert_stats else None
        if stats is not None and (
            stats.layers != self.layers or stats.num_experts != shape.num_experts
        ):
            raise UserError(
                f"{cfg.expert_stats} holds statistics of another model (layers or experts differ); "
                "write them for this model with --expert-stats-out"
            )
        # An expert costs its bytes as stored (a GGUF or --quant store keeps blocks): what a copy
        # moves and a slot holds.
        self.cost = replace(self.cost, expert_bytes=float(self.store.expert_nbytes()))
        policy = make_policy(cfg.policy)
        slots = 0
        if policy.uses_gpu and self.cost.has_gpu:
            slots = parse_budget(cfg.budget, self.store.total_nbytes(), self.store.expert_nbytes())
        self.planner = make_planner(
            self.cost,
            self.layers,
            shape.num_experts,
            shape.top_k,
            slots,
            policy,
            stats,
            cfg.placement,
        )
        self.acc = make_accelerator(
            cfg.device, self.store, self.planner.cache.slots, self.cost, cfg.keep_log
        )
        for key, slot in self.planner.cache.slot_of.items():
            self.acc.preload(key[0], key[1], slot)
        self.stats.slots = self.planner.cache.slots
        self.stats.predictor = self.planner.predictor.stats

    def begin_step(self, num_tokens, decode_rows) -> None:
        self.planner.begin_step()
        super().begin_step(num_tokens, decode_rows)

    # ---- where the rest of the model lives ----------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.acc.device

    def place(self, t: torch.Tensor) -> torch.Tensor:
        return self.acc.place(t)

    # ---- one layer ---------------------------------------------------------------------------
    def _layer(self, layer, x, topk_ids, topk_weights, hint, lora=None):
        """Plan and run one layer of x [T, H] on the accelerator's device; its output [T, H] there
        and what happened. Only the CPU experts' rows cross the bus: up in one copy, their outputs
        back in one (`_cpu_side`, what CostModel.t_act charges)."""
        if lora is not None:
            # GPU experts have no LoRA path yet; the CLI refuses expert adapters with this runtime
            raise ValueError("expert LoRA adapters run on the CPU expert runtime only")
        ids, weights = topk_ids.to("cpu"), topk_weights.to("cpu")  # [T, K]: planned on the host
        groups = group_by_expert(ids)
        rows_of = {e: rows for e, rows, _ in groups}
        routed = [
            Routed(e, len(rows), float(weights[rows, cols].sum())) for e, rows, cols in groups
        ]
        on_device = _groups_on(groups, x.device)
        device_rows = {e: rows for e, rows, _ in on_device}
        acc, before = self.acc, vars(self.planner.stats).copy()
        gpu_before, copy_before = acc.gpu_busy_s, acc.copy_busy_s
        start = acc.begin_layer()
        plan = self.planner.plan(layer, routed, now=start, defer=True, tokens=x.shape[0])
        staged = self._issue_copies(plan, plan.copies)
        cpu = self._run_cpu(layer, self._cpu_inputs(plan, x, rows_of, device_rows))
        gpu_order = plan.gpu_hits + sorted(plan.gpu_copied, key=lambda r: plan.ready[r.expert])
        handles = [
            acc.run(
                x[device_rows[r.expert]], layer, r.expert, self._buffer(layer, r.expert, staged)
            )
            for r in gpu_order
        ]
        # The planner's bookkeeping for the layers to come, and its background copies, while
        # this layer's experts run.
        self._issue_copies(plan, self.planner.prepare(plan, self._predict_next(layer, hint)))
        cpu_out, cpu_s = cpu.result()
        gpu_out = acc.gather(handles)
        if plan.cpu:  # the CPU experts' outputs, one after another, in one copy
            cpu_out = acc.to_device(cpu_out).split([r.n_tokens for r in plan.cpu])
        finish = acc.end_layer(self._cpu_clock(plan, cpu_s))
        self.planner.complete(plan, finished_at=finish)
        outputs = dict(zip((r.expert for r in plan.cpu), cpu_out))
        outputs.update(zip((r.expert for r in gpu_order), gpu_out))
        after = vars(self.planner.stats)
        report = {f: after[f] - before[f] for f in PLANNER_FIELDS}
        report.update(
            cpu_busy_s=cpu_s,
            gpu_busy_s=acc.gpu_busy_s - gpu_before,
            copy_busy_s=acc.copy_busy_s - copy_before,
            measured_s=finish - start,
        )
        return combine(outputs, on_device, x, ids, topk_weights), report

    def _cpu_inputs(self, plan: Plan, x, rows_of: dict, device_rows: dict) -> list:
        """(expert, its rows [n, H] in host memory) of each CPU expert, brought over in one copy:
        the experts' rows one after another, or all T rows when that is fewer (a token that
        several CPU experts share then crosses once). CostModel.t_act counts the same rows."""
        experts = [r.expert for r in plan.cpu]
        if not experts:
            return []
        counts = [r.n_tokens for r in plan.cpu]
        if sum(counts) <= x.shape[0]:
            picked = torch.cat([device_rows[e] for e in experts])  # [S]
            return list(zip(experts, self.acc.to_host(x[picked]).split(counts)))  # [n, H] each
        host = self.acc.to_host(x)  # [T, H]
        return [(e, host[rows_of[e]]) for e in experts]

    def _issue_copies(self, plan: Plan, copies) -> dict[int, object]:
        """`copies` on the copy stream, in order; the staging buffers of this layer they fill."""
        staged = {}
        for c in copies:
            buf = self.acc.copy(c.layer, c.expert, c.slot)
            if c.slot is None and c.layer == plan.layer:
                staged[c.expert] = buf
        return staged

    def _buffer(self, layer: int, expert: int, staged: dict):
        return staged[expert] if expert in staged else self.planner.cache.slot_of[(layer, expert)]

    def _cpu_clock(self, plan: Plan, cpu_s: float) -> float:
        """Seconds the CPU side took, for the emulated clock (a real device measures its own)."""
        if not plan.cpu:
            return 0.0
        if self.config.cpu_clock == "model":
            return plan.cpu_finish - plan.now
        return cpu_s + self.cost.t_act(sum(r.n_tokens for r in plan.cpu), plan.tokens)

    def _predict_next(self, layer: int, hint):
        """The next MoE layer's router on this layer's input, per-expert mean probability [E]
        (a numpy array), or None."""
        if hint is None or not self.planner.uses_gpu:
            return None
        return hint().mean(dim=0).float().cpu().numpy()  # [E]


def _groups_on(groups: list, device: torch.device) -> list:
    """group_by_expert's groups with their rows and columns on `device`, in one copy each."""
    if device.type == "cpu" or not groups:
        return groups
    counts = [len(rows) for _, rows, _ in groups]
    rows = torch.cat([g[1] for g in groups]).to(device).split(counts)  # [n] each
    cols = torch.cat([g[2] for g in groups]).to(device).split(counts)
    return [(e, r, c) for (e, _, _), r, c in zip(groups, rows, cols)]
