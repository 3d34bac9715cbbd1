"""The planner decides as it did before its planning was made cheaper: every plan of a dozen
synthetic runs (policies, shapes, decode batches and prefill chunks) against the digests recorded
from the plain implementation (tests/plan_decisions.py, tests/data/plan_decisions.json)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import hybridmoe.native.predictor_kernels as predictor_kernels
import hybridmoe.native.split_kernels as split_kernels
from tests.plan_decisions import RUNS, name, record

RECORDED = json.loads((Path(__file__).parent / "data" / "plan_decisions.json").read_text())


@pytest.mark.parametrize("native", [True, False], ids=["c-kernels", "numpy"])
@pytest.mark.parametrize("run", RUNS, ids=name)
def test_every_plan_is_the_one_the_plain_planner_made(run, native, monkeypatch):
    """With the C kernels (the predictor's, the split's) and with the numpy and Python paths
    alike."""
    if not native:
        monkeypatch.setattr(predictor_kernels, "library", lambda: None)
        monkeypatch.setattr(split_kernels, "library", lambda: None)
    elif predictor_kernels.library() is None or split_kernels.library() is None:
        pytest.fail("the planner's C kernels did not build (no C compiler?)")
    want = RECORDED[name(run)]
    got = record(*run)
    first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
    assert first is None, (
        f"step {first} of {len(want) - 1} decides differently (the last: counters)"
    )
    assert len(got) == len(want)
