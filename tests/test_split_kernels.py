"""The planner's split in C (native/split.c) decides as its Python reference does, bit for bit:
whole plans on tight layers (0-3 free slots, protected hits, experts still in flight, full per-layer
quotas, a busy copy stream), and the split alone on inputs drawn wider than a plan makes (many
in-flight experts, beyond the exact front; negative gains; copies queued or not)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hybridmoe.native.split_kernels as split_kernels
from hybridmoe import tuning
from hybridmoe.experts.plan.cache import ExpertCache
from hybridmoe.experts.plan.planner import Plan, Planner, PlannerConfig, Routed, _Option
from hybridmoe.experts.plan.policies import make_policy
from hybridmoe.experts.plan.predictor import Predictor
from hybridmoe.experts.plan.profiles import get_profile
from hybridmoe.sim.shapes import SHAPES
from tests.plan_decisions import decisions
from tests.test_planner import contrived_costs, planner_on, realistic_costs, tight_layer

POLICIES = ["value", "hybrimoe", "lru", "lfu", "static", "fiddler"]


@pytest.fixture(scope="module", autouse=True)
def built():
    if split_kernels.library() is None:
        pytest.fail("the split's C kernels did not build (no C compiler?)")


def both_planners(instance, policy, stage):
    """Two planners on the same tight layer: the first splits in C, the second in Python."""
    cost, routed, residents, free, copy_busy = instance
    out = []
    for native in (True, False):
        planner = planner_on(cost, policy, residents, free, copy_busy, now=1.0)
        if not stage:
            planner.policy.stage_from = None
        if not native:
            planner.times.native = None
        out.append(planner)
    assert out[0].times.native is not None
    return out


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    instance=tight_layer(st.one_of(realistic_costs, contrived_costs)),
    policy=st.sampled_from(POLICIES),
    stage=st.booleans(),
)
def test_c_split_plans_as_the_python_split_on_tight_layers(instance, policy, stage):
    _, routed, *_ = instance
    c, python = both_planners(instance, policy, stage)
    tokens = max(r.n_tokens for r in routed)
    plans = [p.plan(0, routed, now=1.0, tokens=tokens) for p in (c, python)]
    assert decisions(plans[0]) == decisions(plans[1])
    assert c.cache.slot_of == python.cache.slot_of
    assert c.copy_free == python.copy_free


@st.composite
def split_inputs(draw):
    """The split's inputs, wider than a plan draws them: up to 14 in-flight experts (past the
    exact front's LATE_SUBSETS), up to 8 copy options with any gain, misses stranded on the CPU."""
    cost = draw(st.one_of(realistic_costs, contrived_costs))
    n_late = draw(st.integers(0, tuning.LATE_SUBSETS + 4))
    most = draw(st.sampled_from([1, 8, 64, 512]))
    count = st.integers(1, most)
    late = [Routed(e, draw(count)) for e in range(n_late)]
    t_copy = cost.t_copy()
    ready = [1.0 + draw(st.floats(0.0, 6.0)) * t_copy for _ in late]
    options = [
        _Option(Routed(14 + j, draw(count)), ("evict", None), draw(st.floats(-2.0, 2.0)) * t_copy)
        for j in range(draw(st.integers(0, 8)))
    ]
    stranded = [Routed(22 + j, draw(count)) for j in range(draw(st.integers(0, 4)))]
    hits = [Routed(26 + j, draw(count)) for j in range(draw(st.integers(0, 4)))]
    copy_busy = draw(st.floats(0.0, 4.0)) * t_copy
    counts = [r.n_tokens for r in late + stranded + hits] + [o.routed.n_tokens for o in options]
    tokens = max(counts, default=1)
    tokens = draw(st.integers(1, tokens))  # fewer rows than a CPU expert takes: the layer input
    return cost, late, ready, options, stranded, hits, copy_busy, tokens


def planner_with_late(cost, late, ready, copy_busy, now=1.0):
    """A planner of 32 experts a layer whose cache holds `late`, landing at `ready`."""
    cache = ExpertCache(len(late) + 2)
    for r, t in zip(late, ready):
        cache.insert((0, r.expert), ready_at=t)
    planner = Planner(
        cost, cache, make_policy("lru"), Predictor([0, 1], 32, 2), PlannerConfig(value_weight=0.0)
    )
    planner.copy_free = max([now + copy_busy, *ready])
    return planner


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(inputs=split_inputs())
def test_c_best_split_gives_the_python_bits(inputs):
    cost, late, ready, options, stranded, hits, copy_busy, tokens = inputs
    planner = planner_with_late(cost, late, ready, copy_busy)
    assert planner.times.native is not None
    planner.times.tokens = tokens
    plan = Plan(layer=0, now=1.0, tokens=tokens, gpu_hits=hits)
    by_c = planner._best_split(plan, late, options, stranded, 1.0)
    by_python = planner._best_split_reference(plan, late, options, stranded, 1.0)
    assert repr(by_c[0]) == repr(by_python[0])
    assert by_c[1:] == by_python[1:]


def test_token_counts_past_the_table_grow_it():
    cost = get_profile("rtx4090-ddr5").for_expert(SHAPES["qwen3-30b-a3b"].experts, "bf16")
    planner = planner_with_late(cost, [], [], 0.0)
    many = 5000  # more than the tables hold at first
    planner.times.tokens = many
    plan = Plan(layer=0, now=1.0, tokens=many)
    options = [_Option(Routed(e, many - e), ("evict", None), 0.0) for e in range(3)]
    by_c = planner._best_split(plan, [], options, [Routed(31, many)], 1.0)
    assert planner.times.native.cpu.size > many
    assert by_c == planner._best_split_reference(plan, [], options, [Routed(31, many)], 1.0)
