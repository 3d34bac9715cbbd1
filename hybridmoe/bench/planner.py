"""`hybridmoe bench planner`: what one `Planner.plan()` call costs, per policy, shape and batch.

Each planner is built as the engine builds it (`make_planner`, a 10% GPU expert budget, warmed on
synthetic traces of the model's shape), then plans the following steps layer by layer, with the
next layer's router probabilities as the engine hands them in. Per MoE layer it times
`plan(defer=True)`, what the layer's experts wait for, and `prepare()`, which the engine runs
while they compute: the CPU time of the calling thread, so that other processes on a shared machine
do not count. A decode batch is one token of each of B sequences; a prefill chunk, C
consecutive tokens of one. Run it pinned to one core (`--cpu`) on an idle machine.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import asdict, dataclass

import numpy as np

from hybridmoe.errors import UserError

POLICIES = ("cpu", "static", "fiddler", "hybrimoe", "lru", "lfu", "value")
SHAPES = ("qwen3-30b-a3b", "olmoe-1b-7b")
BATCHES = (1, 8)
CHUNKS = (512,)
WARM_TOKENS = 128  # tokens of the trace the planner learns from before it is timed


def add_parser(sub) -> None:
    p = sub.add_parser(
        "planner",
        help="per-call time of the planner, per policy, model shape and batch",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument("--shapes", default=",".join(SHAPES), help="model shapes (simulate's names)")
    p.add_argument("--policies", default=",".join(POLICIES), help="policies to time")
    p.add_argument(
        "--batches",
        default=",".join(map(str, BATCHES)),
        help="decode batches: tokens of that many sequences per step",
    )
    p.add_argument(
        "--chunks",
        default=",".join(map(str, CHUNKS)),
        help="prefill chunks: that many consecutive tokens of one sequence per step",
    )
    p.add_argument("--hardware", default="rtx4090-ddr5", help="hardware profile of the costs")
    p.add_argument("--quant", default="bf16", help="expert format of the costs")
    p.add_argument("--budget", default="0.1", help="GPU expert budget")
    p.add_argument("--calls", type=int, default=192, help="timed plan() calls per setting")
    p.add_argument("--cpu", type=int, default=None, help="pin the process to this CPU core")
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    p.set_defaults(func=run)


@dataclass
class Timing:
    shape: str
    policy: str
    tokens: str  # "batch B" (decode) or "chunk C" (prefill)
    routed: float  # distinct experts per layer, mean
    calls: int
    median_us: float  # plan(defer=True): what the layer's experts wait for
    p90_us: float
    deferred_median_us: float  # prepare(): overlapped with the layer's experts
    total_median_us: float  # both, per layer
    total_mean_us: float


def routed_steps(shape, batch: int, steps: int, chunk: bool = False, seed: int = 0):
    """`steps` steps of `batch` tokens, per MoE layer a list of Routed, from synthetic traces with
    the model's geometry: a decode batch takes one token from each of `batch` sequences (traces of
    their own), a prefill chunk `batch` consecutive tokens of one. Also, per step and layer, the
    next layer's router probabilities [E] (random)."""
    from hybridmoe.sim.simulator import steps_of
    from hybridmoe.sim.synthetic import SynthConfig, generate

    e = shape.experts
    sequences = 1 if chunk else batch

    def trace(s):
        cfg = SynthConfig(
            layers=shape.num_moe_layers,
            experts=e.num_experts,
            top_k=e.top_k,
            tokens=steps * batch // sequences,
            locality=0.4,
            drift=60,
            seed=seed + s,
        )
        return generate(cfg)

    traces = [trace(s) for s in range(sequences)]
    lines = [t[i] for i in range(len(traces[0])) for t in traces]  # interleaved sequences
    out = steps_of(lines, batch)
    rng = np.random.default_rng(seed)
    hints = rng.dirichlet(np.full(e.num_experts, 0.3), size=(len(out), shape.num_moe_layers))
    return out, list(hints)  # [steps][L] of [E] arrays


def time_policy(
    shape, cost, policy: str, batch: int, calls: int, budget: str, chunk: bool = False
) -> Timing:
    from hybridmoe.experts.plan.cache import parse_budget
    from hybridmoe.experts.plan.planner import make_planner
    from hybridmoe.experts.plan.policies import make_policy

    e = shape.experts
    L = shape.num_moe_layers
    timed_steps = max(1, -(-calls // L))
    warm_steps = max(timed_steps, WARM_TOKENS // batch)
    steps, hints = routed_steps(shape, batch, warm_steps + timed_steps, chunk)
    slots = parse_budget(budget, cost.expert_bytes * e.num_experts * L, cost.expert_bytes)
    layers = list(e.moe_layers)
    planner = make_planner(
        cost, layers, e.num_experts, e.top_k, slots, make_policy(policy), profile=steps[:warm_steps]
    )
    times, deferred, clock = [], [], 0.0
    for s in range(warm_steps, warm_steps + timed_steps):
        planner.begin_step()
        for o, routed in enumerate(steps[s]):
            t0 = time.thread_time()
            plan = planner.plan(layers[o], routed, now=clock, defer=True)
            t1 = time.thread_time()
            planner.prepare(plan, hints[s][o])
            planner.complete(plan)
            times.append(t1 - t0)
            deferred.append(time.thread_time() - t1)
            clock = plan.makespan
    us = sorted(1e6 * t for t in times)
    total = sorted(1e6 * (a + b) for a, b in zip(times, deferred))
    return Timing(
        shape.name,
        policy,
        f"{'chunk' if chunk else 'batch'} {batch}",
        statistics.fmean(len(r) for step in steps[warm_steps:] for r in step),
        len(us),
        statistics.median(us),
        us[int(0.9 * (len(us) - 1))],
        statistics.median(1e6 * t for t in deferred),
        statistics.median(total),
        statistics.fmean(total),
    )


def run(args) -> int:
    from hybridmoe.experts.plan.policies import POLICIES as KNOWN
    from hybridmoe.experts.plan.profiles import get_profile
    from hybridmoe.sim.shapes import get_shape

    if args.cpu is not None:
        if not hasattr(os, "sched_setaffinity"):
            raise UserError("--cpu needs Linux (sched_setaffinity); leave it out elsewhere")
        try:
            os.sched_setaffinity(0, {args.cpu})
        except OSError:
            raise UserError(f"--cpu {args.cpu} is not a core of this machine; pick one") from None
    policies = [p for p in args.policies.split(",") if p]
    for name in policies:
        if name not in KNOWN or KNOWN[name].needs_future:
            raise UserError(f"--policies: {name!r} is not a policy the engine runs")
    try:
        settings = [(int(b), False) for b in args.batches.split(",") if b]
        settings += [(int(c), True) for c in args.chunks.split(",") if c]
    except ValueError:
        raise UserError("--batches and --chunks take whole numbers, e.g. 1,8 and 512") from None
    if args.calls < 1 or any(b < 1 for b, _ in settings):
        raise UserError("--calls and every batch and chunk must be at least 1")
    if not args.json:
        print(
            f"{'shape':14s} {'policy':9s} {'tokens':>9s} {'routed':>6s} {'plan us':>8s} "
            f"{'p90':>7s} {'prepare us':>10s} {'total us':>8s} {'mean':>7s}"
        )
    for shape_name in args.shapes.split(","):
        shape = get_shape(shape_name)
        cost = get_profile(args.hardware).for_expert(shape.experts, args.quant)
        for batch, chunk in settings:
            for policy in policies:
                t = time_policy(shape, cost, policy, batch, args.calls, args.budget, chunk)
                if args.json:
                    print(json.dumps(asdict(t)), flush=True)
                else:
                    print(
                        f"{t.shape:14s} {t.policy:9s} {t.tokens:>9s} {t.routed:6.1f} "
                        f"{t.median_us:8.1f} "
                        f"{t.p90_us:7.1f} {t.deferred_median_us:10.1f} {t.total_median_us:8.1f} "
                        f"{t.total_mean_us:7.1f}",
                        flush=True,
                    )
    return 0
