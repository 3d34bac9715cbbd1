"""The cost model: DESIGN.md's formulas, the least-squares fit, and profile files."""

from __future__ import annotations

import json
import random

import pytest

from hybridmoe.errors import UserError
from hybridmoe.experts.plan.cost_fit import Sample, fit
from hybridmoe.experts.plan.cost_model import CostModel, quant_bytes
from hybridmoe.experts.plan.profiles import PROFILES, get_profile
from hybridmoe.experts.plan.shape import ExpertShape

QWEN3 = ExpertShape(
    hidden=2048, intermediate=768, num_experts=128, top_k=8, moe_layers=tuple(range(48))
)


def test_expert_bytes_match_design_figures():
    # DESIGN.md: a Qwen3-30B-A3B expert is 4.72 M params, 9.4 MB bf16, about 2.7 MB Q4.
    m = PROFILES["rtx4090-ddr5"].for_expert(QWEN3, "bf16")
    assert m.expert_bytes == pytest.approx(9.437e6, rel=1e-3)
    q4 = PROFILES["rtx4090-ddr5"].for_expert(QWEN3, "q4")
    assert 2.5e6 < q4.expert_bytes < 2.8e6
    assert quant_bytes("q8") == pytest.approx(1.0625)


def test_times_follow_the_roofline_formulas():
    m = CostModel(
        bw_cpu=50e9,
        f_cpu=1e12,
        c_cpu=1e-5,
        bw_gpu=1e12,
        f_gpu=1e14,
        c_gpu=5e-6,
        bw_pcie=25e9,
        c_copy=1e-5,
        c_act=2e-6,
        expert_bytes=1e7,
        flops_per_token=2e7,
        hidden=1000,
    )
    assert m.t_cpu(1) == pytest.approx(1e7 / 50e9 + 1e-5)  # memory-bound: 200 us + 10 us
    assert m.t_cpu(1000) == pytest.approx(1000 * 2e7 / 1e12 + 1e-5)  # compute-bound: 20 ms
    assert m.t_gpu(1) == pytest.approx(1e-5 + 5e-6)
    assert m.t_copy() == pytest.approx(1e7 / 25e9 + 1e-5)
    # 3 rows up and 3 back, 1000 hidden x 2 bytes each at 25 GB/s, + 2 us each way
    assert m.t_act(3) == pytest.approx(2 * (6000 / 25e9 + 2e-6))
    # CPU experts taking 8 rows of a 1-token layer: the token's row goes up once, 8 rows back
    assert m.t_act(8, tokens=1) == pytest.approx((1 + 8) * 2000 / 25e9 + 2 * 2e-6)
    assert m.act_rows(8, 1) == (1, 8) and m.act_rows(3, 512) == (3, 3) and m.t_act(0, 4) == 0
    assert m.hit_saving(1) == pytest.approx(m.t_cpu(1) - m.t_gpu(1))


def test_without_gpu_nothing_but_the_cpu_has_a_finite_time():
    m = PROFILES["this-machine-2core"].for_expert(QWEN3, "bf16")
    assert not m.has_gpu and m.t_copy() == float("inf") and m.t_act(4) == 0.0
    # DESIGN.md: bf16 Qwen3 expert at batch 1 on this machine measured 767 us.
    assert m.t_cpu(1) == pytest.approx(767e-6 + m.c_cpu, rel=0.01)


def synthetic_samples(truth: CostModel, shape: ExpertShape, quant: str, noise: float, seed: int):
    rng = random.Random(seed)
    m = truth.for_expert(shape, quant)
    out = []
    for n in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512):
        out.append(Sample("cpu", n, m.t_cpu(n) * (1 + rng.uniform(-noise, noise))))
        out.append(Sample("gpu", n, m.t_gpu(n) * (1 + rng.uniform(-noise, noise))))
    for scale in (0.25, 0.5, 1.0, 2.0):
        out.append(
            Sample(
                "copy",
                1,
                (m.expert_bytes * scale / truth.bw_pcie + truth.c_copy),
                bytes=m.expert_bytes * scale,
            )
        )
    return out


def test_fit_recovers_known_constants_from_noisy_samples():
    truth = CostModel(
        bw_cpu=30e9,
        f_cpu=0.4e12,
        c_cpu=20e-6,
        bw_gpu=800e9,
        f_gpu=100e12,
        c_gpu=8e-6,
        bw_pcie=20e9,
        c_copy=15e-6,
    )
    fitted = fit(
        synthetic_samples(truth, QWEN3, "bf16", noise=0.02, seed=1), shape=QWEN3, quant="bf16"
    )
    assert fitted.bw_cpu == pytest.approx(truth.bw_cpu, rel=0.1)
    assert fitted.f_cpu == pytest.approx(truth.f_cpu, rel=0.1)
    assert fitted.bw_pcie == pytest.approx(truth.bw_pcie, rel=0.01)
    # The point of the fit: predictions on a shape not used for fitting, within 20%.
    other = ExpertShape(hidden=4096, intermediate=1408, num_experts=64, top_k=6, moe_layers=(0,))
    for n in (1, 3, 50, 300):
        want = truth.for_expert(other, "bf16").t_cpu(n)
        assert fitted.for_expert(other, "bf16").t_cpu(n) == pytest.approx(want, rel=0.2)


def test_fit_without_gpu_samples_gives_a_cpu_only_model():
    samples = [
        s
        for s in synthetic_samples(PROFILES["rtx4090-ddr5"], QWEN3, "bf16", 0.0, 2)
        if s.kind == "cpu"
    ]
    assert not fit(samples, shape=QWEN3).has_gpu
    with pytest.raises(UserError):
        fit([])


def test_profile_round_trips_through_json(tmp_path):
    path = tmp_path / "profile.json"
    m = PROFILES["rtx3090-ddr4"].for_expert(QWEN3, "q8")
    m.save(path)
    back = CostModel.load(path)
    assert back == m
    assert get_profile(str(path)).t_copy() == pytest.approx(m.t_copy())


def test_bad_profiles_are_user_errors(tmp_path):
    with pytest.raises(UserError, match="calibrate"):
        CostModel.load(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"hello": 1}))
    with pytest.raises(UserError):
        CostModel.load(bad)
    with pytest.raises(UserError, match="rtx4090-ddr5"):
        get_profile("rtx9999")


def test_named_profiles_exist_and_are_ordered_sensibly():
    for name in (
        "rtx4090-ddr5",
        "rtx3090-ddr4",
        "rtx4060-8gb-ddr5",
        "h100-spr",
        "this-machine-2core",
    ):
        assert name in PROFILES
    p = {k: v.for_expert(QWEN3, "bf16") for k, v in PROFILES.items() if v.has_gpu}
    # At batch 1 a copy costs more than running the expert on the CPU
    # (DESIGN: ~2.5x on DDR5 + PCIe 4).
    assert p["rtx4090-ddr5"].t_copy() / p["rtx4090-ddr5"].t_cpu(1) == pytest.approx(2.5, rel=0.1)
