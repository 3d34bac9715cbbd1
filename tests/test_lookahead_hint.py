"""The look-ahead hint of recorded traces in the simulator (sim/lookahead.py): its recall by hand,
the per-step hint a batch hands the planner, and that the simulator feeds it to the predictor."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from hybridmoe.bench.policy_goals import demo_layout
from hybridmoe.experts.plan.profiles import get_profile
from hybridmoe.experts.plan.trace_format import TraceLine, read_trace
from hybridmoe.sim.lookahead import has_hint, hint_recall, step_hints
from hybridmoe.sim.simulator import SimConfig, simulate

ROOT = Path(__file__).resolve().parents[1]


def line(layers, ahead, req=None) -> TraceLine:
    return TraceLine(1, layers, None, req, ahead)


def test_hint_recall_by_hand():
    # 3 layers, 4 experts, top-2. Layer 0's hint for layer 1 ranks 3, 2 first (layer 1 used 3, 0:
    # one of two); for layer 2, 0 and 1 tie at the top, the lower ids win (layer 2 used 1, 2: one).
    # Layer 1's hint for layer 2 ranks 2, 1 (both used).
    a = line(
        [[0, 1], [3, 0], [1, 2]],
        [[[0.1, 0.2, 0.3, 0.4], [0.4, 0.4, 0.1, 0.1]], [[0.0, 0.3, 0.6, 0.1]], []],
    )
    assert hint_recall([a], 1) == pytest.approx((1 + 2) / 4)
    assert hint_recall([a], 2) == pytest.approx(1 / 2)
    assert math.isnan(hint_recall([a], 3))  # no layer three ahead
    assert math.isnan(hint_recall([line([[0, 1], [2, 3]], None)], 1))  # no hint at all


def test_a_steps_hint_is_the_mean_of_its_lines_and_none_without():
    x = line([[0, 1], [2, 3]], [[[0.1, 0.9]], []])
    y = line([[0, 1], [2, 3]], [[[0.5, 0.5]], []])
    plain = line([[0, 1], [2, 3]], None)
    hints = step_hints([[x, y], [x], [x, plain]])
    np.testing.assert_allclose(hints[0][0], [0.3, 0.7])
    assert hints[0][1] is None  # the last layer has nothing ahead
    np.testing.assert_allclose(hints[1][0], [0.1, 0.9])
    assert hints[2] == [None, None]  # a line without the hint: none for the step
    assert has_hint([x, y]) and not has_hint([x, plain])


def test_the_simulator_hands_the_hint_to_the_predictor():
    """On a recorded demo trace the predictor's top-k recall with the hint is the hint's own
    recall or better (the hint ranks the next layer's experts; the predictor calibrates on top);
    static, which reads no predictor, does not move."""
    lines = read_trace(ROOT / "docs/traces/demo-smollm2-e16k8_63tok.jsonl")
    assert has_hint(lines)
    shape = demo_layout("olmoe-1b-7b")
    cost = get_profile("rtx4090-ddr5").for_expert(shape.experts, "q4")
    got = {}
    for policy in ("value", "static"):
        for hints in (False, True):
            cfg = SimConfig(policy=policy, budget="0.1", router_hints=hints)
            got[policy, hints] = simulate(lines, shape, cost, cfg)
    recall = hint_recall(lines[len(lines) // 2 :], 1)
    assert got["value", False].predictor_recall < recall - 0.05
    assert got["value", True].predictor_recall >= recall - 0.02
    assert got["static", True] == got["static", False]
