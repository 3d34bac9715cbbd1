"""Each policy does what its peer does (policies.py's table), on hand-made situations."""

from __future__ import annotations

import pytest

from hybridmoe.errors import UserError
from hybridmoe.experts.plan.cache import ExpertCache
from hybridmoe.experts.plan.planner import Planner, PlannerConfig, Routed, make_planner
from hybridmoe.experts.plan.policies import POLICIES, make_policy
from hybridmoe.experts.plan.predictor import Predictor
from hybridmoe.experts.plan.profiles import get_profile
from hybridmoe.sim.oracle import Future
from hybridmoe.sim.shapes import SHAPES
from tests.test_planner import cost_model

LAYERS = [0, 1]
E = 8


def planner_for(policy, slots, dynamic=(), pinned=(), cost=None):
    cache = ExpertCache(slots)
    cache.place(list(pinned), pinned=True)
    cache.place(list(dynamic), pinned=False)
    return Planner(
        cost or cost_model(100, 250, 5), cache, policy, Predictor(LAYERS, E, 2), PlannerConfig()
    )


def run_steps(planner, steps, gap=1.0):
    """Each step is a list per layer of expert ids; layers far apart so copies always finish.
    The clock carries on from the planner's previous run_steps."""
    clock, plans = getattr(planner, "test_clock", 0.0), []
    for step in steps:
        planner.begin_step()
        for layer, ids in zip(LAYERS, step):
            plan = planner.plan(layer, [Routed(e) for e in ids], now=clock)
            planner.complete(plan)
            plans.append(plan)
            clock = plan.makespan + gap
    planner.test_clock = clock
    return plans


def test_cpu_policy_never_touches_the_gpu():
    planner = planner_for(make_policy("cpu"), 4, dynamic=[(0, 1)])
    plans = run_steps(planner, [[[1, 2], [3]], [[1], [4, 5]]])
    assert all(
        not p.gpu_hits and not p.gpu_copied and not p.copies and not p.prefetches for p in plans
    )


def test_static_keeps_its_set_and_never_copies():
    planner = planner_for(make_policy("static"), 2, pinned=[(0, 1), (1, 3)])
    plans = run_steps(planner, [[[1, 2, 4, 5, 6], [3, 7]]] * 3)
    assert set(planner.cache.slot_of) == {(0, 1), (1, 3)}
    assert all(not p.copies and not p.prefetches for p in plans)
    assert [r.expert for r in plans[0].gpu_hits] == [1]


def test_fiddler_copies_only_when_copy_and_gpu_beat_the_cpu_and_keeps_nothing():
    # A 1 MB expert: 100 us on the CPU at one token, 50 ms/token... compute-bound past 2 tokens.
    cost = cost_model(100, 250, 5)
    planner = planner_for(make_policy("fiddler"), 2, pinned=[(0, 1)], cost=cost)
    planner.begin_step()
    few = planner.plan(0, [Routed(2, 1)], now=0.0)
    assert few.cpu and not few.copies  # 100 us on the CPU < 250 us copy
    many = planner.plan(1, [Routed(2, 64)], now=1.0)
    assert cost.t_copy() + cost.t_gpu(64) < cost.t_cpu(64)
    assert [c.slot for c in many.copies] == [None] and [r.expert for r in many.gpu_copied] == [2]
    assert set(planner.cache.slot_of) == {(0, 1)}


@pytest.mark.parametrize("name", ["static", "fiddler", "hybrimoe", "lru", "lfu", "value"])
def test_a_prefill_plan_on_a_full_cache_copies_the_experts_with_many_tokens(name):
    # A 512-token chunk at Qwen3-30B-A3B's shape (bf16, rtx4090-ddr5): 128 experts share 4096
    # routed slots. The cache is full, and this layer's residents are routed here (protected), so a
    # per-layer quota leaves no room: what goes to the GPU must be staged, unkept.
    cost = get_profile("rtx4090-ddr5").for_expert(SHAPES["qwen3-30b-a3b"].experts, "bf16")
    layers = list(range(4))
    planner = make_planner(cost, layers, 128, 8, 8, make_policy(name), placement_kind="uniform")
    assert planner.cache.free_count() == 0
    resident = sorted(e for layer, e in planner.cache.slot_of if layer == 0)
    many = [Routed(e, 96) for e in range(64, 96)]  # 3072 slots
    few = [Routed(e, 8) for e in range(0, 128) if e not in resident and not 64 <= e < 96][:126]
    routed = [Routed(e, 8) for e in resident] + many + few
    kept = dict(planner.cache.slot_of)
    planner.begin_step()
    plan = planner.plan(0, routed, now=0.0)
    copied = {c.expert for c in plan.copies}
    # A copy of an expert with many tokens saves more CPU time than the copy stream spends on it
    # (the reference: copy + GPU against the CPU, per expert); one with few tokens does not, but
    # may still shorten the layer while the CPU is the bottleneck.
    assert cost.t_copy() + cost.t_gpu(96) < cost.t_cpu(96)
    assert cost.t_copy() + cost.t_gpu(8) > cost.t_cpu(8)
    assert {r.expert for r in many} <= copied
    assert {r.expert for r in plan.gpu_copied} == copied
    all_cpu = sum(cost.t_cpu(r.n_tokens) for r in routed if r.expert not in resident)
    assert plan.makespan < 0.6 * all_cpu
    if name != "value":  # a global cache may evict another layer's expert for it instead
        assert all(c.slot is None and c.evicted is None for c in plan.copies)
        assert planner.cache.slot_of == kept
    planner.cache.check()


def test_static_copies_nothing_below_llama_cpps_batch():
    cost = get_profile("rtx4090-ddr5").for_expert(SHAPES["qwen3-30b-a3b"].experts, "bf16")
    planner = make_planner(cost, [0, 1], 128, 8, 2, make_policy("static"), placement_kind="uniform")
    planner.begin_step()
    # 31 tokens, all on two experts: copying would pay (as above), but llama.cpp would not do it.
    plan = planner.plan(0, [Routed(100, 31 * 4), Routed(101, 31 * 4)], now=0.0)
    assert not plan.copies and len(plan.cpu) == 2
    plan = planner.plan(1, [Routed(100, 32 * 4), Routed(101, 32 * 4)], now=1.0)
    assert plan.copies and all(c.slot is None for c in plan.copies)


def test_lru_evicts_the_least_recently_used_expert_of_the_same_layer():
    planner = planner_for(make_policy("lru"), 4)  # two slots per layer
    run_steps(planner, [[[1], [5]], [[2], [5]]])
    assert {(0, 1), (0, 2)} <= set(planner.cache.slot_of)
    run_steps(planner, [[[1], [5]], [[3], [5]]])  # 1 used again, so 2 is the least recent
    layer0 = {k for k in planner.cache.slot_of if k[0] == 0}
    assert layer0 == {(0, 1), (0, 3)}


def test_lfu_evicts_the_least_frequently_used_expert():
    planner = planner_for(make_policy("lfu"), 4)
    run_steps(planner, [[[1], [5]], [[1], [5]], [[2], [5]], [[3], [5]]])
    layer0 = {k for k in planner.cache.slot_of if k[0] == 0}
    assert layer0 == {(0, 1), (0, 3)}  # 2 (one use, older) went; 1 (two uses) stays


def test_hybrimoe_scores_are_an_ema_of_router_weights_and_the_lowest_goes():
    policy = make_policy("hybrimoe")
    planner = planner_for(policy, 4)
    planner.begin_step()
    planner.plan(0, [Routed(1, 1, 0.8), Routed(2, 1, 0.2)], now=0.0)
    assert policy.score[(0, 1)] == pytest.approx(0.4) and policy.score[(0, 2)] == pytest.approx(0.1)
    planner.plan(1, [Routed(6)], now=1.0)
    planner.begin_step()
    planner.plan(0, [Routed(1, 1, 0.5), Routed(3, 1, 0.5)], now=2.0)
    assert policy.score[(0, 1)] == pytest.approx(0.5 * 0.5 + 0.5 * 0.4)
    planner.cache.place([(0, 2), (0, 4)], pinned=False)
    policy.score[(0, 4)] = 0.3
    ok, victim = policy.make_room((0, 5), protect=set(), now=3.0, free=planner.cache.free_count())
    assert ok and victim == (0, 2)  # score 0.05 after one EMA step without use


def test_hybrimoe_prefetches_the_next_layers_predicted_experts():
    policy = make_policy("hybrimoe")
    planner = planner_for(policy, 4)
    run_steps(planner, [[[1, 2], [6, 7]]] * 3)
    planner.begin_step()
    plan = planner.plan(0, [Routed(1), Routed(2)], now=100.0)
    assert {(c.layer, c.expert) for c in plan.prefetches} <= {(1, 6), (1, 7)}
    assert all(k in planner.cache for k in [(1, 6), (1, 7)])


def test_value_keeps_the_expert_used_every_step_over_one_used_once():
    policy = make_policy("value")
    planner = planner_for(policy, 1)
    run_steps(planner, [[[1], [5]]] * 6 + [[[2], [5]]])
    # One slot: (0, 1) was used six steps running; (0, 2) once. Expected time to next use
    # favours keeping 1 (or the steady layer-1 expert 5): never the one-off 2.
    assert (0, 2) not in planner.cache
    assert policy.distance((0, 1), 0.0) < policy.distance((0, 2), 0.0)


def test_belady_evicts_the_expert_used_farthest_in_the_future():
    steps = [[[1], [5]], [[2], [5]], [[1], [5]], [[3], [5]], [[2], [5]]]
    future = Future(steps, LAYERS)
    policy = make_policy("belady", future=future)
    planner = planner_for(policy, 2)
    run_steps(planner, steps[:2])  # after step 1: holds 1 and 2 (layer 1's 5 could not fit)
    assert future.next_use((0, 1), 2) == 4 and future.next_use((0, 2), 2) == 8
    run_steps(planner, steps[2:4])
    assert (0, 2) in planner.cache or (0, 1) in planner.cache


def test_unknown_policy_and_belady_without_future_are_user_errors():
    with pytest.raises(UserError, match="value"):
        make_policy("magic")
    with pytest.raises(UserError, match="simulate"):
        make_policy("belady")
    assert set(POLICIES) == {
        "cpu",
        "static",
        "fiddler",
        "hybrimoe",
        "lru",
        "lfu",
        "value",
        "belady",
    }


def test_only_our_policy_learns_cross_layer_routing():
    # HybriMoE predicts from the next router (or, without it, recency and frequency); giving it our
    # co-occurrence predictor would no longer be HybriMoE.
    assert [name for name, cls in POLICIES.items() if cls.cross_layer] == ["value"]


def test_values_view_ranks_victims_as_a_fresh_ranking_after_the_visit_does():
    """The view value's plan reads (made while the previous layer ran) against the distances
    computed afresh once the planned layer's visit is counted: the same victims, in order."""
    from hybridmoe.sim.shapes import get_shape
    from hybridmoe.sim.simulator import steps_of
    from hybridmoe.sim.synthetic import SynthConfig, generate

    shape = get_shape("olmoe-1b-7b")
    e = shape.experts
    lines = generate(SynthConfig(layers=16, experts=64, top_k=8, tokens=80, seed=4))
    steps = steps_of(lines, 1)
    cost = get_profile("rtx4090-ddr5").for_expert(e, "q4")
    policy = make_policy("value")
    planner = make_planner(cost, list(e.moe_layers), 64, 8, 100, policy, profile=steps[:40])
    checked = 0
    for step in steps[40:]:
        planner.begin_step()
        for layer, routed in zip(e.moe_layers, step):
            planner._locate(layer)
            view = policy._view()
            used = {r.expert for r in routed}
            pred = planner.predictor
            names = ("hits", "trials", "band_hits", "band_trials", "free_hits", "free_trials")
            tables = [getattr(pred, n).copy() for n in names]
            pred.count_use(layer, sorted(used))
            # the view reads the calibration tables as they stood before the visit
            counted = [getattr(pred, n).copy() for n in names]
            for n, t in zip(names, tables):
                getattr(pred, n)[:] = t
            pred.recompute()
            fresh = list(policy._every_key(0.0))
            mine = [k for k in view.victims() if not (k[0] == layer and k[1] in used)]
            dist = {k: policy.distance(k, 0.0) for k in fresh}
            # ties may fall either way; the distances read in the view's order never increase
            assert [round(dist[k], 9) for k in mine] == sorted(
                (round(dist[k], 9) for k in mine), reverse=True
            )
            assert set(mine) == {k for k in fresh if not (k[0] == layer and k[1] in used)}
            checked += 1
            for n, t in zip(names, counted):
                getattr(pred, n)[:] = t
            pred.recompute()
            planner.predictor.look_ahead(layer)
            planner.predictor.matrices()
            policy.prepare_next()
    assert checked == 40 * 16
