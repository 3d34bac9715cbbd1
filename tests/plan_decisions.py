"""Every decision a planner makes over a few synthetic runs, as short digests: the record that keeps
a faster planner honest. `tests/data/plan_decisions.json` holds the digests the planner of commit
d407732 (before the value policy's planning was made cheaper) gave, the value policy's re-recorded
when its background copies began to run through the gap between layers (issue 15: a change of
decisions, not of speed), and the two value runs of prefill chunks re-recorded when its rankings
began to break ties by key (layer ordinal, expert) rather than in whatever order numpy's
argpartition left equal values (the code before that change, with only its two argpartition ties
made canonical, gives the new digests: docs/notes/2026-11-25-value-planning-cost.md);
tests/test_plan_decisions.py checks that today's planner gives the same, plan by plan.

Regenerate only for a change meant to alter decisions, and say so in its commit:
    python -m tests.plan_decisions > tests/data/plan_decisions.json
"""

from __future__ import annotations

import hashlib
import json

from hybridmoe.experts.plan.cache import parse_budget
from hybridmoe.experts.plan.planner import make_planner
from hybridmoe.experts.plan.policies import make_policy
from hybridmoe.experts.plan.profiles import get_profile
from hybridmoe.sim.shapes import get_shape

# (shape, policy, tokens per step, chunk: consecutive tokens of one sequence, budget, steps)
RUNS = [
    ("olmoe-1b-7b", "value", 1, False, "0.1", 48),
    ("olmoe-1b-7b", "value", 1, False, "0.25", 48),
    ("olmoe-1b-7b", "value", 8, False, "0.1", 24),
    ("olmoe-1b-7b", "value", 64, True, "0.1", 8),
    ("qwen3-30b-a3b", "value", 1, False, "0.1", 12),
    ("qwen3-30b-a3b", "value", 512, True, "0.1", 2),
    ("olmoe-1b-7b", "hybrimoe", 1, False, "0.1", 48),
    ("olmoe-1b-7b", "hybrimoe", 64, True, "0.1", 8),
    ("olmoe-1b-7b", "static", 64, True, "0.1", 8),
    ("olmoe-1b-7b", "lru", 8, False, "0.1", 24),
    ("olmoe-1b-7b", "lfu", 1, False, "0.1", 48),
    ("olmoe-1b-7b", "fiddler", 8, False, "0.1", 24),
]
WARM_TOKENS = 64


def _copy(c) -> tuple:
    return (c.layer, c.expert, c.slot, c.evicted, repr(c.start), repr(c.ready))


def _routed(rs) -> list:
    return [(r.expert, r.n_tokens) for r in rs]


def decisions(plan) -> str:
    """One plan's decisions and predicted times, as text."""
    return repr(
        (
            plan.layer,
            _routed(plan.cpu),
            _routed(plan.gpu_hits),
            _routed(plan.gpu_copied),
            sorted((e, repr(t)) for e, t in plan.ready.items()),
            [_copy(c) for c in plan.copies],
            [_copy(c) for c in plan.prefetches],
            repr(plan.cpu_finish),
            repr(plan.gpu_finish),
        )
    )


def record(shape_name, policy, batch, chunk, budget, steps) -> list[str]:
    """Per step of the run, the digest of its plans' decisions (12 hex digits); then the digest of
    the planner's and predictor's counters at the end."""
    from hybridmoe.bench.planner import routed_steps

    shape = get_shape(shape_name)
    e = shape.experts
    L = shape.num_moe_layers
    cost = get_profile("rtx4090-ddr5").for_expert(e, "q4")
    warm = max(1, WARM_TOKENS // batch)
    routed, hints = routed_steps(shape, batch, warm + steps, chunk, seed=3)
    slots = parse_budget(budget, cost.expert_bytes * e.num_experts * L, cost.expert_bytes)
    layers = list(e.moe_layers)
    planner = make_planner(
        cost, layers, e.num_experts, e.top_k, slots, make_policy(policy), profile=routed[:warm]
    )
    out, clock = [], 0.0
    for s in range(warm, warm + steps):
        planner.begin_step()
        h = hashlib.sha256()
        for o, step_layer in enumerate(routed[s]):
            plan = planner.plan(layers[o], step_layer, now=clock, defer=True)
            planner.prepare(plan, hints[s][o] if s % 2 else None)
            planner.complete(plan)
            clock = plan.makespan
            h.update(decisions(plan).encode())
        out.append(h.hexdigest()[:12])
    counters = repr((vars(planner.stats), vars(planner.predictor.stats)))
    out.append(hashlib.sha256(counters.encode()).hexdigest()[:12])
    return out


def name(run) -> str:
    shape, policy, batch, chunk, budget, steps = run
    return f"{shape} {policy} {'chunk' if chunk else 'batch'} {batch} budget {budget}"


def main() -> None:
    runs = {name(run): record(*run) for run in RUNS}
    lines = [f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in runs.items()]
    print("{\n" + ",\n".join(lines) + "\n}")


if __name__ == "__main__":
    main()
