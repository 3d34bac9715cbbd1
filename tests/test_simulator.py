"""The simulator: traces in and out, shapes, the fair protocol, and figures checked by hand."""

from __future__ import annotations

import json

import pytest

from hybridmoe import tuning
from hybridmoe.errors import UserError
from hybridmoe.experts.plan.profiles import get_profile
from hybridmoe.experts.plan.trace_format import TraceLine, read_trace, write_trace
from hybridmoe.sim.oracle import belady_min_hit_rate, future_of
from hybridmoe.sim.shapes import SHAPES, get_shape, shape_from_config
from hybridmoe.sim.simulator import SimConfig, build, planner_seconds, simulate
from hybridmoe.sim.synthetic import SynthConfig, generate
from tests.traces import shared_trace

OLMOE_TRACE = shared_trace("olmoe-1b-7b_299tok.jsonl")
OLMOE = get_shape("olmoe-1b-7b")


def small_trace(tokens=40, seed=0):
    return generate(
        SynthConfig(
            layers=16, experts=64, top_k=8, tokens=tokens, skew=1.0, locality=0.4, seed=seed
        )
    )


def test_reads_the_real_olmoe_trace():
    lines = read_trace(OLMOE_TRACE)
    assert len(lines) == 299 and len(lines[0].layers) == 16
    assert all(
        len(ids) == 8 and len(set(ids)) == 8 and max(ids) < 64
        for line in lines
        for ids in line.layers
    )
    assert lines[0].tok == 1 and lines[0].probs is None


def test_trace_round_trip_with_probs_and_request(tmp_path):
    lines = [
        TraceLine(1, [[1, 2], [3, 4]], [[0.6, 0.4], [0.5, 0.5]], "req-1"),
        TraceLine(2, [[2, 5], [3, 1]]),
    ]
    write_trace(tmp_path / "t.jsonl", lines)
    assert read_trace(tmp_path / "t.jsonl") == lines
    assert json.loads((tmp_path / "t.jsonl").read_text().splitlines()[0])["req"] == "req-1"


def test_bad_traces_are_user_errors(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"tok": 1, "layers": [[1, 2]]}\n{"tok": 2, "layers": [[1], [2]]}\n')
    with pytest.raises(UserError, match="line 2"):
        read_trace(bad)
    bad.write_text("not json\n")
    with pytest.raises(UserError, match="line 1"):
        read_trace(bad)
    with pytest.raises(UserError, match="does not exist"):
        read_trace(tmp_path / "missing.jsonl")
    cost = get_profile("rtx4090-ddr5").for_expert(SHAPES["qwen3-30b-a3b"].experts)
    with pytest.raises(UserError, match="48"):
        simulate(read_trace(OLMOE_TRACE), SHAPES["qwen3-30b-a3b"], cost, SimConfig())


def test_shapes_named_and_from_config(tmp_path):
    q = SHAPES["qwen3-30b-a3b"]
    assert q.experts.params_per_expert() == 3 * 2048 * 768 and q.num_moe_layers == 48
    assert SHAPES["deepseek-v3"].num_moe_layers == 58  # 61 layers, the first 3 dense
    cfg = {
        "hidden_size": 1024,
        "moe_intermediate_size": 256,
        "n_routed_experts": 32,
        "num_experts_per_tok": 4,
        "num_hidden_layers": 6,
        "first_k_dense_replace": 1,
        "vocab_size": 1000,
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    s = get_shape(str(tmp_path / "config.json"))
    assert (s.experts.num_experts, s.experts.top_k, s.experts.moe_layers) == (
        32,
        4,
        (1, 2, 3, 4, 5),
    )
    with pytest.raises(UserError, match="num_experts"):
        shape_from_config({"hidden_size": 8, "intermediate_size": 8}, "dense")
    with pytest.raises(UserError, match="olmoe-1b-7b"):
        get_shape("no-such-model")


def test_synthetic_traces_have_the_locality_asked_for():
    lines = generate(
        SynthConfig(layers=4, experts=64, top_k=8, tokens=400, skew=0.0, locality=0.5, seed=3)
    )
    kept = sum(
        len(set(a.layers[i]) & set(b.layers[i])) for a, b in zip(lines, lines[1:]) for i in range(4)
    )
    total = 8 * 4 * (len(lines) - 1)
    # 0.5 kept on purpose, plus uniform redraws of the other 4 hitting the previous 8: 4 * 4/60.
    assert kept / total == pytest.approx(0.5 + 0.5 * 4 / 60, abs=0.03)
    assert generate(SynthConfig(tokens=5, seed=9)) == generate(SynthConfig(tokens=5, seed=9))


def test_cpu_policy_time_is_the_sum_of_cpu_expert_times():
    lines = small_trace()
    cost = get_profile("rtx4090-ddr5").for_expert(OLMOE.experts, "q4")
    r = simulate(lines, OLMOE, cost, SimConfig(policy="cpu", budget="0.1"))
    # 8 experts in turn, the activation round trip (the token's row up, 8 outputs back), and the
    # GPU waiting for the result
    per_layer = 8 * cost.t_cpu(1) + cost.t_act(8, tokens=1) + cost.c_sync
    assert r.expert_ms_per_token == pytest.approx(16 * per_layer * 1e3, rel=1e-9)
    assert r.hit_rate == 0 and r.tokens == 20  # the first half only built statistics


def test_everything_resident_means_all_hits_on_the_gpu():
    lines = small_trace()
    cost = get_profile("rtx4090-ddr5").for_expert(OLMOE.experts, "q4")
    r = simulate(lines, OLMOE, cost, SimConfig(policy="static", budget="1.0"))
    assert r.hit_rate == 1.0 and r.copies_per_token == 0
    assert r.expert_ms_per_token == pytest.approx(16 * 8 * cost.t_gpu(1) * 1e3, rel=1e-9)


def test_no_demand_policy_beats_belady_min_hit_rate_and_the_oracle_beats_static():
    # MIN bounds the hit rate of demand fetching; a policy that prefetches may pass it (a key
    # copied before its first use counts as a hit), so only demand policies are held to it.
    lines = small_trace(60, seed=5)
    cost = get_profile("rtx4090-ddr5").for_expert(OLMOE.experts, "q4")
    cfg = SimConfig(budget="0.2")
    planner, _, _, start = build(lines, OLMOE, cost, cfg)
    bound = belady_min_hit_rate(
        future_of(lines, OLMOE, 1), planner.cache.slots, start, list(planner.cache.slot_of)
    )
    results = {
        p: simulate(lines, OLMOE, cost, SimConfig(policy=p, budget="0.2"))
        for p in ("static", "lru", "lfu", "belady", "value", "oracle")
    }
    for name in ("static", "lru", "lfu", "belady"):
        assert results[name].hit_rate <= bound + 1e-9, name
    assert results["oracle"].expert_ms_per_token < results["static"].expert_ms_per_token
    assert results["value"].expert_ms_per_token < results["static"].expert_ms_per_token


def test_no_gpu_profile_runs_everything_on_the_cpu():
    lines = small_trace()
    cost = get_profile("this-machine-2core").for_expert(OLMOE.experts, "bf16")
    r = simulate(lines, OLMOE, cost, SimConfig(policy="value", budget="0.5"))
    assert r.slots == 0 and r.hit_rate == 0
    assert r.expert_ms_per_token == pytest.approx(16 * 8 * cost.t_cpu(1) * 1e3, rel=1e-9)


@pytest.mark.parametrize("arch", ["qwen2_moe", "qwen3_moe", "deepseek_v2", "mixtral"])
def test_the_simulators_shape_has_the_models_dense_layers_between_moe_layers(arch, tmp_path):
    """Reference: which layers of transformers' own model hold routed experts."""
    from hybridmoe.loader import load_model
    from tests.tiny import build_tiny

    hf = build_tiny(arch, tmp_path)
    sparse = tuple(
        i
        for i, layer in enumerate(hf.model.layers)
        if hasattr(getattr(layer, "mlp", None) or layer.block_sparse_moe, "experts")
    )
    shape = get_shape(str(tmp_path / "config.json"))
    assert shape.experts.moe_layers == sparse
    assert (
        len(sparse) < len(hf.model.layers) or arch == "mixtral"
    )  # dense layers in between, but Mixtral's
    assert (
        tuple(block.layer for block in load_model(tmp_path, progress=False).moe_blocks()) == sparse
    )


def test_moe_layer_freq_spaces_deepseek_moe_layers():
    # DeepSeek's rule (its modeling code): MoE from first_k_dense_replace on,
    # every moe_layer_freq-th layer.
    cfg = {
        "hidden_size": 8,
        "moe_intermediate_size": 4,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "num_hidden_layers": 9,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 2,
        "vocab_size": 10,
    }
    assert shape_from_config(cfg, "ds").experts.moe_layers == (2, 4, 6, 8)


def test_planning_time_is_charged_on_the_critical_path():
    lines = small_trace()
    cost = get_profile("rtx4090-ddr5").for_expert(OLMOE.experts, "q4")
    free = simulate(lines, OLMOE, cost, SimConfig(policy="cpu", budget="0.1", plan_us=0))
    paid = simulate(lines, OLMOE, cost, SimConfig(policy="cpu", budget="0.1", plan_us=100))
    assert paid.expert_ms_per_token == pytest.approx(free.expert_ms_per_token, rel=1e-12)
    assert paid.plan_ms_per_token == pytest.approx(16 * 0.1)  # 16 layers, 100 us each
    per_token = free.expert_ms_per_token + free.dense_ms_per_token + 1.6
    assert 1e3 / paid.tokens_per_s == pytest.approx(per_token, rel=1e-9)
    # By default each policy pays its measured cost, interpolated in the layer's routed count.
    model = simulate(lines, OLMOE, cost, SimConfig(policy="static", budget="0.1"))
    (n0, crit0, _), (n1, crit1, _) = tuning.PLANNER_US["static"][:2]
    assert n0 == 8 and model.plan_ms_per_token == pytest.approx(16 * crit0 * 1e-3)
    assert planner_seconds("static", (n0 + n1) / 2)[0] == pytest.approx((crit0 + crit1) / 2 * 1e-6)
    assert planner_seconds("oracle", 8) == (0.0, 0.0)
