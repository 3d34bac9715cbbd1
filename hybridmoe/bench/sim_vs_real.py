"""`hybridmoe bench sim-vs-real`: does the simulator predict what the engine measures?

Runs a model on the emulated accelerator with the `cpu` policy while recording its routing, then
replays that trace through `simulate` with the same cost profile and the model's own shape, and
prints both expert times per decode token. The run's "measured" time is the runtime's layer clock:
the CPU pool's wall time for the layer's experts plus the modelled activation transfer, which is
what the simulator's `cpu` plan predicts. Compare on an idle machine; the figure is not a test.
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import date
from pathlib import Path

PROMPT = "The history of the Roman empire"


def add_parser(sub) -> None:
    p = sub.add_parser(
        "sim-vs-real",
        help="simulated vs measured expert time per token (cpu policy)",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument(
        "--model", metavar="PATH", help="Hugging Face directory (default: the demo model)"
    )
    p.add_argument(
        "--calibration", metavar="FILE", help="cost profile (default: this machine's, cached)"
    )
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompt", default=PROMPT)
    p.add_argument(
        "--threads", type=int, default=1, help="torch threads (default 1: the calibration's)"
    )
    p.add_argument(
        "--trace-out", metavar="FILE", default="sim-vs-real.jsonl", help="where the trace goes"
    )
    p.set_defaults(func=run)


def measure(path: Path, cost, trace: Path, prompt_ids: list[int], max_tokens: int) -> dict:
    """Generate with the cpu policy on the emulated accelerator; per decode token figures (ms)."""
    from hybridmoe.engine.generate import generate_ids
    from hybridmoe.engine.sampler import SamplingParams
    from hybridmoe.experts.run.hybrid_runtime import HybridConfig, HybridRuntime
    from hybridmoe.experts.run.observers import TraceRecorder
    from hybridmoe.loader import load_model

    config = HybridConfig(policy="cpu", device="emulated", history=max_tokens + 8)
    model = load_model(
        path, runtime_factory=lambda s, d: HybridRuntime(s, d, config, cost), progress=False
    )
    model.runtime.add_observer(TraceRecorder(trace, len(model.runtime.layers)))
    wall, cpu = time.perf_counter(), time.process_time()
    list(
        generate_ids(
            model,
            prompt_ids,
            SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
        )
    )
    # The layer clock is wall time; the calibration counts CPU time. On a shared machine the run got
    # only a share of a core (one thread: process CPU time / wall time), and the rest of its wall
    # time was other processes' slices, which no cost model of this machine predicts.
    share = min(1.0, (time.process_time() - cpu) / (time.perf_counter() - wall))
    model.runtime.close()
    decode = [
        s for s in model.runtime.stats.history if s["tokens"] == 1
    ]  # the prompt's step is not decode
    n = len(decode)
    return {
        "decode_tokens": n,
        "measured_ms_per_token": 1e3 * sum(s["measured_s"] for s in decode) / n,
        "cpu_busy_ms_per_token": 1e3 * sum(s["cpu_busy_s"] for s in decode) / n,
        "runtime_predicted_ms_per_token": 1e3 * sum(s["predicted_s"] for s in decode) / n,
        "cpu_share": share,
        "measured_times_cpu_share_ms_per_token": share
        * 1e3
        * sum(s["measured_s"] for s in decode)
        / n,
    }


def simulate_trace(trace: Path, config_json: Path, cost) -> dict:
    """The same trace through the simulator, cpu policy,
    every token measured (nothing to warm up)."""
    from hybridmoe.experts.plan.trace_format import read_trace
    from hybridmoe.experts.run.hybrid_runtime import device_cost
    from hybridmoe.sim.locality import consecutive_overlap
    from hybridmoe.sim.shapes import get_shape
    from hybridmoe.sim.simulator import SimConfig, simulate

    shape, lines = get_shape(str(config_json)), read_trace(trace)
    # The run's accelerator was emulated, so its clock counts activation transfers to the CPU: the
    # simulator gets the same device constants (device_cost), not the CPU-only profile.
    cost = device_cost(cost, "emulated").for_expert(shape.experts, "fp32")
    result = simulate(lines, shape, cost, SimConfig(policy="cpu", budget="0", profile_tokens=0))
    return {
        "simulated_ms_per_token": result.expert_ms_per_token,
        "trace_tokens": len(lines),
        "consecutive_overlap": consecutive_overlap(lines),
    }


def run(args) -> int:
    import torch

    from hybridmoe.cli.options import model_path
    from hybridmoe.experts.run.calibrate import load_or_calibrate
    from hybridmoe.loader import load_tokenizer
    from hybridmoe.sim.shapes import get_shape

    torch.set_num_threads(args.threads)
    path = Path(model_path(args))
    experts = get_shape(str(path / "config.json")).experts
    cost = load_or_calibrate(
        args.calibration, torch.float32, model=(experts.hidden, experts.intermediate)
    )
    prompt_ids = load_tokenizer(str(path)).encode(args.prompt)
    out = {
        "model": path.name,
        "threads": args.threads,
        "date": date.today().isoformat(),
        "load_average": os.getloadavg()[0],
    }
    out.update(measure(path, cost, Path(args.trace_out), prompt_ids, args.max_tokens))
    out.update(simulate_trace(Path(args.trace_out), path / "config.json", cost))
    out["simulated_over_measured"] = out["simulated_ms_per_token"] / out["measured_ms_per_token"]
    out["simulated_over_measured_times_share"] = (
        out["simulated_ms_per_token"] / out["measured_times_cpu_share_ms_per_token"]
    )
    print(json.dumps(out, indent=2))
    print(
        f"simulated {out['simulated_ms_per_token']:.2f} ms/token vs measured "
        f"{out['measured_ms_per_token']:.2f} ({100 * (out['simulated_over_measured'] - 1):+.0f}%); "
        f"the run had {100 * out['cpu_share']:.0f}% of a core: measured x share "
        f"{out['measured_times_cpu_share_ms_per_token']:.2f} "
        f"({100 * (out['simulated_over_measured_times_share'] - 1):+.0f}%)",
        file=sys.stderr,
    )
    return 0
