"""`hybridmoe simulate` and `hybridmoe plan` from the command line."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from hybridmoe.cli import main
from hybridmoe.experts.plan.trace_format import read_trace, write_trace
from hybridmoe.sim.shapes import SHAPES
from tests.console import hybridmoe
from tests.traces import shared_trace

ROOT = Path(__file__).resolve().parents[1]
OLMOE_TRACE = shared_trace("olmoe-1b-7b_299tok.jsonl")


@pytest.fixture(scope="module")
def short_trace(tmp_path_factory):
    path = tmp_path_factory.mktemp("traces") / "olmoe60.jsonl"
    write_trace(path, read_trace(OLMOE_TRACE)[:60])
    return str(path)


def test_simulate_json_has_the_promised_fields(short_trace, capsys):
    code = main(
        [
            "simulate",
            "--trace",
            short_trace,
            "--model-shape",
            "olmoe-1b-7b",
            "--hardware",
            "rtx4090-ddr5",
            "--gpu-expert-budget",
            "0.25",
            "--policy",
            "value",
            "--quant",
            "q4",
            "--json",
        ]
    )
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    for key in (
        "policy",
        "hit_rate",
        "expert_ms_per_token",
        "tokens_per_s",
        "pct_of_oracle_speed",
        "belady_min_hit_rate",
    ):
        assert key in out
    assert out["policy"] == "value" and out["tokens"] == 30
    per_token = out["expert_ms_per_token"] + out["plan_ms_per_token"] + out["dense_ms_per_token"]
    assert out["plan_ms_per_token"] > 0  # the planner's measured time is charged
    assert out["tokens_per_s"] == pytest.approx(1e3 / per_token)
    assert 0 < out["hit_rate"] <= 1 and 0 < out["belady_min_hit_rate"] <= 1


def test_simulate_text_report(short_trace, capsys):
    assert (
        main(
            [
                "simulate",
                "--trace",
                short_trace,
                "--model-shape",
                "olmoe-1b-7b",
                "--policy",
                "static",
                "--no-oracle",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "ms/token" in out and "hit rate" in out and "policy static" in out


def test_sweep_writes_table_and_png(short_trace, tmp_path, capsys):
    png = tmp_path / "sweep.png"
    code = main(
        [
            "simulate",
            "--trace",
            short_trace,
            "--model-shape",
            "olmoe-1b-7b",
            "--sweep",
            "--quant",
            "q4",
            "--hardware",
            "rtx4090-ddr5,rtx4060-8gb-ddr5",
            "--budgets",
            "0.1,0.5",
            "--policies",
            "static,value,oracle",
            "--plot",
            str(png),
        ]
    )
    assert code == 0
    out = capsys.readouterr().out
    assert out.count("rtx4060-8gb-ddr5") == 6 and "oracle" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_mismatched_trace_and_shape_is_exit_code_2(short_trace, capsys):
    code = main(["simulate", "--trace", short_trace, "--model-shape", "qwen3-30b-a3b"])
    assert code == 2
    err = capsys.readouterr().err
    assert "16 MoE layers" in err and "--model-shape" in err


def test_a_trace_with_more_layers_than_the_shape_is_exit_code_2(capsys):
    """The demo model's 30-layer trace on OLMoE's 16 layers: the oracle read past the shape's
    layers (an IndexError) before the trace was checked."""
    trace = str(ROOT / "docs/traces/demo-smollm2-e16k8_63tok.jsonl")
    assert main(["simulate", "--trace", trace, "--model-shape", "olmoe-1b-7b"]) == 2
    err = capsys.readouterr().err
    assert "30 MoE layers" in err and "olmoe-1b-7b has 16" in err and "Traceback" not in err


def test_bad_budget_and_unknown_hardware_are_exit_code_2(short_trace):
    base = ["simulate", "--trace", short_trace, "--model-shape", "olmoe-1b-7b", "--no-oracle"]
    assert main(base + ["--gpu-expert-budget", "lots"]) == 2
    assert main(base + ["--hardware", "rtx9090"]) == 2
    assert (
        main(["simulate", "--model-shape", "olmoe-1b-7b"]) == 2
    )  # neither --trace nor --synthetic


def test_bad_trace_from_a_subprocess_gives_one_line_and_no_traceback(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"tok": 1, "layers": "nope"}\n')
    proc = hybridmoe("simulate", "--trace", str(bad), "--model-shape", "olmoe-1b-7b", timeout=120)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and "line 1" in proc.stderr


def test_plan_recommends_a_quantisation_that_fits(capsys):
    code = main(
        ["plan", "--hardware", "rtx4060-8gb-ddr5", "--model-shape", "olmoe-1b-7b", "--json"]
    )
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert {o["quant"] for o in out["options"]} == {"bf16", "q8_0", "q4_k_m"}
    q4 = next(o for o in out["options"] if o["quant"] == "q4_k_m")
    bf16 = next(o for o in out["options"] if o["quant"] == "bf16")
    assert q4["expert_budget"] > bf16["expert_budget"]  # smaller experts, more of them fit in 8 GB
    # host RAM counts the pinned staging ring (3 buffers of the largest expert, each rounded up to
    # a power of two) and the activation buffers (512 tokens up, 512 x top-k rows back), no more
    # the experts at the bytes the GGUF file of that format holds (sim/file_bytes.py, checked
    # against exported files in test_plan_sizes_each_format_as_the_exported_file_holds_it)
    from hybridmoe.sim.file_bytes import routed_bytes

    shape = SHAPES["olmoe-1b-7b"]
    e = shape.experts
    for o in (bf16, q4):
        routed = routed_bytes(shape, o["quant"])
        ring = 3 * 2 ** math.ceil(math.log2(routed / (e.num_experts * shape.num_moe_layers)))
        rows = 2 ** math.ceil(math.log2(512 * e.hidden * 2))
        back = 2 ** math.ceil(math.log2(512 * e.top_k * e.hidden * 2))
        assert o["pinned_gb"] == pytest.approx((ring + rows + back) / 1e9)
        assert o["ram_needed_gb"] == pytest.approx(routed / 1e9 + o["pinned_gb"] + 4.0)
    assert out["best"]["fits_ram"] and out["best"]["tokens_per_s"] == max(
        o["tokens_per_s"] for o in out["options"]
    )
    assert (
        main(
            [
                "plan",
                "--hardware",
                "rtx4090-ddr5",
                "--model-shape",
                "deepseek-v3",
                "--ram",
                "64",
                "--vram",
                "-1",
            ]
        )
        == 2
    )


def test_plan_shows_its_progress_on_stderr():
    run = hybridmoe("plan", "--model-shape", "olmoe-1b-7b", "--hardware", "rtx4090-ddr5")
    assert run.returncode == 0, run.stderr
    assert "simulating" in run.stderr and "9/9" in run.stderr  # 3 quantisations x 3 policies
    assert "simulating" not in run.stdout


def test_plan_sizes_each_format_as_the_exported_file_holds_it(tmp_path):
    """The routed experts' bytes `plan` counts for a model are the bytes of the expert tensors in
    the GGUF file `hybridmoe export` writes of it, Q4_K_M's Q6_K layers and the fallbacks of rows
    that do not fill 256-blocks included."""
    import gguf

    from hybridmoe.export.gguf_export import export_gguf
    from hybridmoe.export.sources import Checkpoint
    from hybridmoe.sim.file_bytes import routed_bytes
    from hybridmoe.sim.shapes import get_shape
    from tests.tiny import build_tiny

    build_tiny("qwen3_moe", tmp_path / "hf")
    shape = get_shape(str(tmp_path / "hf"))
    for fmt in ("bf16", "q8_0", "q4_k_m"):
        out = tmp_path / f"{fmt}.gguf"
        export_gguf(Checkpoint(tmp_path / "hf"), out, f"gguf-{fmt}", threads=1)
        tensors = gguf.GGUFReader(out).tensors
        in_file = sum(int(t.n_bytes) for t in tensors if "_exps." in t.name)
        assert routed_bytes(shape, fmt) == in_file, fmt
