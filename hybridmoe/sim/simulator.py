"""Discrete-event replay of a routing trace through the real planner, on modelled hardware.

Three resources: the CPU pool, the GPU and the copy stream. For each step and MoE layer the
planner makes the same calls the engine makes (`plan(layer, routed, now, defer=True)`, then
`prepare`); the layer's truth comes from `machine.Machine`: the plan's times plus what the planner
does not model (DRAM shared between copies and CPU experts, a CPU-GPU synchronisation per layer,
expert deferral). Before its experts each layer runs its dense part (`dense.dense_cost`: attention
over the context, shared experts, router; the head once a step) while the copy stream keeps
working, then waits for its plan (the policy's measured cost for the layer's routed count, or a
fixed `plan_us`), and cannot end before the planner's deferred part has.

A batch of B is B sequences decoding together: the trace's requests (its "req" field) when it has
B of them, else B equal stretches of it, each taken as a sequence; step t decodes token t of each.

Fair protocol: the first `profile_tokens` steps only build statistics (placement, every
policy's warm start, the predictor); figures are reported on the rest, which nobody has seen.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field
from itertools import zip_longest

import numpy as np

from hybridmoe import tuning
from hybridmoe.errors import UserError
from hybridmoe.experts.plan.cache import PLACEMENTS, parse_budget
from hybridmoe.experts.plan.cost_model import CostModel
from hybridmoe.experts.plan.planner import Planner, Routed, make_planner
from hybridmoe.experts.plan.policies import POLICIES, make_policy
from hybridmoe.experts.plan.stats import read_stats
from hybridmoe.experts.plan.trace_format import TraceLine
from hybridmoe.sim.dense import DenseCost, dense_cost
from hybridmoe.sim.lookahead import step_hints
from hybridmoe.sim.machine import Machine
from hybridmoe.sim.shapes import ModelShape


@dataclass
class SimConfig:
    """One simulation. A field with a help text is also a flag of `hybridmoe simulate`."""

    policy: str = field(
        default="value", metadata={"help": "the policy simulated", "choices": (*POLICIES, "oracle")}
    )
    budget: str = field(
        default="0.1",
        metadata={
            "flag": "--gpu-expert-budget",
            "metavar": "SIZE",
            "help": "GPU memory for experts: bytes (6GB) or a fraction of expert bytes (0.1)",
        },
    )
    placement: str | None = field(
        default=None,
        metadata={"help": "start placement (default: the policy's)", "choices": PLACEMENTS},
    )
    profile_tokens: int | None = field(
        default=None,
        metadata={
            "metavar": "N",
            "help": "leading tokens that only build statistics (default: half of the trace)",
        },
    )
    batch: int = field(
        default=1, metadata={"help": "sequences decoded together per step (from the trace)"}
    )
    context: int = field(
        default=512,
        metadata={"metavar": "N", "help": "tokens of context each sequence attends over"},
    )
    defer_experts: int = field(
        default=0,
        metadata={
            "metavar": "N",
            "help": "CPU experts per layer whose result joins the next layer (expert deferral)",
        },
    )
    dense_s: float = 0.0  # extra non-expert seconds per layer, beside the modelled dense part
    router_hints: bool = True  # hand the planner a trace's look-ahead hint, where it has one
    plan_us: float | None = field(
        default=None,
        metadata={
            "metavar": "US",
            "help": "planner time per MoE layer on the critical path (default: the policy's "
            "measured cost for the layer's routed count, tuning.PLANNER_US; 0 leaves planning out)",
        },
    )
    expert_stats: str | None = field(
        default=None,
        metadata={
            "metavar": "FILE",
            "help": "activation statistics for placement instead of the trace's",
        },
    )


@dataclass
class SimResult:
    policy: str
    hardware: str
    quant: str
    budget: str
    slots: int
    tokens: int
    expert_ms_per_token: float
    plan_ms_per_token: float  # planning on the critical path
    prepare_ms_per_token: float  # the planner's deferred part, beside the experts
    dense_ms_per_token: float  # attention, shared experts, router, head
    tokens_per_s: float
    hit_rate: float
    copies_per_token: float
    pcie_mb_per_token: float
    cpu_busy: float
    gpu_busy: float
    prefetch_precision: float
    prefetches_per_token: float
    predictor_precision: float
    predictor_recall: float

    def to_json(self) -> dict:
        return asdict(self)


def step_lines(lines: list[TraceLine], batch: int) -> list[list[TraceLine]]:
    """The trace lines each step decodes: token t of each of `batch` sequences (the trace's
    requests when it has that many, each until it ends, else equal stretches of it)."""
    if batch == 1:
        return [[line] for line in lines]
    by_req: dict[object, list[TraceLine]] = {}
    for line in lines:
        by_req.setdefault(line.req, []).append(line)
    if None not in by_req and len(by_req) >= batch:
        # The longest requests; a step decodes those not finished yet, as a server's batch does.
        seqs = sorted(by_req.values(), key=len, reverse=True)[:batch]
        return [[x for x in group if x is not None] for group in zip_longest(*seqs)]
    n = len(lines) // batch
    seqs = [lines[i * n : (i + 1) * n] for i in range(batch)]
    return [list(group) for group in zip(*seqs)]


def steps_of(lines: list[TraceLine], batch: int) -> list[list[list[Routed]]]:
    """Per step and MoE layer, one Routed per distinct expert of the step's tokens."""
    steps = []
    for group in step_lines(lines, batch):
        layers = []
        for o in range(len(group[0].layers)):
            n, w = Counter(), Counter()
            for line in group:
                ids = line.layers[o]
                probs = line.probs[o] if line.probs else [1.0 / len(ids)] * len(ids)
                for e, p in zip(ids, probs):
                    n[e] += 1
                    w[e] += p
            layers.append([Routed(e, n[e], w[e]) for e in sorted(n)])
        steps.append(layers)
    return steps


def check_trace(lines: list[TraceLine], shape: ModelShape) -> None:
    e = shape.experts
    n_layers = len(lines[0].layers)
    if n_layers != shape.num_moe_layers:
        raise UserError(
            f"the trace has {n_layers} MoE layers but {shape.name} has {shape.num_moe_layers}; "
            "pass the matching --model-shape"
        )
    top = max(max(ids) for line in lines for ids in line.layers if ids)
    if top >= e.num_experts:
        raise UserError(
            f"the trace uses expert {top} but {shape.name} has {e.num_experts} experts; pass the "
            "matching --model-shape"
        )


def build(lines, shape: ModelShape, cost: CostModel, cfg: SimConfig, policy=None):
    """The planner, the steps, their look-ahead hints (sim/lookahead.py; None without), and where
    evaluation starts (policy: a Policy object or None)."""
    check_trace(lines, shape)
    steps = steps_of(lines, cfg.batch)
    hints = step_hints(step_lines(lines, cfg.batch)) if cfg.router_hints else None
    n_profile = len(steps) // 2 if cfg.profile_tokens is None else cfg.profile_tokens // cfg.batch
    if not 0 <= n_profile < len(steps):
        raise UserError(
            f"--profile-tokens must leave tokens to measure; the trace has {len(lines)} lines, "
            f"{len(steps)} steps of {cfg.batch}"
        )
    e = shape.experts
    total = cost.expert_bytes * e.num_experts * len(e.moe_layers)
    slots = parse_budget(cfg.budget, total, cost.expert_bytes)
    stats = read_stats(cfg.expert_stats) if cfg.expert_stats else None
    planner = make_planner(
        cost,
        list(e.moe_layers),
        e.num_experts,
        e.top_k,
        slots,
        policy or make_policy(cfg.policy),
        stats,
        cfg.placement,
        profile=steps[:n_profile],
        profile_hints=hints[:n_profile] if hints else None,
    )
    return planner, steps, hints, n_profile


@dataclass
class Clock:
    """Where the simulated time went, in seconds."""

    expert_s: float = 0.0  # from the end of planning to the layer's end, summed over layers
    plan_s: float = 0.0  # planning on the critical path (what the layer's experts waited for)
    prepare_s: float = 0.0  # the planner's deferred part (overlapped with the experts)
    dense_s: float = 0.0  # the dense part (attention, head, ...)


def planner_seconds(policy: str, routed: int) -> tuple[float, float]:
    """(critical, deferred) seconds of planning a layer with `routed` distinct experts: the
    policy's measured figures (tuning.PLANNER_US), interpolated linearly in the routed count and
    flat beyond the measured ones; nothing for a policy that was not measured (the oracles)."""
    points = tuning.PLANNER_US.get(policy)
    if not points:
        return 0.0, 0.0
    n = [p[0] for p in points]
    crit = float(np.interp(routed, n, [p[1] for p in points]))
    deferred = float(np.interp(routed, n, [p[2] for p in points]))
    return crit * 1e-6, deferred * 1e-6


def run(
    planner: Planner, steps, hints, start: int, machine: Machine, dense: DenseCost, cfg
) -> Clock:
    """Replay steps[start:] on `machine` (with hints[start:], the next layers' router scores, if
    not None); where the time went."""
    layers, out, name = planner.layers, Clock(), planner.policy.name
    clock = 0.0
    for s, step in enumerate(steps[start:], start):
        planner.begin_step()
        clock += dense.per_step_s
        out.dense_s += dense.per_step_s
        for o, routed in enumerate(step):
            clock += dense.per_layer_s + cfg.dense_s  # the copy stream works on meanwhile
            out.dense_s += dense.per_layer_s + cfg.dense_s
            if cfg.plan_us is None:
                crit, deferred = planner_seconds(name, len(routed))
            else:
                crit, deferred = cfg.plan_us * 1e-6, 0.0
            now = clock + crit
            plan = planner.plan(layers[o], routed, now=now, defer=True)
            planner.prepare(plan, hints[s][o] if hints else None)
            end = max(machine.layer(plan, now, last=o == len(step) - 1), now + deferred)
            planner.complete(plan, finished_at=end)
            out.expert_s += end - now
            out.plan_s += crit
            out.prepare_s += deferred
            clock = end
    return out


def simulate(lines, shape: ModelShape, cost: CostModel, cfg: SimConfig, policy=None) -> SimResult:
    """`cost` must already be costed for the shape's expert (CostModel.for_expert)."""
    check_trace(lines, shape)  # before the oracles read the trace with the shape's layers
    if policy is None and cfg.policy in ("belady", "oracle"):
        from hybridmoe.sim.oracle import future_policy

        policy = future_policy(cfg.policy, lines, shape, cfg.batch)
    planner, steps, hints, start = build(lines, shape, cost, cfg, policy)
    dense = dense_cost(shape, cost, cost.quant, cfg.batch, cfg.context)
    clock = run(planner, steps, hints, start, Machine(cost, cfg.defer_experts), dense, cfg)
    return summarise(planner, cfg, cost, clock, len(steps) - start)


def summarise(
    planner: Planner, cfg: SimConfig, cost: CostModel, clock: Clock, n_steps: int
) -> SimResult:
    s, p = planner.stats, planner.predictor.stats
    tokens = n_steps * cfg.batch
    expert_s = clock.expert_s
    wall = expert_s + clock.plan_s + clock.dense_s
    return SimResult(
        policy=planner.policy.name,
        hardware=cost.name,
        quant=cost.quant,
        budget=str(cfg.budget),
        slots=planner.cache.slots,
        tokens=tokens,
        expert_ms_per_token=1e3 * expert_s / tokens,
        plan_ms_per_token=1e3 * clock.plan_s / tokens,
        prepare_ms_per_token=1e3 * clock.prepare_s / tokens,
        dense_ms_per_token=1e3 * clock.dense_s / tokens,
        tokens_per_s=n_steps * cfg.batch / wall if wall else 0.0,
        hit_rate=s.hit_rate,
        copies_per_token=(s.demand_copies + s.prefetches_issued) / tokens,
        pcie_mb_per_token=s.bytes_copied / 1e6 / tokens,
        cpu_busy=s.cpu_busy_s / wall if wall else 0.0,
        gpu_busy=s.gpu_busy_s / wall if wall else 0.0,
        prefetch_precision=s.prefetch_precision,
        prefetches_per_token=s.prefetches_issued / tokens,
        predictor_precision=p.precision,
        predictor_recall=p.recall,
    )
