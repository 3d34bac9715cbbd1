"""The planner's specification, as properties over random instances (hypothesis)."""

from __future__ import annotations

import itertools

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybridmoe.experts.plan.cache import ExpertCache
from hybridmoe.experts.plan.cost_model import CostModel
from hybridmoe.experts.plan.planner import Planner, PlannerConfig, Routed
from hybridmoe.experts.plan.policies import make_policy
from hybridmoe.experts.plan.predictor import Predictor

LAYERS = [0, 1, 2]
E = 8
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def cost_model(cpu_us: float, copy_us: float, gpu_us: float) -> CostModel:
    """A cost model whose batch-1 times are the given microseconds (1 MB experts)."""
    nbytes = 1e6
    return CostModel(
        bw_cpu=nbytes / (cpu_us * 1e-6),
        f_cpu=2e12,
        c_cpu=0.0,
        bw_gpu=nbytes / (gpu_us * 1e-6),
        f_gpu=50e12,
        c_gpu=0.0,
        bw_pcie=nbytes / (copy_us * 1e-6),
        c_copy=0.0,
        expert_bytes=nbytes,
        flops_per_token=2e6 * 50,
        hidden=64,
    )


costs = st.builds(
    cost_model,
    st.floats(20, 200),
    st.floats(20, 400),
    st.floats(1, 30),
)
routed_layer = st.lists(
    st.tuples(st.integers(0, E - 1), st.integers(1, 64)),
    min_size=1,
    max_size=6,
    unique_by=lambda t: t[0],
).map(lambda xs: [Routed(e, n, 1.0 / len(xs)) for e, n in xs])


def make(cost, policy_name, slots, pinned=(), dynamic=(), config=None) -> Planner:
    cache = ExpertCache(slots)
    cache.place(list(pinned), pinned=True)
    cache.place(list(dynamic), pinned=False)
    predictor = Predictor(LAYERS, E, 2)
    return Planner(cost, cache, make_policy(policy_name), predictor, config)


def check_plan(planner: Planner, plan, routed, pinned_before, ready_before) -> None:
    """Every invariant a plan must satisfy, computed independently of the planner."""
    ran = [r.expert for r in plan.cpu + plan.gpu_hits + plan.gpu_copied]
    assert sorted(ran) == sorted(r.expert for r in routed), "every routed expert runs exactly once"
    planner.cache.check()
    assert len(planner.cache) <= planner.cache.slots
    assert pinned_before <= set(planner.cache.slot_of), "pinned experts are never evicted"
    copies = plan.copies + plan.prefetches
    for a, b in zip(copies, copies[1:]):
        assert b.start >= a.ready - 1e-12, "the copy stream does one copy at a time"
    for c in copies:
        assert c.start >= plan.now - 1e-12
        assert c.evicted not in pinned_before
        assert c.evicted not in {(plan.layer, r.expert) for r in plan.gpu_hits + plan.gpu_copied}
    copy_ready = {c.expert: c.ready for c in plan.copies}
    for r in plan.gpu_hits:
        assert ready_before.get((plan.layer, r.expert), 1e18) <= plan.now, (
            "a hit is resident and ready"
        )
    # Replay the GPU queue: hits first, then copied experts in order of readiness.
    t = plan.now + sum(planner.cost.t_gpu(r.n_tokens) for r in plan.gpu_hits)
    for r in sorted(plan.gpu_copied, key=lambda r: plan.ready[r.expert]):
        truth = copy_ready.get(r.expert, ready_before.get((plan.layer, r.expert)))
        assert truth is not None and plan.ready[r.expert] >= truth - 1e-12
        start = max(t, plan.ready[r.expert])
        assert start >= truth - 1e-12, "no GPU use before the copy completes"
        t = start + planner.cost.t_gpu(r.n_tokens)
    assert abs(t - plan.gpu_finish) < 1e-9


@SETTINGS
@given(
    cost=costs,
    policy=st.sampled_from(["value", "hybrimoe", "lru", "lfu", "static", "fiddler", "cpu"]),
    slots=st.integers(0, 10),
    steps=st.lists(st.tuples(*[routed_layer] * len(LAYERS)), min_size=1, max_size=4),
    n_pinned=st.integers(0, 3),
    gap=st.floats(0, 2e-4),
)
def test_planner_invariants_over_a_run(cost, policy, slots, steps, n_pinned, gap):
    pinned = [(LAYERS[i % 3], i) for i in range(min(n_pinned, slots))]
    planner = make(cost, policy, slots, pinned=pinned, dynamic=[(1, 7), (2, 6)])
    clock = 0.0
    for step in steps:
        planner.begin_step()
        for layer, routed in zip(LAYERS, step):
            ready_before = dict(planner.cache.ready_at)
            plan = planner.plan(layer, routed, now=clock)
            check_plan(planner, plan, routed, set(pinned), ready_before)
            planner.complete(plan)
            clock = plan.makespan + gap
    s = planner.stats
    assert s.routed == sum(len(r) for step in steps for r in step)
    assert s.hits + s.misses == s.routed
    assert s.cpu_runs + s.gpu_runs == s.routed


def brute_force_makespan(cost, now, copy_free, hits, late, misses) -> float:
    """Try every subset of late/missed experts on the GPU, and both copy orders."""
    best = float("inf")
    movable = [(r, ready) for r, ready in late] + [(r, None) for r in misses]
    for mask in itertools.product([0, 1], repeat=len(movable)):
        gpu = [m for m, bit in zip(movable, mask) if bit]
        cpu = [m[0] for m, bit in zip(movable, mask) if not bit]
        cpu_end = now + sum(cost.t_cpu(r.n_tokens) for r in cpu)
        if cpu:
            cpu_end += cost.t_act(max(r.n_tokens for r in cpu))
        for order in (1, -1):
            copy_t, readies = max(now, copy_free), []
            for r, ready in sorted(gpu, key=lambda m: order * m[0].n_tokens):
                if ready is None:
                    copy_t += cost.t_copy()
                    ready = copy_t
                readies.append((ready, r))
            t = now + sum(cost.t_gpu(r.n_tokens) for r in hits)
            for ready, r in sorted(readies, key=lambda x: x[0]):
                t = max(t, ready) + cost.t_gpu(r.n_tokens)
            best = min(best, max(cpu_end, t))
    return best


@settings(max_examples=150, deadline=None)
@given(
    cost=costs,
    routed=routed_layer,
    resident=st.sets(st.integers(0, E - 1), max_size=4),
    inflight=st.dictionaries(st.integers(0, E - 1), st.floats(1e-6, 5e-4), max_size=3),
    copy_busy=st.floats(0, 4e-4),
)
def test_makespan_within_10_percent_of_brute_force(cost, routed, resident, inflight, copy_busy):
    now = 1e-3
    # A global cache with room to spare, so that slots do not constrain the split.
    planner = make(cost, "value", slots=16, config=PlannerConfig(value_weight=0.0))
    for e in resident:
        planner.cache.insert((0, e), ready_at=0.0)
    for e, dt in inflight.items():
        if (0, e) not in planner.cache:
            planner.cache.insert((0, e), ready_at=now + dt)
    planner.copy_free = now + copy_busy
    ready = dict(planner.cache.ready_at)
    hits = [r for r in routed if ready.get((0, r.expert), 1e18) <= now]
    late = [(r, ready[(0, r.expert)]) for r in routed if now < ready.get((0, r.expert), 0.0)]
    misses = [r for r in routed if (0, r.expert) not in ready]
    optimum = brute_force_makespan(cost, now, now + copy_busy, hits, late, misses)
    plan = planner.plan(0, routed, now=now)
    assert plan.makespan - now <= 1.10 * (optimum - now) + 1e-12


def test_planner_copies_a_miss_when_the_cpu_is_the_bottleneck():
    # Six misses at 100 us each on the CPU; a copy takes 150 us: sending two to the GPU
    # makes the layer 400 us instead of 600 us (the brute force agrees).
    cost = cost_model(100, 150, 5)
    planner = make(cost, "lru", slots=8, config=PlannerConfig(value_weight=0.0))
    routed = [Routed(e) for e in range(6)]
    plan = planner.plan(0, routed, now=0.0)
    assert len(plan.copies) == 2 and len(plan.cpu) == 4
    assert abs(plan.makespan - 400e-6) < 1e-7  # plus 38 ns of activation transfer
    assert abs(brute_force_makespan(cost, 0.0, 0.0, [], [], routed) - plan.makespan) < 1e-12


def test_planner_without_gpu_runs_everything_on_the_cpu():
    cost = cost_model(100, 150, 5).without_gpu()
    planner = make(cost, "value", slots=0)
    plan = planner.plan(0, [Routed(1), Routed(2, 4)], now=0.0)
    assert [r.expert for r in plan.cpu] == [1, 2] and not plan.copies and not plan.prefetches
    # 100 us at batch 1 (memory-bound); 4 tokens x 1e8 flop / 2e12 flop/s = 200 us (compute-bound);
    # no activation transfer without a GPU.
    assert abs(plan.makespan - 300e-6) < 1e-12


def test_prefetch_is_counted_as_used_when_its_expert_is_routed():
    cost = cost_model(100, 50, 5)
    planner = make(cost, "lru", slots=8)
    planner.begin_step()
    p0 = planner.plan(0, [Routed(3), Routed(4)], now=0.0)
    # One miss is copied for this layer (50 us copy beats 100 us of CPU queue), the other runs on
    # the CPU and LRU demand caching admits it behind, as a background copy.
    assert [(c.layer, c.expert) for c in p0.copies] == [(0, 3)]
    assert [(c.layer, c.expert) for c in p0.prefetches] == [(0, 4)]
    planner.complete(p0)
    planner.plan(1, [Routed(1)], now=p0.makespan)
    planner.begin_step()
    p2 = planner.plan(0, [Routed(3), Routed(4)], now=1.0)
    assert sorted(r.expert for r in p2.gpu_hits) == [3, 4]
    assert planner.stats.prefetches_used == 1
