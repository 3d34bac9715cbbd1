"""What each step of value's prepare() costs, in microseconds per layer (medians).

PYTHONPATH=. python docs/notes/2026-11-25-value-planning-cost/parts.py [policy] [batch] [chunk]

The bench planner's setting (Qwen3-30B-A3B shape, rtx4090-ddr5 bf16, 10% budget, warmed); each
step of Planner.prepare is wrapped with a perf_counter_ns timer (about 0.2 us added per call).
"""

import statistics
import sys
import time
from collections import defaultdict

from hybridmoe.bench.planner import WARM_TOKENS, routed_steps
from hybridmoe.experts.plan.cache import parse_budget
from hybridmoe.experts.plan.planner import make_planner
from hybridmoe.experts.plan.policies import make_policy
from hybridmoe.experts.plan.profiles import get_profile
from hybridmoe.sim.shapes import get_shape

policy = sys.argv[1] if len(sys.argv) > 1 else "value"
batch = int(sys.argv[2]) if len(sys.argv) > 2 else 1
chunk = len(sys.argv) > 3 and sys.argv[3] == "chunk"
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
spent = defaultdict(float)


def wrap(obj, name, label):
    f = getattr(obj, name)

    def timed_call(*a, **k):
        t0 = time.perf_counter_ns()
        try:
            return f(*a, **k)
        finally:
            spent[label] += time.perf_counter_ns() - t0

    setattr(obj, name, timed_call)


for obj, name in [
    (planner, "_schedule"),
    (planner, "_count"),
    (planner.predictor, "count_use"),
    (planner.policy, "on_use"),
    (planner, "_take_prediction"),
    (planner.predictor, "look_ahead"),
    (planner, "_background"),
    (planner.policy, "background"),
    (planner.policy, "background_in"),
    (planner, "_background_keys"),
    (planner, "protected"),
    (planner.policy, "make_room"),
    (planner.policy, "worth"),
    (planner, "_issue"),
    (planner.predictor, "matrices"),
    (planner.policy, "prepare_next"),
]:
    wrap(obj, name, f"{type(obj).__name__}.{name}")
per_layer = defaultdict(list)
clock = 0.0
for s in range(warm, warm + timed):
    planner.begin_step()
    for o, routed in enumerate(steps[s]):
        plan = planner.plan(layers[o], routed, now=clock, defer=True)
        spent.clear()
        t0 = time.perf_counter_ns()
        planner.prepare(plan, hints[s][o])
        per_layer["prepare (wrapped)"].append(time.perf_counter_ns() - t0)
        for k, v in spent.items():
            per_layer[k].append(v)
        planner.complete(plan)
        clock = plan.makespan
n = len(per_layer["prepare (wrapped)"])
for k, v in per_layer.items():
    v = v + [0] * (n - len(v))
    print(f"{k:32s} median {statistics.median(v) / 1e3:7.1f} us  mean {statistics.fmean(v) / 1e3:7.1f}")
