"""Where value's planning goes per layer, in microseconds (medians over 960 layers): plan(), each
statement of prepare(), and the time inside predictor.c's calls (perf_counter_ns; the timers add
about 0.1 us a statement).

PYTHONPATH=. python docs/notes/2026-12-06-value-planning-state-in-c/steps.py [batch]

The bench planner's setting (Qwen3-30B-A3B shape, rtx4090-ddr5 bf16 costs, 10% budget, warmed on
128 tokens). prepare() is replaced by a copy of its body with a timer between its statements:
keep the copy in step with Planner.prepare.
"""

import statistics
import sys
import time
from collections import defaultdict

from hybridmoe.bench.planner import WARM_TOKENS, routed_steps
from hybridmoe.experts.plan.cache import parse_budget
from hybridmoe.experts.plan.planner import Planner, make_planner
from hybridmoe.experts.plan.policies import make_policy
from hybridmoe.experts.plan.profiles import get_profile
from hybridmoe.sim.shapes import get_shape

batch = int(sys.argv[1]) if len(sys.argv) > 1 else 1
shape = get_shape("qwen3-30b-a3b")
cost = get_profile("rtx4090-ddr5").for_expert(shape.experts, "bf16")
e, L = shape.experts, shape.num_moe_layers
timed = max(1, 960 // L)
warm = max(timed, WARM_TOKENS // batch)
steps, hints = routed_steps(shape, batch, warm + timed)
slots = parse_budget("0.1", cost.expert_bytes * e.num_experts * L, cost.expert_bytes)
layers = list(e.moe_layers)
planner = make_planner(
    cost, layers, e.num_experts, e.top_k, slots, make_policy("value"), profile=steps[:warm]
)
per = defaultdict(list)
in_c = defaultdict(int)
lib = planner.predictor.native.lib
for name in list(vars(lib)):
    kernel = getattr(lib, name)

    def timed_kernel(*a, kernel=kernel, name=name):
        t0 = time.perf_counter_ns()
        try:
            return kernel(*a)
        finally:
            in_c[name] += time.perf_counter_ns() - t0

    setattr(lib, name, timed_kernel)


def prepare(self, plan, predicted=None):
    """Planner.prepare's body (the value policy's path), timed statement by statement."""
    t = [time.perf_counter_ns()]
    routed = self._unprepared[1]
    self._unprepared = None
    self._schedule(plan)
    t.append(time.perf_counter_ns())
    self._count(plan, routed)
    t.append(time.perf_counter_ns())
    self.predictor.visit(plan.layer, [r.expert for r in routed], predicted)
    t.append(time.perf_counter_ns())
    self.policy.on_use(plan.layer, routed, plan.now)
    self.epoch += 1
    t.append(time.perf_counter_ns())
    self._background(plan.layer, plan.now, plan)
    t.append(time.perf_counter_ns())
    self.predictor.matrices()
    t.append(time.perf_counter_ns())
    self.policy.prepare_next()
    t.append(time.perf_counter_ns())
    names = ["_schedule", "_count", "visit", "on_use", "_background", "matrices", "prepare_next"]
    for name, a, b in zip(names, t, t[1:]):
        per["prepare: " + name].append(b - a)
    per["prepare"].append(t[-1] - t[0])
    return plan.prefetches


Planner.prepare = prepare
clock = 0.0
for s in range(warm, warm + timed):
    planner.begin_step()
    for o, routed in enumerate(steps[s]):
        in_c.clear()
        t0 = time.perf_counter_ns()
        plan = planner.plan(layers[o], routed, now=clock, defer=True)
        per["plan"].append(time.perf_counter_ns() - t0)
        in_c.clear()
        planner.prepare(plan, hints[s][o])
        for name in ("hm_pred_visit", "hm_value_background", "hm_value_view"):
            per["prepare, in C: " + name].append(in_c[name])
        planner.complete(plan)
        clock = plan.makespan
for k, v in per.items():
    median, mean = statistics.median(v) / 1e3, statistics.fmean(v) / 1e3
    print(f"{k:36s} median {median:6.1f} us  mean {mean:6.1f}")
