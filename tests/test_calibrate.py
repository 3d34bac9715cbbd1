"""Calibration writes a profile the engine loads; the CLI's runtime options reach the runtime."""

from __future__ import annotations

import json

import pytest
import torch

from hybridmoe.cli import main
from hybridmoe.experts import calibrate as cal
from hybridmoe.experts.cost_model import CostModel, Sample
from hybridmoe.experts.store import ExpertShape


@pytest.fixture
def small_shapes(monkeypatch):
    """Small experts and few token counts: the same code path in a second."""
    monkeypatch.setattr(cal, "FIT_SHAPES", ((512, 256), (1536, 768)))  # 1.5 and 14 MB: time grows with size
    monkeypatch.setattr(cal, "CHECK_SHAPES", ((1024, 512),))
    monkeypatch.setattr(cal, "QUICK_FIT_TOKENS", (1, 4, 16, 64))
    monkeypatch.setattr(cal, "QUICK_CHECK_TOKENS", (3, 48))
    monkeypatch.setattr(cal, "ROTATE_BYTES", 16e6)


def test_calibrate_writes_a_profile_the_engine_loads(small_shapes, tmp_path):
    result = cal.calibrate(torch.float32, quick=True, progress=False, cuda=False)
    out = tmp_path / "profile.json"
    result.save(out)
    profile = CostModel.load(out)
    assert profile.bw_cpu > 0 and profile.f_cpu > 0 and profile.c_cpu >= 0 and not profile.has_gpu
    data = json.loads(out.read_text())
    assert data["dtype"] == "float32" and data["checks"]
    assert {(c["hidden"], c["intermediate"]) for c in data["checks"]} == {(1024, 512)}  # held out of the fit
    assert all(c["measured"] > 0 and c["predicted"] > 0 for c in data["checks"])
    assert {(s.bytes, s.n_tokens) for s in result.samples}.isdisjoint({(1024 * 512 * 12, n) for n in (3, 48)})


def test_the_check_uses_the_runtime_cost_formula():
    profile = CostModel(bw_cpu=20e9, f_cpu=1e11, c_cpu=3e-5)
    shape = ExpertShape(hidden=512, intermediate=256, num_experts=4, top_k=2, moe_layers=(0,))
    costed = profile.for_expert(shape, "fp32")
    for n in (1, 7, 300):
        sample = Sample("cpu", n, 0.0, bytes=costed.expert_bytes, flops=costed.flops_per_token * n)
        assert cal.predict(profile, sample) == pytest.approx(costed.t_cpu(n))


def test_first_start_measures_once_then_reads_the_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    calls = []

    def fake(dtype, quick=False, progress=True, cuda=None):
        calls.append(quick)
        return cal.Calibration(CostModel(bw_cpu=1e10, f_cpu=1e11, c_cpu=1e-5, name="calibrated"), dtype)

    monkeypatch.setattr(cal, "calibrate", fake)
    first = cal.load_or_calibrate(None, torch.float32, progress=False)
    second = cal.load_or_calibrate(None, torch.float32, progress=False)
    assert calls == [True] and first.bw_cpu == second.bw_cpu == 1e10
    assert cal.default_profile_path(torch.float32).is_relative_to(tmp_path / "hybridmoe")


def test_calibrate_command(small_shapes, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "p.json"
    assert main(["calibrate", "--quick", "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert "held-out" in err and "largest CPU error" in err
    CostModel.load(out)


def test_generate_with_runtime_options_prints_stats(tiny_chat_model, tmp_path, capsys):
    profile, trace, stats = tmp_path / "p.json", tmp_path / "t.jsonl", tmp_path / "s.json"
    CostModel(bw_cpu=2e10, f_cpu=1e11, c_cpu=1e-5, name="calibrated").save(profile)
    code = main(["generate", "--model", str(tiny_chat_model), "--prompt", "Hello there, how are you?", "--max-tokens", "5",
                 "--temperature", "0", "--device", "emulated", "--gpu-expert-budget", "0.5", "--stats",
                 "--calibration", str(profile), "--record-trace", str(trace), "--expert-stats-out", str(stats)])
    assert code == 0
    err = capsys.readouterr().err
    assert "expert runtime: emulated, policy value" in err and "hits" in err
    assert len(trace.read_text().splitlines()) == 4 and json.loads(stats.read_text())["tokens"] > 4


@pytest.mark.parametrize("args,fragment", [
    (["--gpu-expert-budget", "lots"], "GPU expert budget"),
    (["--calibration", "/nonexistent/p.json"], "calibrate"),
])
def test_bad_runtime_options_are_one_line_errors(tiny_chat_model, capsys, args, fragment):
    code = main(["generate", "--model", str(tiny_chat_model), "--prompt", "Hi", "--max-tokens", "2",
                 "--device", "emulated", *args])
    err = capsys.readouterr().err
    assert code == 2 and fragment in err and "Traceback" not in err
