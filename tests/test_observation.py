"""Observation does not change what runs: with and without --stats, --record-trace and
--expert-stats-out the same runtime runs the same CPU path (inline or on the workers, layer by
layer) and the same schedule, and greedy decoding gives the same tokens."""

from __future__ import annotations

import pytest
import torch

from hybridmoe.cli import build_parser
from hybridmoe.cli.options import finish_runtime, load_from_args
from hybridmoe.engine.generate import generate_ids
from hybridmoe.engine.model_runner import overlap_unsupported
from hybridmoe.engine.sampler import SamplingParams
from hybridmoe.experts.plan.cost_model import CostModel

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPT = [12, 400, 7, 1999, 33, 5]


def run(argv: list[str], threads: int) -> dict:
    """Load as `hybridmoe ARGV` would, generate, and note what ran."""
    args = build_parser(argv).parse_args(argv)
    args.threads = threads
    model, _ = load_from_args(args)
    runtime, paths = model.runtime, []
    start = runtime.cpu.start

    def noted(jobs, nbytes):  # which CPU path each layer took
        batch = start(jobs, nbytes)
        paths.append((type(batch).__name__, len(jobs)))
        return batch

    start_call = runtime.cpu.start_call

    def noted_call(call):  # a layer's experts in one native call on the kernels' threads
        batch = start_call(call)
        paths.append((type(batch).__name__, 1))
        return batch

    runtime.cpu.start, runtime.cpu.start_call = noted, noted_call
    mix = getattr(runtime, "_mix_tokens", None)

    def noted_mix(layer, x, ids, weights):  # a layer's experts and mixes in one native call
        done = mix(layer, x, ids, weights)
        if done is not None:
            paths.append(("mix_tokens", x.shape[0]))
        return done

    if mix is not None:
        runtime._mix_tokens = noted_mix
    tokens = list(generate_ids(model, PROMPT, GREEDY))
    seen = {
        "runtime": type(runtime).__name__,
        "reentrant": runtime.reentrant,
        "overlap": overlap_unsupported(model),
        "paths": paths,
        "tokens": tokens,
    }
    finish_runtime(model, args)
    return seen


@pytest.mark.parametrize(
    "placement",
    [[], ["--device", "emulated", "--gpu-expert-budget", "0.5"]],
    ids=["cpu", "emulated-gpu"],
)
@pytest.mark.parametrize("threads", [1, 2])
def test_observing_a_run_does_not_change_it(
    tiny_chat_model, tmp_path, monkeypatch, placement, threads
):
    from hybridmoe import tuning

    monkeypatch.setattr(
        tuning, "WORKERS_MIN_BYTES", 0
    )  # tiny experts: let two threads use the workers
    profile = tmp_path / "profile.json"
    CostModel(bw_cpu=2e10, f_cpu=1e11, c_cpu=1e-5, name="calibrated").save(profile)
    base = [
        "generate",
        "--model",
        str(tiny_chat_model),
        "--prompt",
        "x",
        "--calibration",
        str(profile),
        *placement,
    ]
    watched = base + [
        "--stats",
        "--record-trace",
        str(tmp_path / "t.jsonl"),
        "--expert-stats-out",
        str(tmp_path / "s.json"),
    ]
    before = torch.get_num_threads()
    try:
        plain, observed = run(base, threads), run(watched, threads)
    finally:
        torch.set_num_threads(before)
    assert observed == plain
    if threads == 2:  # a threaded CPU path was exercised (the workers, or the kernels' own pool)
        assert {name for name, _ in plain["paths"]} & {"CPUBatch", "_CallBatch", "mix_tokens"}
    assert (tmp_path / "t.jsonl").read_text() and (
        tmp_path / "s.json"
    ).read_text()  # and it was watched
