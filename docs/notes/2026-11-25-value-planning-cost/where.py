"""Where value's planning time goes: cProfile over the bench planner's setting.

python docs/notes/2026-11-25-value-planning-cost/where.py [policy] [batch] [chunk] [part]

part: prepare (default) or plan. Builds the planner as `bench planner` does (Qwen3-30B-A3B shape,
rtx4090-ddr5 bf16 costs, 10% budget, warmed), then profiles 192 layers' plan/prepare calls.
"""

import cProfile
import pstats
import sys

from hybridmoe.bench.planner import WARM_TOKENS, routed_steps
from hybridmoe.experts.plan.cache import parse_budget
from hybridmoe.experts.plan.planner import make_planner
from hybridmoe.experts.plan.policies import make_policy
from hybridmoe.experts.plan.profiles import get_profile
from hybridmoe.sim.shapes import get_shape

policy = sys.argv[1] if len(sys.argv) > 1 else "value"
batch = int(sys.argv[2]) if len(sys.argv) > 2 else 1
chunk = len(sys.argv) > 3 and sys.argv[3] == "chunk"
part = sys.argv[4] if len(sys.argv) > 4 else "prepare"
shape = get_shape("qwen3-30b-a3b")
cost = get_profile("rtx4090-ddr5").for_expert(shape.experts, "bf16")
e, L = shape.experts, shape.num_moe_layers
timed = max(1, 192 // L)
warm = max(timed, WARM_TOKENS // batch)
steps, hints = routed_steps(shape, batch, warm + timed, chunk)
slots = parse_budget("0.1", cost.expert_bytes * e.num_experts * L, cost.expert_bytes)
layers = list(e.moe_layers)
planner = make_planner(
    cost, layers, e.num_experts, e.top_k, slots, make_policy(policy), profile=steps[:warm]
)
prof = cProfile.Profile()
clock = 0.0
for s in range(warm, warm + timed):
    planner.begin_step()
    for o, routed in enumerate(steps[s]):
        if part == "plan":
            prof.enable()
        plan = planner.plan(layers[o], routed, now=clock, defer=True)
        if part == "plan":
            prof.disable()
        else:
            prof.enable()
        planner.prepare(plan, hints[s][o])
        prof.disable()
        planner.complete(plan)
        clock = plan.makespan
pstats.Stats(prof).sort_stats("tottime").print_stats(30)
pstats.Stats(prof).sort_stats("cumtime").print_stats(40)
