"""`hybridmoe plan`: the quantisation, GPU expert budget and policy that are fastest on a
machine."""

from __future__ import annotations

import argparse
import json

from hybridmoe.experts.plan.profiles import PROFILES


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "plan",
        help="advise quantisation, GPU expert budget and policy for a machine and a model shape",
        description="Simulates the model in each GGUF file format (bf16, q8_0, q4_k_m; sized in "
        "their real blocks, tensor by tensor as llama.cpp types them) at the GPU expert budget "
        "that fits next to the dense weights and a KV-cache reserve, and reports the fastest, the "
        "VRAM left for the KV cache, and whether RAM suffices.",
    )
    p.add_argument(
        "--hardware",
        metavar="PROFILE",
        required=True,
        help=f"{', '.join(PROFILES)} or a calibration JSON",
    )
    p.add_argument(
        "--model-shape", metavar="SHAPE", required=True, help="a named shape or a config.json path"
    )
    p.add_argument(
        "--vram", type=float, metavar="GB", default=None, help="GPU memory (default: the profile's)"
    )
    p.add_argument(
        "--ram", type=float, metavar="GB", default=None, help="host memory (default: the profile's)"
    )
    p.add_argument(
        "--kv-gb",
        type=float,
        default=None,
        help="VRAM kept for the KV cache (default: 10%% of VRAM, at least 1)",
    )
    p.add_argument(
        "--trace",
        metavar="FILE",
        help="routing trace to simulate (default: a synthetic one of the shape)",
    )
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from hybridmoe.errors import UserError
    from hybridmoe.experts.plan.trace_format import read_trace
    from hybridmoe.sim.advisor import advise, best, to_json
    from hybridmoe.sim.shapes import get_shape
    from hybridmoe.sim.simulator import check_trace

    shape = get_shape(args.model_shape)
    lines = None
    if args.trace:
        lines = read_trace(args.trace)
        check_trace(lines, shape)
    for name in ("vram", "ram", "kv_gb"):
        if getattr(args, name) is not None and getattr(args, name) < 0:
            raise UserError(f"--{name.replace('_', '-')} must not be negative")
    options = advise(
        shape, args.hardware, args.vram, args.ram, lines, kv_gb=args.kv_gb, progress=True
    )
    choice = best(options)
    if args.json:
        print(json.dumps({"options": to_json(options), "best": choice and to_json([choice])[0]}))
        return 0
    print(
        f"{shape.name} on {args.hardware}"
        + ("" if args.trace else " (synthetic routing: skew 1.0, locality 0.4)")
    )
    print(
        f"{'format':7s} {'fits RAM':>8s} {'RAM GB':>7s} {'pinned':>7s} {'budget':>7s} "
        f"{'GPU GB':>7s} {'KV GB':>6s} {'policy':9s} {'tok/s':>7s}"
    )
    for o in options:
        print(
            f"{o.quant:7s} {'yes' if o.fits_ram else 'no':>8s} {o.ram_needed_gb:7.1f} "
            f"{o.pinned_gb:7.2f} {100 * o.expert_budget:6.1f}% {o.expert_gb_on_gpu:7.1f} "
            f"{o.kv_gb:6.1f} {o.policy:9s} {o.tokens_per_s:7.1f}"
        )
    if choice is None:
        print("the model does not fit in RAM in any quantisation: add RAM or pick a smaller model")
    else:
        print(
            f"best: a {choice.quant} file, --gpu-expert-budget {choice.expert_budget:g}, --policy "
            f"{choice.policy}: {choice.tokens_per_s:.1f} tok/s, {choice.kv_gb:.1f} GB VRAM left "
            "for the KV cache"
        )
    return 0
