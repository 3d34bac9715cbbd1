"""The README's main job on a fresh machine (`bench first-run`: an empty user cache): the demo
model is built from the shipped fit with a notice that says so, and the question is answered. How
long it takes is the benchmark's figure (docs/benchmarks.md, "First run"), not asserted here."""

from __future__ import annotations

import json
import subprocess
import sys


def test_a_fresh_cache_builds_from_the_shipped_fit_and_answers():
    from hybridmoe.demo.cache import SHIPPED_ESTIMATE

    out = subprocess.run(
        [sys.executable, "-m", "hybridmoe", "bench", "first-run", "--runs", "1", "--json"],
        capture_output=True,
        text=True,
        check=True,
    )
    run = json.loads(out.stdout)["runs"][0]
    assert "Paris" in run["answer"]
    assert run["demo"]["downs"] == "shipped" and run["demo"]["active_fraction"] == 0.75
    assert len(run["notice"]) == 1 and SHIPPED_ESTIMATE in run["notice"][0]
    assert 0 < run["first_answer_s"] <= run["end_s"]
