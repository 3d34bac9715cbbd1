"""The simulator's physics: the dense part from the model's shape, DRAM shared between copies and
CPU experts, the per-layer synchronisation, expert deferral, batches of several sequences, and the
published machines it must predict; each checked against figures computed another way."""

from __future__ import annotations

from dataclasses import replace

import pytest

from hybridmoe import tuning
from hybridmoe.experts.plan.cost_model import CostModel
from hybridmoe.experts.plan.planner import Copy, Plan, Routed
from hybridmoe.experts.plan.profiles import get_profile
from hybridmoe.experts.plan.trace_format import TraceLine
from hybridmoe.sim.dense import KV_BYTES, dense_cost
from hybridmoe.sim.machine import Machine
from hybridmoe.sim.published import ROWS, check
from hybridmoe.sim.shapes import SHAPES, get_shape
from hybridmoe.sim.simulator import step_lines

US = 1e-6


@pytest.mark.parametrize("arch", ["qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3", "olmoe"])
def test_the_dense_part_of_a_shape_is_what_transformers_builds(arch, tmp_path):
    """Reference: the weight matrices of transformers' own model, counted."""
    from tests.tiny import build_tiny

    hf = build_tiny(arch, tmp_path)
    shape = get_shape(str(tmp_path / "config.json"))
    moe = [i for i, layer in enumerate(hf.model.layers) if hasattr(layer.mlp, "experts")]
    layer = hf.model.layers[moe[0]]
    attn = sum(p.numel() for p in layer.self_attn.parameters() if p.dim() == 2)
    assert shape.attn_params == attn + layer.mlp.gate.weight.numel()
    k, v = getattr(layer.self_attn, "k_proj", None), getattr(layer.self_attn, "v_proj", None)
    if k is not None:
        assert shape.kv_dim == k.out_features + v.out_features
    else:  # MLA caches its latent and the rotary key
        assert shape.kv_dim == hf.config.kv_lora_rank + hf.config.qk_rope_head_dim
    shared = sum(
        p.numel()
        for i in moe
        for name, p in hf.model.layers[i].mlp.named_parameters()
        if name.startswith("shared_expert") and not name.startswith("shared_expert_gate")
    )
    dense = sum(
        p.numel()
        for i, lay in enumerate(hf.model.layers)
        if i not in moe
        for p in lay.mlp.parameters()
    )
    assert shape.mlp_params == shared + dense
    assert shape.head_params() == hf.lm_head.weight.numel()


def test_dense_cost_is_weights_kv_and_kernel_floors():
    shape = SHAPES["qwen3-30b-a3b"]
    cost = get_profile("rtx4090-ddr5")
    d = dense_cost(shape, cost, "q4", sequences=4, context=1000)
    weights = shape.attn_params * 144 / 256
    kv = 4 * 1000 * shape.kv_dim * KV_BYTES
    floor = tuning.DENSE_KERNELS_PER_LAYER * cost.c_kernel
    assert d.per_layer_s == pytest.approx((weights + kv) / cost.bw_gpu + floor)
    head = 151936 * 2048 * 144 / 256 / cost.bw_gpu + cost.c_kernel
    assert d.per_step_s == pytest.approx(head)  # every Qwen3 layer is MoE: nothing else a step
    # Without a GPU the dense part runs on the CPU, at its bandwidth.
    cpu = dense_cost(shape, cost.without_gpu(), "q4", 1, 0)
    assert cpu.per_layer_s == pytest.approx(
        weights / cost.bw_cpu + tuning.DENSE_KERNELS_PER_LAYER * cost.c_cpu
    )


def machine_cost(**kw) -> CostModel:
    """1 MB experts: 100 us on the CPU (10 GB/s), a copy 50 us (20 GB/s), the GPU 10 us."""
    base = CostModel(
        bw_cpu=10e9, f_cpu=1e15, c_cpu=0.0, bw_gpu=100e9, f_gpu=1e15, c_gpu=0.0, bw_pcie=20e9,
        c_copy=0.0, c_act=0.0, expert_bytes=1e6, flops_per_token=2e6, hidden=0,
    )  # fmt: skip
    return replace(base, **kw)


def cpu_plan(now: float, n: int, copies=()) -> Plan:
    plan = Plan(layer=0, now=now, cpu=[Routed(e, 1, 1.0 - e / 10) for e in range(n)])
    plan.copies = [Copy(0, 99, None, None, a, b) for a, b in copies]
    return plan


def test_copies_slow_the_cpu_experts_by_the_dram_they_take():
    # DRAM 25 GB/s; a copy takes 20 of it, leaving 5 of the 10 the CPU experts stream at: while it
    # runs they go at half speed. Two experts (200 us of work) from t=0 beside a copy over 0-100 us:
    # 50 us of work done in the first 100 us, the other 150 after: done at 250 us.
    m = Machine(machine_cost(bw_dram=25e9))
    assert m.layer(cpu_plan(0.0, 2, [(0.0, 100 * US)]), 0.0, last=False) == pytest.approx(250 * US)
    # No contention modelled (bw_dram 0), or DRAM enough for both: 200 us.
    for dram in (0.0, 40e9):
        m = Machine(machine_cost(bw_dram=dram))
        assert m.layer(cpu_plan(0.0, 2, [(0.0, 100 * US)]), 0.0, False) == pytest.approx(200 * US)


def test_a_layer_with_cpu_experts_pays_one_synchronisation():
    m = Machine(machine_cost(c_sync=15 * US))
    assert m.layer(cpu_plan(0.0, 1), 0.0, False) == pytest.approx(115 * US)
    assert m.layer(Plan(layer=0, now=1.0), 1.0, False) == pytest.approx(1.0)  # nothing on the CPU


def test_deferred_experts_run_into_the_next_layer():
    # Three CPU experts of 100 us, one deferred: the layer ends after two (200 us); the third runs
    # from 200 to 300 us while the next layer's dense part (here 150 us) goes on; the next layer's
    # two experts start at 300 us and it ends at 500 us, where without deferral it would end at
    # 300 + 150 + 200 = 650 us.
    m = Machine(machine_cost(), defer=1)
    assert m.layer(cpu_plan(0.0, 3), 0.0, last=False) == pytest.approx(200 * US)
    assert m.layer(cpu_plan(350 * US, 2), 350 * US, last=True) == pytest.approx(550 * US)
    # The one deferred is the lowest router weight (cpu_plan weighs expert e at 1 - e/10).
    m = Machine(machine_cost(), defer=1)
    plan = cpu_plan(0.0, 3)
    m.layer(plan, 0.0, last=False)
    assert m.cpu_free == pytest.approx(300 * US)
    # The last layer of a step has no next layer to defer into.
    m = Machine(machine_cost(), defer=2)
    assert m.layer(cpu_plan(0.0, 3), 0.0, last=True) == pytest.approx(300 * US)


def test_a_batch_takes_one_token_from_each_sequence():
    lines = [TraceLine(t, [[t]], req=r) for r in ("a", "b") for t in range(3 if r == "a" else 2)]
    assert [[x.req for x in g] for g in step_lines(lines, 2)] == [["a", "b"], ["a", "b"], ["a"]]
    assert [[x.tok for x in g] for g in step_lines(lines, 2)] == [[0, 0], [1, 1], [2]]
    # Without requests: equal stretches of the trace, each a sequence.
    plain = [TraceLine(t, [[t]]) for t in range(6)]
    assert [[x.tok for x in g] for g in step_lines(plain, 3)] == [[0, 2, 4], [1, 3, 5]]
    assert step_lines(plain, 1) == [[x] for x in plain]


@pytest.mark.parametrize("row", ROWS, ids=[f"{r.model} on {r.hardware}" for r in ROWS])
def test_the_simulator_predicts_published_machines_within_20_percent(row):
    assert abs(check(row).error) <= 0.20


@pytest.mark.parametrize("copying_us", [0.0, 30.0, 100.0, 400.0])
def test_the_planner_charges_the_cpu_the_contention_the_machine_does(copying_us):
    # The planner's estimate of CPU experts beside copies (its split weighs it) against the
    # simulator's machine, which steps through the copy intervals: one-token experts.
    from hybridmoe.experts.plan.planner import _Times

    cost = machine_cost(bw_dram=25e9, c_cpu=20 * US)
    copies = [(0.0, copying_us * US)] if copying_us else []
    for n in (1, 2, 5):
        machine = Machine(cost).layer(cpu_plan(0.0, n, copies), 0.0, last=False)
        planner = _Times(cost).cpu_beside_copies(n * cost.t_cpu(1), copying_us * US)
        assert planner == pytest.approx(machine)
