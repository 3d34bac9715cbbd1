"""Background copies through the gap between layers (Policy.copies_in_gap, the value policy's):
the planner measures the time from one layer's end to the next layer's plan, and such a policy's
background copies may keep the stream busy until the next plan, less its slack."""

from __future__ import annotations

import math

import pytest

from hybridmoe.experts.plan.cache import ExpertCache
from hybridmoe.experts.plan.planner import Planner, PlannerConfig, Routed
from hybridmoe.experts.plan.policies import Policy, ValuePolicy
from hybridmoe.experts.plan.predictor import Predictor
from tests.test_planner import cost_model

LAYERS = [0, 1, 2]
E = 8
US = 1e-6


class Wants(Policy):
    """Asks for the same keys in the background every layer, in order."""

    name = "wants"
    uses_predictor = False

    def __init__(self, keys, in_gap: bool, slack: float):
        self.keys, self.copies_in_gap, self.background_slack = keys, in_gap, slack

    def background(self, layer, now, plan):
        return list(self.keys)


def planner_for(policy, config=None) -> Planner:
    # Copies far slower than the CPU: no demand copy is ever worth it, so the stream holds only
    # background copies.
    cost = cost_model(cpu_us=20, copy_us=100, gpu_us=5)
    return Planner(cost, ExpertCache(16), policy, Predictor(LAYERS, E, 2), config)


def test_the_gap_is_an_ema_of_the_time_from_a_layers_end_to_the_next_plan():
    planner = planner_for(Wants([], in_gap=True, slack=0.0), PlannerConfig(layer_time_alpha=0.1))
    planner.begin_step()
    ends, starts = [100 * US, 450 * US, 900 * US], [0.0, 300 * US, 500 * US]
    for layer, now, end in zip(LAYERS, starts, ends):
        plan = planner.plan(layer, [Routed(1)], now=now)
        planner.complete(plan, finished_at=end)
    # gaps: 300 - 100 = 200 us (the first: taken as it is), then 500 - 450 = 50 us
    assert planner.gap == pytest.approx(0.9 * 200 * US + 0.1 * 50 * US)
    assert planner.layer_period == pytest.approx(planner.layer_time + planner.gap)


@pytest.mark.parametrize("in_gap", [False, True])
@pytest.mark.parametrize("slack", [0.0, 0.25, 1.0])
def test_background_copies_run_until_the_next_plan_less_the_slack(in_gap, slack):
    wanted = [(1, e) for e in range(6)] + [(2, e) for e in range(6)]
    planner = planner_for(Wants(wanted, in_gap, slack))
    planner.begin_step()
    plan = planner.plan(0, [Routed(1)], now=0.0)
    planner.complete(plan, finished_at=plan.makespan)
    gap = 420 * US  # the next layer's plan comes 4.2 copies after this layer's end
    now = plan.makespan + gap
    plan = planner.plan(1, [Routed(1)], now=now, defer=True)
    assert planner.gap == pytest.approx(gap)
    copies = planner.prepare(plan)
    assert not plan.copies
    # By hand: the stream is idle at `now`; copies start at now, now + 100 us, ... and one is
    # queued while the stream frees before the deadline (the layer's end, or the next plan with
    # copies_in_gap, less `slack` copies); an idle stream always takes one. (The plan's own
    # finish times are made before any background copy joins the stream.)
    deadline = plan.makespan + (gap if in_gap else 0.0) - slack * 100 * US
    want = max(1, math.ceil((deadline - now) / (100 * US) - 1e-9))
    assert len(copies) == want
    assert want > 1 if in_gap else want == 1


def test_the_value_policy_copies_through_the_gap():
    assert ValuePolicy.copies_in_gap and not Policy.copies_in_gap


@pytest.mark.parametrize("hinted_slack", [None, 0.0, -2.0])
def test_keys_the_hint_ranks_top_k_run_until_their_own_slack(hinted_slack):
    """Six unhinted keys of layer 1, then the two keys of layer 2 that the look-ahead hint ranks
    top-2: the unhinted ones stop at the deadline less 3 copies, the hinted ones go on until the
    deadline less `hinted_slack` copies (None: the same slack as the others)."""
    unhinted = [(1, e) for e in range(6)]
    hinted = [(2, 4), (2, 5)]
    policy = Wants(unhinted + hinted, in_gap=True, slack=3.0)
    policy.hinted_slack = hinted_slack
    planner = planner_for(policy)
    planner.begin_step()
    plan = planner.plan(0, [Routed(1)], now=0.0)
    planner.complete(plan, finished_at=plan.makespan)
    gap = 420 * US
    now = plan.makespan + gap
    plan = planner.plan(1, [Routed(1)], now=now, defer=True)
    probs = [0.01, 0.02, 0.03, 0.04, 0.5, 0.3, 0.05, 0.05]  # top-2: experts 4 and 5
    planner.predictor.set_router_scores(2, probs)
    # the key layer 0's idle stream took is not copied again
    unhinted = [k for k in unhinted if k not in planner.cache]
    copies = [(c.layer, c.expert) for c in planner.prepare(plan)]
    # By hand, as in the test above: copies start at now, now + 100 us, ...
    deadline = plan.makespan + gap
    n_unhinted = max(1, math.ceil((deadline - 3 * 100 * US - now) / (100 * US) - 1e-9))
    if hinted_slack is None:
        n_hinted = 0
    else:
        free = now + n_unhinted * 100 * US  # when the unhinted copies are through
        left = deadline - hinted_slack * 100 * US - free
        n_hinted = min(2, max(0, math.ceil(left / (100 * US) - 1e-9)))
    assert copies == unhinted[:n_unhinted] + hinted[:n_hinted]
    assert n_unhinted < len(unhinted)  # the unhinted keys were cut short: the case is real
    assert (n_hinted > 0) == (hinted_slack is not None)


def test_the_value_policy_gives_hinted_keys_a_slack_of_their_own():
    assert ValuePolicy.hinted_slack is not None and Policy.hinted_slack is None
