"""`hybridmoe bench policy-goals`: value's ratios to its peers on a trace, and the goals."""

from __future__ import annotations

import pytest

from hybridmoe.bench.policy_goals import GOALS, demo_layout, measure
from hybridmoe.experts.plan.profiles import get_profile
from hybridmoe.experts.plan.trace_format import read_trace, write_trace
from hybridmoe.sim.shapes import get_shape
from hybridmoe.sim.simulator import SimConfig, simulate
from tests.console import hybridmoe
from tests.traces import shared_trace


@pytest.fixture(scope="module")
def short_trace(tmp_path_factory):
    path = tmp_path_factory.mktemp("traces") / "olmoe60.jsonl"
    write_trace(path, read_trace(shared_trace("olmoe-1b-7b_299tok.jsonl"))[:60])
    return str(path)


def test_ratios_and_goals_are_those_of_the_simulations(short_trace):
    (o,) = measure(f"{short_trace}=olmoe-1b-7b", ["0.1"], "rtx4090-ddr5", "q4", GOAL_POLICIES)
    shape = get_shape("olmoe-1b-7b")
    cost = get_profile("rtx4090-ddr5").for_expert(shape.experts, "q4")
    lines = read_trace(short_trace)
    r = {p: simulate(lines, shape, cost, SimConfig(policy=p, budget="0.1")) for p in GOAL_POLICIES}
    ratios = o.ratios()
    assert ratios["vs_hybrimoe"] == pytest.approx(
        r["value"].tokens_per_s / r["hybrimoe"].tokens_per_s
    )
    assert ratios["vs_static"] == pytest.approx(r["value"].tokens_per_s / r["static"].tokens_per_s)
    assert ratios["time_vs_oracle"] == pytest.approx(
        r["oracle"].tokens_per_s / r["value"].tokens_per_s
    )
    assert ratios["hit_vs_oracle"] == pytest.approx(r["value"].hit_rate / r["oracle"].hit_rate)
    met = o.met()
    assert met["vs_hybrimoe"] == (ratios["vs_hybrimoe"] >= GOALS["vs_hybrimoe"])
    assert met["time_vs_oracle"] == (ratios["time_vs_oracle"] <= GOALS["time_vs_oracle"])


GOAL_POLICIES = ("static", "hybrimoe", "value", "oracle")


def test_demo_traces_keep_their_layout_with_another_models_sizes():
    shape = demo_layout("olmoe-1b-7b")
    demo, olmoe = demo_layout("demo"), get_shape("olmoe-1b-7b")
    e = shape.experts
    assert (e.num_experts, e.top_k, e.moe_layers) == (16, 8, demo.experts.moe_layers)
    assert (e.hidden, e.intermediate) == (olmoe.experts.hidden, olmoe.experts.intermediate)
    assert shape.attn_params == olmoe.attn_params and shape.layers == demo.layers


def test_bad_policies_are_exit_code_2(short_trace):
    for policies in ("static,hybrimoe", "value,nonsense"):
        out = hybridmoe(
            "bench",
            "policy-goals",
            "--traces",
            f"{short_trace}=olmoe-1b-7b",
            "--policies",
            policies,
        )
        assert out.returncode == 2 and "--policies" in out.stderr
        assert "Traceback" not in out.stderr
