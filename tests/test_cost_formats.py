"""The cost model per expert format: each format costs its real block bytes, a calibrated profile
costs each format with the CPU figures measured for it (and refuses one it lacks, in one line),
and the hybrid runtime costs the experts in the format and bytes the store keeps them in."""

from __future__ import annotations

import json

import pytest
import torch

from hybridmoe.errors import UserError
from hybridmoe.experts.plan.cost_model import CPU_FIELDS, QUANT_BYTES, CostModel
from hybridmoe.experts.plan.profiles import PROFILES
from hybridmoe.experts.plan.shape import ExpertShape
from hybridmoe.experts.run.hybrid_runtime import HybridConfig, HybridRuntime
from hybridmoe.loader import load_model
from hybridmoe.loader.load import expert_format
from hybridmoe.quant.formats import FORMATS
from tests.console import hybridmoe
from tests.gguf_writer import Q, write_gguf
from tests.tiny import build_tiny

QWEN3 = ExpertShape(
    hidden=2048, intermediate=768, num_experts=128, top_k=8, moe_layers=tuple(range(48))
)
BLOCK_BYTES = {  # bytes per block and weights per block, as llama.cpp's ggml-common.h lays them out
    "q8_0": (34, 32),
    "q4_0": (18, 32),
    "q4_1": (20, 32),
    "q4_k": (144, 256),
    "q5_k": (176, 256),
    "q6_k": (210, 256),
}


def calibrated(**bw_cpu: float) -> CostModel:
    """A profile as `hybridmoe calibrate` writes it, measured for the formats named, each at its
    own streaming speed."""
    m = CostModel(bw_cpu=1e10, f_cpu=1e11, c_cpu=1e-5, name="calibrated")
    m.cpu_formats = {
        f: {**{k: getattr(m, k) for k in CPU_FIELDS}, "bw_cpu": bw} for f, bw in bw_cpu.items()
    }
    return m


def test_each_format_costs_its_block_bytes():
    for name, (nbytes, weights) in BLOCK_BYTES.items():
        assert QUANT_BYTES[name] == nbytes / weights
        cost = PROFILES["rtx4090-ddr5"].for_expert(QWEN3, name)
        assert cost.expert_bytes == pytest.approx(3 * 2048 * 768 * nbytes / weights)
    assert set(BLOCK_BYTES) == set(FORMATS)
    # DESIGN.md: a Q4_K Qwen3-30B-A3B expert is about 2.7 MB, not bf16's 9.4
    assert PROFILES["rtx4090-ddr5"].for_expert(QWEN3, "q4_k").expert_bytes == pytest.approx(
        2.65e6, rel=0.01
    )
    assert [QUANT_BYTES[f] for f in ("bf16", "f16", "f32")] == [2.0, 2.0, 4.0]


@pytest.mark.parametrize(
    "alias,name", [("q4", "q4_k"), ("q8", "q8_0"), ("q6", "q6_k"), ("fp32", "f32")]
)
def test_the_older_names_still_cost_the_format_they_name(alias, name):
    for profile in (PROFILES["rtx4090-ddr5"], calibrated(**{name: 7e9})):
        old, new = profile.for_expert(QWEN3, alias), profile.for_expert(QWEN3, name)
        assert old.expert_bytes == new.expert_bytes and old.t_cpu(1) == new.t_cpu(1)


def test_a_calibrated_profile_costs_each_format_with_its_own_figures():
    profile = calibrated(bf16=20e9, q4_k=5e9)
    bf16, q4 = profile.for_expert(QWEN3, "bf16"), profile.for_expert(QWEN3, "q4_k")
    params = 3 * 2048 * 768
    assert bf16.t_cpu(1) == pytest.approx(params * 2 / 20e9 + 1e-5)  # written out: bytes / bw + c
    assert q4.t_cpu(1) == pytest.approx(params * 144 / 256 / 5e9 + 1e-5)


def test_a_profile_without_the_experts_format_is_a_clear_error():
    with pytest.raises(UserError, match=r"bf16, q4_k experts, not q8_0.*calibrate --formats q8_0"):
        calibrated(bf16=20e9, q4_k=5e9).for_expert(QWEN3, "q8_0")


def test_a_profile_calibrated_before_formats_knows_only_its_dtype(tmp_path):
    old = CostModel(bw_cpu=2e10, f_cpu=1e11, c_cpu=1e-5, name="calibrated").to_json()
    path = tmp_path / "v2.json"
    path.write_text(json.dumps({**old, "version": 2, "dtype": "bfloat16"}))
    profile = CostModel.load(path)
    assert list(profile.cpu_formats) == ["bf16"]
    assert profile.for_expert(QWEN3, "bf16").bw_cpu == 2e10
    with pytest.raises(UserError, match="not q4_k"):
        profile.for_expert(QWEN3, "q4_k")


def test_bytes_as_stored_replace_the_formats_own():
    assert (
        PROFILES["rtx4090-ddr5"].for_expert(QWEN3, "q4_k", expert_bytes=2.9e6).expert_bytes == 2.9e6
    )


def hybrid(path, profile):
    config = HybridConfig(device="emulated", policy="cpu")
    return load_model(
        path,
        runtime_factory=lambda shape, dtype: HybridRuntime(shape, dtype, config, profile),
        progress=False,
    )


def test_the_runtime_costs_experts_in_the_format_and_bytes_the_store_keeps(tmp_path):
    build_tiny("qwen3_moe", tmp_path)
    path = write_gguf(tmp_path, tmp_path / "q8.gguf", Q.Q8_0)
    runtime = hybrid(path, calibrated(q8_0=7e9, f32=9e9)).runtime
    records = runtime.store.records.values()
    mean = sum(w.gate_up.nbytes() + w.down.nbytes() for w in records) // len(records)
    assert runtime.quant == "q8_0" == expert_format(path, torch.float32)
    assert runtime.cost.expert_bytes == mean and runtime.cost.bw_cpu == 7e9
    dense = hybrid(tmp_path, calibrated(q8_0=7e9, f32=9e9)).runtime  # the checkpoint itself
    assert dense.quant == "f32" == expert_format(tmp_path, torch.float32)
    assert dense.cost.bw_cpu == 9e9


def test_a_profile_lacking_the_files_format_is_one_line(tiny_chat_model, tmp_path):
    path = write_gguf(tiny_chat_model, tmp_path / "q8.gguf", Q.Q8_0)
    profile = tmp_path / "p.json"
    calibrated(bf16=9e9, f32=9e9).save(profile)
    run = hybridmoe(
        "generate", "--model", path, "--tokenizer", tiny_chat_model, "--device", "emulated",
        "--calibration", profile, "--prompt", "hi", "--max-tokens", "2", timeout=120,
    )  # fmt: skip
    assert run.returncode == 2 and "Traceback" not in run.stderr
    (line,) = [row for row in run.stderr.splitlines() if "error" in row]
    assert "not q8_0" in line and "calibrate --formats q8_0" in line
