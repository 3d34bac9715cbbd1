"""Where value loses (docs/notes/2026-11-24-value-policy-3.md): per policy, tok/s, hit rate, copies
and prefetches a token, and the hit rate per MoE layer. Run from the repository root:

    python docs/notes/2026-11-24-value-policy-3/diag.py olmoe 0.1
    python docs/notes/2026-11-24-value-policy-3/diag.py chat 0.1
"""

import sys

import numpy as np

from hybridmoe.bench.policy_goals import OLMOE, demo_layout
from hybridmoe.experts.plan.profiles import get_profile
from hybridmoe.experts.plan.trace_format import read_trace
from hybridmoe.sim import simulator
from hybridmoe.sim.dense import dense_cost
from hybridmoe.sim.machine import Machine
from hybridmoe.sim.oracle import future_policy
from hybridmoe.sim.shapes import get_shape
from hybridmoe.sim.simulator import SimConfig

TRACES = {
    "olmoe": (OLMOE.split("=")[0], get_shape("olmoe-1b-7b")),
    "chat": ("docs/traces/demo-chat-travel_400tok.jsonl", None),
    "sm299": ("docs/traces/demo-smollm2-e16k8_299tok.jsonl", None),
}


def per_layer(name, budget, policy):
    path, shape = TRACES[name]
    shape = shape or demo_layout("olmoe-1b-7b")
    lines = read_trace(path)
    cost = get_profile("rtx4090-ddr5").for_expert(shape.experts, "q4")
    cfg = SimConfig(policy=policy, budget=budget)
    pol = future_policy(policy, lines, shape, 1) if policy in ("belady", "oracle") else None
    planner, steps, start = simulator.build(lines, shape, cost, cfg, pol)
    L = len(planner.layers)
    hits, routed = np.zeros(L), np.zeros(L)
    plan_fn = planner.plan

    def plan(layer, r, now, **kw):
        p = plan_fn(layer, r, now, **kw)
        o = planner.ordinal[layer]
        hits[o] += len(p.gpu_hits)
        routed[o] += len(r)
        return p

    planner.plan = plan
    dense = dense_cost(shape, cost, cost.quant, 1, 512)
    clock = simulator.run(planner, steps, start, Machine(cost, 0), dense, cfg)
    res = simulator.summarise(planner, cfg, cost, clock, len(steps) - start)
    resident = np.bincount([planner.ordinal[k[0]] for k in planner.cache.dynamic()], minlength=L)
    return res, hits / routed, resident


if __name__ == "__main__":
    name, budget = sys.argv[1], sys.argv[2]
    rows = {}
    for policy in ("hybrimoe", "value", "belady", "oracle"):
        res, h, resident = per_layer(name, budget, policy)
        rows[policy] = h
        print(
            f"{policy:9s} {res.tokens_per_s:6.1f} tok/s hit {res.hit_rate:.3f} copies/tok "
            f"{res.copies_per_token:5.1f} prefetch/tok {res.prefetches_per_token:5.1f} "
            f"precision {res.prefetch_precision:.2f} experts {res.expert_ms_per_token:.2f} ms "
            f"plan {res.plan_ms_per_token:.2f} ms"
        )
        print("   resident at end per layer:", resident.tolist())
    print("per-layer hit rate (layer: hybrimoe value belady oracle)")
    for o in range(len(rows["value"])):
        print(o, " ".join(f"{rows[p][o]:.2f}" for p in rows))
