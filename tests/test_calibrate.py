"""Calibration writes a profile the engine loads; the CLI's runtime options reach the runtime."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from hybridmoe.cli import main
from hybridmoe.errors import UserError
from hybridmoe.experts.plan.cost_fit import Sample, fit
from hybridmoe.experts.plan.cost_model import CPU_FIELDS, CostModel
from hybridmoe.experts.plan.shape import ExpertShape
from hybridmoe.experts.run import calibrate as cal


@pytest.fixture
def small_shapes(monkeypatch):
    """Small experts and few token counts: the same code path in a second."""
    monkeypatch.setattr(
        cal, "FIT_SHAPES", ((512, 256), (1536, 768))
    )  # 1.5 and 14 MB: time grows with size
    monkeypatch.setattr(cal, "CHECK_SHAPES", ((1024, 512),))
    monkeypatch.setattr(cal, "QUICK_CHECK_SHAPES", ((1024, 512),))
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
    assert {(c["hidden"], c["intermediate"]) for c in data["checks"]} == {
        (1024, 512)
    }  # held out of the fit
    assert all(c["measured"] > 0 and c["predicted"] > 0 for c in data["checks"])
    assert {(s.bytes, s.n_tokens) for s in result.samples}.isdisjoint(
        {(1024 * 512 * 12, n) for n in (3, 48)}
    )


def test_the_check_uses_the_runtime_cost_formula():
    profile = CostModel(bw_cpu=20e9, f_cpu=1e11, c_cpu=3e-5)
    shape = ExpertShape(hidden=512, intermediate=256, num_experts=4, top_k=2, moe_layers=(0,))
    costed = profile.for_expert(shape, "fp32")
    for n in (1, 7, 300):
        sample = Sample("cpu", n, 0.0, bytes=costed.expert_bytes, flops=costed.flops_per_token * n)
        assert cal.predict(profile, sample) == pytest.approx(costed.t_cpu(n))


def _by_hand(kind, b, fl, n, k):
    """The cost model's time for one call, written out from DESIGN.md (not through CostModel)."""
    if n == 1:
        return b / k["bw_one"] + k["c_one"]
    return max(b / k["bw"], fl / k["f"]) + k["c"]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fit_recovers_the_constants_that_made_the_samples(seed):
    rng = np.random.default_rng(seed)
    known = {
        "bw": rng.uniform(5e9, 30e9),
        "f": rng.uniform(3e10, 3e11),
        "c": rng.uniform(5e-6, 5e-5),
        "c_one": rng.uniform(1e-6, 3e-5),
    }
    known["bw_one"] = known["bw"] * rng.uniform(1.0, 2.5)
    samples = []
    for hidden, inter in (
        (256, 64),
        (576, 48),
        (1024, 256),
        (4096, 1536),
    ):  # 0.2 to 75 MB: small and large
        b, params = 3 * hidden * inter * 4, 3 * hidden * inter
        for n in (1, 2, 4, 8, 32, 128, 512):
            samples.append(
                Sample(
                    "cpu",
                    n,
                    _by_hand("cpu", b, 2.0 * params * n, n, known),
                    bytes=b,
                    flops=2.0 * params * n,
                )
            )
    p = fit(samples)
    got = {"bw": p.bw_cpu, "f": p.f_cpu, "c": p.c_cpu, "bw_one": p.bw_cpu_one, "c_one": p.c_cpu_one}
    for name, value in known.items():
        assert got[name] == pytest.approx(value, rel=0.01), name


def test_gpu_and_copies_fit_from_pinned_and_pageable_sources_and_the_profile_says_which():
    samples = [
        Sample("cpu", n, 1e-4 * b / 1e6 + 1e-5, bytes=b, flops=1.0)
        for b in (1e6, 9e6)
        for n in (1, 8)
    ]
    for b in (1e6, 4e6, 16e6):
        samples.append(Sample("gpu", 1, b / 900e9 + 5e-6, bytes=b, flops=2.0 * b / 2))
        samples.append(Sample("copy", 0, b / 24e9 + 1e-5, bytes=b, flops=0.0))
        samples.append(Sample("copy_pageable", 0, b / 13e9 + 3e-5, bytes=b, flops=0.0))
    p = fit(samples)
    assert p.has_gpu and p.copy_source == "pinned"
    assert p.bw_pcie == pytest.approx(24e9, rel=1e-6) and p.c_copy == pytest.approx(1e-5)
    assert p.bw_pcie_pageable == pytest.approx(13e9, rel=1e-6)
    assert p.c_copy_pageable == pytest.approx(3e-5)
    assert CostModel.from_json(json.loads(json.dumps(p.to_json()))) == p
    assert not p.without_gpu().copy_source and not p.without_gpu().bw_pcie_pageable


def test_a_cuda_calibration_times_copies_from_both_sources():
    jobs = cal._jobs(quick=True, cuda=True)
    kinds = {(k, r) for k, r, *_ in jobs}
    assert {("copy", "fit"), ("copy_pageable", "fit"), ("gpu", "fit")} <= kinds
    # GPU experts rotate over more bytes than any GPU's L2 (an H100's 50 MB, a 4090's 96 MB)
    assert cal.GPU_ROTATE_BYTES >= 2 * 96e6


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_calibration_measures_cold_and_records_the_copy_source(small_shapes, tmp_path):
    result = cal.calibrate(torch.bfloat16, quick=True, progress=False, cuda=True)
    p = result.profile
    assert p.has_gpu and p.copy_source == "pinned" and p.bw_pcie_pageable > 0
    assert p.gpu_rotate_bytes == cal.GPU_ROTATE_BYTES
    experts = cal.gpu_experts(512, 256, torch.bfloat16, cal.GPU_ROTATE_BYTES)
    assert sum(w.gate_up.numel() + w.down.numel() for w in experts) * 2 >= cal.GPU_ROTATE_BYTES
    assert len({w.gate_up.data_ptr() for w in experts}) == len(experts)  # distinct memory
    assert (
        cal.time_copy(1 << 22, 3, pinned=True) > 0 and cal.time_copy(1 << 22, 3, pinned=False) > 0
    )
    result.save(tmp_path / "p.json")
    assert CostModel.load(tmp_path / "p.json").copy_source == "pinned"
    assert {c.kind for c in result.checks} >= {"gpu", "copy", "copy_pageable"}


def test_fit_shapes_span_small_experts_to_beyond_the_last_level_cache():
    """The per-call constant shows only on small experts, bandwidth only on large ones (a fit on
    large ones alone once put c_cpu at 0.40 ms, 10x a 576x48 expert's whole call)."""
    mb = sorted(3 * h * i * 4 / 1e6 for h, i in cal.FIT_SHAPES)
    assert mb[0] < 0.5 and mb[-1] > 64
    for shapes in (cal.CHECK_SHAPES, cal.QUICK_CHECK_SHAPES):
        held = sorted(3 * h * i * 4 / 1e6 for h, i in shapes)
        assert held[0] < 1 and held[-1] > 32 and not set(shapes) & set(cal.FIT_SHAPES)
    fit_shapes, check_shapes = cal._shapes(quick=True, model=(768, 96))
    assert (768, 96) in fit_shapes and (768, 96) not in check_shapes


def measured(bw_cpu: float, formats) -> CostModel:
    """What calibrate returns for `formats` (default f32), every format at `bw_cpu`."""
    m = CostModel(bw_cpu=bw_cpu, f_cpu=1e11, c_cpu=1e-5, name="calibrated")
    m.cpu_formats = {f: {k: getattr(m, k) for k in CPU_FIELDS} for f in formats or ("f32",)}
    return m


def test_first_start_measures_once_then_reads_the_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    calls = []

    def fake(dtype, quick=False, progress=True, cuda=None, model=None, formats=None):
        calls.append((quick, model))
        return cal.Calibration(measured(1e10, formats), dtype)

    monkeypatch.setattr(cal, "calibrate", fake)
    first = cal.load_or_calibrate(None, torch.float32, progress=False, model=(576, 48))
    second = cal.load_or_calibrate(None, torch.float32, progress=False, model=(576, 48))
    other = cal.load_or_calibrate(None, torch.float32, progress=False, model=(2048, 768))
    assert (
        calls == [(True, (576, 48)), (True, (2048, 768))]
        and first.bw_cpu == second.bw_cpu == other.bw_cpu
    )
    assert cal.default_profile_path(torch.float32, (576, 48)).is_relative_to(tmp_path / "hybridmoe")
    assert cal.default_profile_path(torch.float32, (576, 48)) != cal.default_profile_path(
        torch.float32
    )


def test_first_start_measures_again_over_a_profile_of_an_older_format(monkeypatch, tmp_path):
    """Profiles before version 2 lack the CPU's row regime: the cache is measured again,
    not read."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    calls = []

    def fake(dtype, quick=False, progress=True, cuda=None, model=None, formats=None):
        calls.append(model)
        return cal.Calibration(measured(2e10, formats), dtype)

    monkeypatch.setattr(cal, "calibrate", fake)
    path = cal.default_profile_path(torch.float32, (576, 48))
    path.parent.mkdir(parents=True)
    path.write_text(
        json.dumps({**CostModel(bw_cpu=1e10, f_cpu=1e11, c_cpu=1e-5).to_json(), "version": 1})
    )
    assert (
        cal.load_or_calibrate(None, torch.float32, progress=False, model=(576, 48)).bw_cpu == 2e10
    )
    assert (
        cal.load_or_calibrate(None, torch.float32, progress=False, model=(576, 48)).bw_cpu == 2e10
    )
    assert calls == [(576, 48)] and json.loads(path.read_text())["version"] == 3


def test_cache_sizes_are_read_from_sysfs(tmp_path, monkeypatch):
    """L1 is left out; a private L2 counts once per thread, the shared L3 once."""
    for index, (level, kind, size, cpus) in enumerate(
        [
            (1, "Data", "48K", "0"),
            (1, "Instruction", "32K", "0"),
            (2, "Unified", "1024K", "0"),
            (3, "Unified", "32768K", "0-3"),
        ]
    ):
        d = tmp_path / f"index{index}"
        d.mkdir()
        for name, value in (
            ("level", level),
            ("type", kind),
            ("size", size),
            ("shared_cpu_list", cpus),
        ):
            (d / name).write_text(f"{value}\n")
    monkeypatch.setattr(cal.os, "cpu_count", lambda: 4)
    assert cal.cpu_caches(1, tmp_path) == (2**20, 32 * 2**20)
    assert cal.cpu_caches(2, tmp_path) == (2 * 2**20, 32 * 2**20)
    assert cal.cpu_caches(8, tmp_path) == (4 * 2**20, 32 * 2**20)  # no more L2s than cores
    assert cal.cpu_caches(1, tmp_path / "missing") == ()


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
    code = main(
        [
            "generate",
            "--model",
            str(tiny_chat_model),
            "--prompt",
            "Hello there, how are you?",
            "--max-tokens",
            "5",
            "--temperature",
            "0",
            "--device",
            "emulated",
            "--gpu-expert-budget",
            "0.5",
            "--stats",
            "--calibration",
            str(profile),
            "--record-trace",
            str(trace),
            "--expert-stats-out",
            str(stats),
        ]
    )
    assert code == 0
    err = capsys.readouterr().err
    assert "expert runtime: emulated, policy value" in err and "hits" in err
    assert len(trace.read_text().splitlines()) == 4 and json.loads(stats.read_text())["tokens"] > 4


@pytest.mark.parametrize(
    "args,fragment",
    [
        (["--gpu-expert-budget", "lots"], "GPU expert budget"),
        (["--calibration", "/nonexistent/p.json"], "calibrate"),
    ],
)
def test_bad_runtime_options_are_one_line_errors(tiny_chat_model, capsys, args, fragment):
    code = main(
        [
            "generate",
            "--model",
            str(tiny_chat_model),
            "--prompt",
            "Hi",
            "--max-tokens",
            "2",
            "--device",
            "emulated",
            *args,
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and fragment in err and "Traceback" not in err


def test_the_models_own_shape_is_fitted_closer_when_it_weighs_more():
    """Effective bandwidth varies by shape; the profile made for a model leans to its experts."""
    rng = np.random.default_rng()
    own_bw, other_bw = rng.uniform(12e9, 16e9), rng.uniform(20e9, 24e9)
    own_b, other = 3 * 576 * 48 * 4, (3 * 256 * 64 * 4, 3 * 2048 * 768 * 4, 3 * 4096 * 1536 * 4)

    def samples(weight):
        rows = [
            Sample("cpu", 1, own_b / own_bw + 1e-5, bytes=own_b, flops=own_b / 2, weight=weight)
        ]
        return rows + [Sample("cpu", 1, b / other_bw + 1e-5, bytes=b, flops=b / 2) for b in other]

    def own_error(weight):
        s = samples(weight)[0]
        return abs(cal.predict(fit(samples(weight)), s) / s.seconds - 1)

    assert own_error(len(other)) < own_error(1.0)


def test_each_format_is_measured_on_its_own_kernels(small_shapes):
    """A Q8_0 expert streams 34/32 bytes per weight through the integer kernels, an f32 one 4 bytes
    through torch: the profile keeps each format's CPU figures, and the Q8_0 checks are predicted
    better by the Q8_0 figures than by the f32 ones."""
    from hybridmoe.native import quant as kernels

    if kernels.library() is None:  # no native quantiser: block formats cannot be measured here
        with pytest.raises(UserError, match="native quantiser"):
            cal.calibrate(torch.float32, quick=True, progress=False, cuda=False, formats=("q8_0",))
        return
    result = cal.calibrate(
        torch.float32, quick=True, progress=False, cuda=False, formats=("f32", "q8_0")
    )
    profile = result.profile
    assert list(profile.cpu_formats) == ["f32", "q8_0"]
    params = {cal.expert_params(h, i) for h, i in cal.FIT_SHAPES}
    assert {s.bytes for s in result.samples} == {p * b for p in params for b in (4.0, 34 / 32)}
    q8 = [c for c in result.checks if c.format == "q8_0"]
    assert q8 and {c.format for c in result.checks} == {"f32", "q8_0"}

    def error(fmt, c):
        s = cal._sample("cpu", c.hidden, c.intermediate, c.n_tokens, "q8_0", c.measured)
        return abs(cal.predict(profile.for_format(fmt), s) / c.measured - 1)

    assert sum(error("q8_0", c) for c in q8) < sum(error("f32", c) for c in q8)


def test_calibrate_command_names_a_format_it_does_not_keep(capsys):
    assert main(["calibrate", "--quick", "--formats", "q3_k"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "q3_k" in err[0]
