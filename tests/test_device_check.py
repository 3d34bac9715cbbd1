"""`--device auto` takes CUDA only where the CUDA path was checked to give the CPU's tokens: the
check itself (run here on the emulated accelerator, on CUDA where there is one), its cache, and
the CUDA path's own tests, which skip without CUDA."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from hybridmoe.cli import device_check
from hybridmoe.cli.options import _device

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture
def cache_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    return tmp_path


def test_the_check_passes_on_the_emulator_and_is_kept(cache_home):
    assert device_check.verified("emulated")
    path = device_check.check_path("emulated")
    kept = json.loads(path.read_text())
    assert kept["passed"] and path.is_relative_to(cache_home)
    # Read back, not run again: a result written as failed is what the next call says.
    path.write_text(json.dumps({**kept, "passed": False}))
    assert not device_check.verified("emulated")


def test_a_path_that_breaks_fails_the_check(cache_home):
    passed, detail = device_check.run_check("no-such-device")
    assert not passed and detail


def args(**kw):
    return argparse.Namespace(**{"device": "auto", "budget": None, "policy": None, **kw})


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without CUDA")
def test_auto_without_cuda_runs_experts_on_the_cpu():
    assert _device(args(budget="0.5")) == "cpu" and _device(args()) == "cpu"
    assert _device(args(device="emulated")) == "emulated"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_auto_takes_cuda_once_its_check_passed(cache_home):
    assert device_check.verified("cuda")
    assert json.loads(device_check.check_path("cuda").read_text())["passed"]
    assert _device(args(budget="0.5")) == "cuda"
    assert _device(args()) == "cpu"  # no budget, no policy: no GPU experts asked for
