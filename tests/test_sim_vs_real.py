"""The sim-vs-real pipeline (hybridmoe bench sim-vs-real) on a tiny model: the engine's run and the
simulator's replay of its trace both produce finite figures, and on the same routing with the same
cost profile the simulator predicts what the runtime's own planner predicted. No timing is
asserted."""

from __future__ import annotations

import math

import pytest

from hybridmoe.bench.sim_vs_real import measure, simulate_trace
from hybridmoe.experts.plan.profiles import PROFILES
from tests.tiny import build_tiny

MAX_TOKENS = 10


def test_the_pipeline_runs_and_both_drivers_of_the_planner_agree(tmp_path):
    model = tmp_path / "model"
    build_tiny("mixtral", model)
    trace, cost = tmp_path / "trace.jsonl", PROFILES["this-machine-2core"]
    real = measure(model, cost, trace, [5, 9, 14, 33, 2], MAX_TOKENS)
    sim = simulate_trace(trace, model / "config.json", cost)
    assert real["decode_tokens"] == sim["trace_tokens"] == MAX_TOKENS - 1
    figures = [*real.values(), *sim.values()]
    assert all(math.isfinite(v) and v >= 0 for v in figures)
    assert (
        real["measured_ms_per_token"] >= real["cpu_busy_ms_per_token"] > 0
    )  # the layer clock includes the CPU
    assert sim["simulated_ms_per_token"] == pytest.approx(
        real["runtime_predicted_ms_per_token"], rel=0.05
    )
    assert 0 <= sim["consecutive_overlap"] <= 1
