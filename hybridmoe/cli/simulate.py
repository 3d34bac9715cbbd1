"""`hybridmoe simulate`: replay a routing trace through the planner on modelled hardware."""

from __future__ import annotations

import argparse
import json

from hybridmoe.cli.options import add_config_flags, config_values
from hybridmoe.errors import UserError
from hybridmoe.experts.plan.cost_model import QUANT_BYTES, format_name
from hybridmoe.experts.plan.policies import POLICIES
from hybridmoe.experts.plan.profiles import PROFILES
from hybridmoe.sim.shapes import SHAPES
from hybridmoe.sim.simulator import SimConfig


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "simulate",
        help="predict decode speed of each placement policy on modelled hardware from a routing "
        "trace",
        description="Replay a routing trace through the same planner the engine runs, on a model "
        "of the CPU, GPU and copy stream. The first --profile-tokens only build statistics; "
        "figures are on the rest.",
    )
    add_trace_options(p.add_argument_group("trace and machine"))
    g = p.add_argument_group("simulation")
    add_config_flags(g, SimConfig)
    g.add_argument(
        "--dense-ms",
        type=float,
        default=0.0,
        help="extra non-expert milliseconds per layer, beside the modelled dense part",
    )
    add_comparison_options(p.add_argument_group("comparison"))
    p.set_defaults(func=run)


def add_trace_options(g) -> None:
    g.add_argument(
        "--trace", metavar="FILE", help="routing trace (JSONL, as written by --record-trace)"
    )
    g.add_argument(
        "--synthetic",
        metavar="SPEC",
        help="instead of --trace: a synthetic trace, e.g. 'tokens=300,skew=1.0,"
        "locality=0.4,drift=60,seed=0' (layers and experts from the shape)",
    )
    g.add_argument(
        "--model-shape",
        metavar="SHAPE",
        required=True,
        help=f"{', '.join(SHAPES)}, or a config.json path",
    )
    g.add_argument(
        "--hardware",
        metavar="PROFILE",
        default="rtx4090-ddr5",
        help=f"a profile ({', '.join(PROFILES)}) or a calibration JSON; comma-separate "
        "several with --sweep",
    )
    g.add_argument(
        "--quant",
        choices=sorted(QUANT_BYTES),
        default="bf16",
        metavar="FORMAT",
        help="the experts' format: bf16, f16, f32 or a GGUF block format (q8_0, q4_0, q4_1, "
        "q4_k, q5_k, q6_k) at its real bytes per weight (older names q8, q4, fp32, ... still "
        "work; fp8, int8, int4 are nominal widths); a calibrated --hardware profile must have "
        "measured it (default bf16)",
    )
    g.add_argument("--write-trace", metavar="FILE", help="also save the (synthetic) trace used")


def add_comparison_options(g) -> None:
    g.add_argument("--no-oracle", action="store_true", help="skip the oracle and MIN comparison")
    g.add_argument(
        "--sweep", action="store_true", help="policies x budgets x hardware: a table and a PNG"
    )
    g.add_argument("--budgets", default="0.05,0.1,0.25,0.5", help="budgets of the sweep")
    g.add_argument(
        "--policies", default=None, help="policies of the sweep (default: all but belady)"
    )
    g.add_argument(
        "--plot", metavar="PNG", default="sweep.png", help="where the sweep writes its plot"
    )
    g.add_argument(
        "--json", action="store_true", help="print one JSON object (a list with --sweep)"
    )


def load_lines(args, shape):
    from hybridmoe.experts.plan.trace_format import read_trace, write_trace
    from hybridmoe.sim.synthetic import SynthConfig, generate

    if bool(args.trace) == bool(args.synthetic):
        raise UserError("give exactly one of --trace FILE or --synthetic SPEC")
    if args.trace:
        lines = read_trace(args.trace)
    else:
        e = shape.experts
        cfg = SynthConfig(layers=shape.num_moe_layers, experts=e.num_experts, top_k=e.top_k)
        for item in filter(None, args.synthetic.split(",")):
            key, _, value = item.partition("=")
            if key not in SynthConfig.__dataclass_fields__ or not value:
                raise UserError(
                    f"--synthetic item {item!r} is not one of key=value for "
                    f"{', '.join(SynthConfig.__dataclass_fields__)}"
                )
            try:
                setattr(
                    cfg, key, type(getattr(cfg, key))(float(value))
                )  # int fields take 300 or 300.0
            except ValueError:
                raise UserError(f"--synthetic item {item!r} needs a number") from None
        lines = generate(cfg)
    if args.write_trace:
        write_trace(args.write_trace, lines)
    return lines


def sim_config(args, budget=None, policy=None):
    if args.batch < 1:
        raise UserError("--batch must be at least 1")
    if args.context < 0 or args.defer_experts < 0:
        raise UserError("--context and --defer-experts take 0 or more")
    values = config_values(args, SimConfig)
    values.update(policy=policy or args.policy, budget=budget or args.budget)
    return SimConfig(**values, dense_s=args.dense_ms / 1e3)


def run(args: argparse.Namespace) -> int:
    from hybridmoe.experts.plan.profiles import get_profile
    from hybridmoe.sim.shapes import get_shape

    shape = get_shape(args.model_shape)
    lines = load_lines(args, shape)
    if args.sweep:
        return run_sweep(args, shape, lines)
    cost = get_profile(args.hardware).for_expert(shape.experts, args.quant)
    cfg = sim_config(args)
    if args.no_oracle:
        from hybridmoe.sim.simulator import simulate

        out = simulate(lines, shape, cost, cfg).to_json()
    else:
        from hybridmoe.sim.sweep import compare

        row = compare(lines, shape, cost, cfg, [args.policy])[0]
        out = {
            **row.result.to_json(),
            "oracle_expert_ms_per_token": row.oracle.expert_ms_per_token,
            "oracle_hit_rate": row.oracle.hit_rate,
            "pct_of_oracle_speed": row.pct_of_oracle_speed,
            "belady_min_hit_rate": row.min_hit_rate,
            "pct_of_min_hit_rate": row.pct_of_min_hit_rate,
        }
    print(json.dumps(out) if args.json else format_result(out))
    return 0


def format_result(r: dict) -> str:
    lines = [
        f"policy {r['policy']} on {r['hardware']} ({r['quant']} experts), budget {r['budget']} = "
        f"{r['slots']} slots, {r['tokens']} measured tokens",
        f"  expert time      {r['expert_ms_per_token']:.3f} ms/token  ->  {r['tokens_per_s']:.1f} "
        "tok/s",
        f"  dense part       {r['dense_ms_per_token']:.3f} ms/token (attention, shared, head)",
        f"  planning         {r['plan_ms_per_token']:.3f} ms/token on the critical path, "
        f"{r['prepare_ms_per_token']:.3f} ms/token beside the experts",
        f"  hit rate         {r['hit_rate']:.3f}",
        f"  copies           {r['copies_per_token']:.2f} /token, PCIe {r['pcie_mb_per_token']:.1f} "
        "MB/token",
        f"  busy             CPU {100 * r['cpu_busy']:.0f}%, GPU {100 * r['gpu_busy']:.0f}%",
        f"  prefetch         {r['prefetches_per_token']:.2f} /token, precision "
        f"{r['prefetch_precision']:.2f}; predictor precision {r['predictor_precision']:.2f}, "
        f"recall {r['predictor_recall']:.2f}",
    ]
    if "pct_of_oracle_speed" in r:
        lines.append(
            f"  vs oracle        {r['pct_of_oracle_speed']:.1f}% of its speed "
            f"({r['oracle_expert_ms_per_token']:.3f} ms/token), {r['pct_of_min_hit_rate']:.1f}% of "
            f"Belady MIN's hit rate ({r['belady_min_hit_rate']:.3f})"
        )
    return "\n".join(lines)


def run_sweep(args, shape, lines) -> int:
    from hybridmoe.sim.sweep import DEFAULT_POLICIES, format_table, plot, sweep

    policies = args.policies.split(",") if args.policies else list(DEFAULT_POLICIES)
    for name in policies:
        if name not in POLICIES and name != "oracle":
            raise UserError(
                f"unknown policy {name!r} in --policies; use names from "
                f"{', '.join([*POLICIES, 'oracle'])}"
            )
    budgets = [b.strip() for b in args.budgets.split(",") if b.strip()]
    rows = sweep(
        lines, shape, args.hardware.split(","), args.quant, budgets, policies, sim_config(args)
    )
    from hybridmoe.sim.published import ROWS

    quant = format_name(args.quant)
    published = [r for r in ROWS if r.shape == shape.name and format_name(r.quant) == quant]
    plot(rows, args.plot, title=f"{shape.name}, {args.quant} experts", published=published)
    if args.json:
        print(
            json.dumps(
                [
                    {
                        **r.result.to_json(),
                        "pct_of_oracle_speed": r.pct_of_oracle_speed,
                        "pct_of_min_hit_rate": r.pct_of_min_hit_rate,
                    }
                    for r in rows
                ]
            )
        )
    else:
        print(format_table(rows))
        print(f"plot written to {args.plot}")
    return 0
