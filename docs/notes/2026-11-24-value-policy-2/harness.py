"""Scratch harness of docs/notes/2026-11-24-value-policy-2.md: the tuning traces (two demo traces
with OLMoE-1B-7B's sizes, two synthetic OLMoE-shaped traces), value against hybrimoe and static
with planning charged, as `bench policy-goals` runs them. Run from the repository root:

    python docs/notes/2026-11-24-value-policy-2/harness.py baseline
    python docs/notes/2026-11-24-value-policy-2/harness.py slack=-0.5 gap=0
    python docs/notes/2026-11-24-value-policy-2/harness.py slack=0.25 gap=1
    python docs/notes/2026-11-24-value-policy-2/harness.py bounds   # OLMoE: belady/oracle charged value's planning
"""

import math
import sys

from hybridmoe.bench.policy_goals import OLMOE, demo_layout
from hybridmoe.experts.plan.policies import ValuePolicy
from hybridmoe.experts.plan.profiles import get_profile
from hybridmoe.experts.plan.trace_format import read_trace
from hybridmoe.sim import simulator
from hybridmoe.sim.shapes import get_shape
from hybridmoe.sim.simulator import SimConfig, simulate
from hybridmoe.sim.synthetic import SynthConfig, generate

OLMOE_SHAPE = get_shape("olmoe-1b-7b")
COST = get_profile("rtx4090-ddr5").for_expert(OLMOE_SHAPE.experts, "q4")
DEMO = demo_layout("olmoe-1b-7b")
TRACES = {
    "chat": (read_trace("docs/traces/demo-chat-travel_400tok.jsonl"), DEMO),
    "sm299": (read_trace("docs/traces/demo-smollm2-e16k8_299tok.jsonl"), DEMO),
    "syn1": (
        generate(SynthConfig(tokens=300, skew=1.0, locality=0.4, drift=60, seed=1, cross=0.5)),
        OLMOE_SHAPE,
    ),
    "syn2": (generate(SynthConfig(tokens=300, skew=0.7, locality=0.5, seed=2)), OLMOE_SHAPE),
}


def tok_s(name, policy, budget):
    lines, shape = TRACES[name]
    cost = get_profile("rtx4090-ddr5").for_expert(shape.experts, "q4")
    return simulate(lines, shape, cost, SimConfig(policy=policy, budget=budget)).tokens_per_s


def score():
    vh, vs = [], []
    for name in TRACES:
        for budget in ("0.1", "0.25"):
            v = tok_s(name, "value", budget)
            vh.append(v / tok_s(name, "hybrimoe", budget))
            vs.append(v / tok_s(name, "static", budget))
            print(f"  {name} {budget} value {v:.1f} ÷ hybrimoe {vh[-1]:.3f} ÷ static {vs[-1]:.3f}")

    def geo(xs):
        return math.exp(sum(map(math.log, xs)) / len(xs))

    print(f"geometric mean: value ÷ hybrimoe {geo(vh):.4f}, value ÷ static {geo(vs):.4f}")


def bounds():
    """The yardsticks charged value's planning time, on the OLMoE trace at 10%."""
    lines, shape = read_trace(OLMOE.split("=")[0]), OLMOE_SHAPE
    free = {p: simulate(lines, shape, COST, SimConfig(policy=p)).tokens_per_s for p in
            ("hybrimoe", "value", "belady", "oracle")}
    own = simulator.planner_seconds
    simulator.planner_seconds = lambda policy, n: own("value", n)
    for p in ("belady", "oracle"):
        t = simulate(lines, shape, COST, SimConfig(policy=p)).tokens_per_s
        print(f"{p}: {free[p]:.1f} tok/s planning free, {t:.1f} with value's "
              f"({t / free['hybrimoe']:.2f}x hybrimoe); value {free['value']:.1f}, "
              f"hybrimoe {free['hybrimoe']:.1f}")


if __name__ == "__main__":
    if sys.argv[1:] == ["bounds"]:
        bounds()
    else:
        for arg in sys.argv[1:]:
            if arg == "baseline":
                ValuePolicy.background_slack, ValuePolicy.copies_in_gap = 1.0, False
            elif arg.startswith("slack="):
                ValuePolicy.background_slack = float(arg[6:])
            elif arg.startswith("gap="):
                ValuePolicy.copies_in_gap = arg[4:] == "1"
        score()
