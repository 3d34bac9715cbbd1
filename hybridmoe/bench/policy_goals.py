"""`hybridmoe bench policy-goals`: the value policy against HybriMoE, static and the oracle on
real routing traces, under the fair protocol (each trace's first half only builds statistics).

For each trace and budget: tok/s of static, hybrimoe, value and the oracle (dense part, planning
and experts all charged), value's hit rate against the oracle's, and each goal met or missed:
value >= 1.15x hybrimoe and >= 1.3x static in tok/s, value's time per token within 1.25x of the
oracle's, value's hit rate >= 85% of the oracle's. A trace is `FILE=SHAPE`, or `FILE`: a
trace of the demo model (30 MoE layers, top-8 of 16), replayed with its own layout and the expert
and dense geometry of `--geometry` (default OLMoE-1B-7B's). The demo model's own experts (46 kB at
Q4) take 5.8 us on the CPU and 5.1 us on the GPU on the default profile: nothing to cache there,
and its layers are shorter than planning one in Python (`--geometry demo` replays them as they are).
The demo traces carry the look-ahead hint (the next layers' routers on each layer's input), which
the planner gets as the engine would give it; the OLMoE trace has none (`--no-router-hints` leaves
it out everywhere).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

POLICIES = ("static", "hybrimoe", "value", "oracle")
GOALS = {"vs_hybrimoe": 1.15, "vs_static": 1.3, "time_vs_oracle": 1.25, "hit_vs_oracle": 0.85}
OLMOE = "../shared/traces/olmoe-1b-7b_299tok.jsonl=olmoe-1b-7b"


def add_parser(sub) -> None:
    p = sub.add_parser(
        "policy-goals",
        help="value against hybrimoe, static and the oracle on routing traces, goals met/missed",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument(
        "--traces",
        default=None,
        help="comma-separated FILE or FILE=SHAPE (default: the OLMoE trace beside the "
        "repository and docs/traces/*.jsonl)",
    )
    p.add_argument(
        "--geometry",
        default="olmoe-1b-7b",
        help="expert and dense geometry of the demo-model traces: a shape name, or 'demo'",
    )
    p.add_argument("--budgets", default="0.1,0.25", help="GPU expert budgets")
    p.add_argument("--hardware", default="rtx4090-ddr5", help="hardware profile")
    p.add_argument("--quant", default="q4", help="expert weight format")
    p.add_argument("--policies", default=",".join(POLICIES), help="policies (value required)")
    p.add_argument(
        "--plan-us",
        type=float,
        default=None,
        help="planning time per layer for every policy (default: each policy's measured cost)",
    )
    p.add_argument(
        "--no-router-hints",
        dest="router_hints",
        action="store_false",
        help="leave out the look-ahead hint of the traces recorded with one (sim/lookahead.py)",
    )
    p.add_argument("--json", action="store_true", help="one JSON object per trace and budget")
    p.set_defaults(func=run)


@dataclass
class Outcome:
    trace: str
    budget: str
    tok_s: dict[str, float]
    hit: dict[str, float]

    def ratios(self) -> dict[str, float]:
        t, h = self.tok_s, self.hit
        out = {}
        if "hybrimoe" in t:
            out["vs_hybrimoe"] = t["value"] / t["hybrimoe"]
        if "static" in t:
            out["vs_static"] = t["value"] / t["static"]
        if "oracle" in t:
            out["time_vs_oracle"] = t["oracle"] / t["value"]
            out["hit_vs_oracle"] = h["value"] / h["oracle"] if h["oracle"] else float("nan")
        return out

    def met(self) -> dict[str, bool]:
        r = self.ratios()
        return {k: (r[k] <= GOALS[k]) if k == "time_vs_oracle" else (r[k] >= GOALS[k]) for k in r}


def default_traces() -> list[str]:
    from pathlib import Path

    out = [OLMOE] if Path(OLMOE.split("=")[0]).exists() else []
    return out + sorted(str(p) for p in Path("docs/traces").glob("*.jsonl"))


def demo_shape() -> str:
    from hybridmoe.demo.cache import ensure_demo_model

    return str(ensure_demo_model() / "config.json")


def demo_layout(geometry: str):
    """The demo model's layout of routed experts with another shape's expert and dense sizes."""
    from dataclasses import replace

    from hybridmoe.sim.shapes import get_shape

    demo = get_shape(demo_shape())
    if geometry == "demo":
        return demo
    base = get_shape(geometry)
    e = demo.experts
    experts = replace(
        base.experts, num_experts=e.num_experts, top_k=e.top_k, moe_layers=e.moe_layers
    )
    return replace(
        base, name=f"demo layout, {base.name} sizes", experts=experts, layers=demo.layers
    )


def measure(
    trace: str,
    budgets,
    hardware: str,
    quant: str,
    policies,
    geometry: str = "olmoe-1b-7b",
    plan_us: float | None = None,
    router_hints: bool = True,
) -> list[Outcome]:
    from hybridmoe.experts.plan.profiles import get_profile
    from hybridmoe.experts.plan.trace_format import read_trace
    from hybridmoe.sim.shapes import get_shape
    from hybridmoe.sim.simulator import SimConfig, simulate

    path, _, shape_name = trace.partition("=")
    shape = get_shape(shape_name) if shape_name else demo_layout(geometry)
    cost = get_profile(hardware).for_expert(shape.experts, quant)
    lines = read_trace(path)
    out = []
    for budget in budgets:
        tok_s, hit = {}, {}
        for policy in policies:
            cfg = SimConfig(
                policy=policy, budget=budget, plan_us=plan_us, router_hints=router_hints
            )
            r = simulate(lines, shape, cost, cfg)
            tok_s[policy], hit[policy] = r.tokens_per_s, r.hit_rate
        out.append(Outcome(path, budget, tok_s, hit))
    return out


def _row(o: Outcome) -> str:
    r, met = o.ratios(), o.met()
    cells = [f"{o.tok_s[p]:.1f}" for p in POLICIES if p in o.tok_s]

    def mark(k, fmt):
        return f"{fmt.format(r[k])} {'met' if met[k] else '**missed**'}" if k in r else "-"

    name = o.trace.rsplit("/", 1)[-1].removesuffix(".jsonl")
    return (
        f"| {name} | {float(o.budget):.0%} | "
        + " | ".join(cells)
        + f" | {o.hit['value']:.3f} / {o.hit.get('oracle', float('nan')):.3f} | "
        + " | ".join(
            (
                mark("vs_hybrimoe", "{:.2f}×"),
                mark("vs_static", "{:.2f}×"),
                mark("time_vs_oracle", "{:.2f}×"),
                mark("hit_vs_oracle", "{:.0%}"),
            )
        )
        + " |"
    )


def run(args) -> int:
    from hybridmoe.errors import UserError
    from hybridmoe.experts.plan.policies import POLICIES as KNOWN

    policies = [p for p in args.policies.split(",") if p]
    for name in policies:
        if name not in KNOWN and name != "oracle":
            raise UserError(
                f"--policies: unknown policy {name!r}; use some of {', '.join(POLICIES)}"
            )
    if "value" not in policies:
        raise UserError("--policies must include value: the goals are value's ratios")
    traces = args.traces.split(",") if args.traces else default_traces()
    if not traces:
        raise UserError("no traces: pass --traces FILE=SHAPE,... or run from the repository root")
    budgets = [b for b in args.budgets.split(",") if b]
    if not args.json:
        print(
            "| trace | budget | "
            + " | ".join(f"{p} tok/s" for p in POLICIES if p in policies)
            + " | hit value / oracle | value ÷ hybrimoe | value ÷ static | "
            "value time ÷ oracle's | hit ÷ oracle's |"
        )
        print("|---|---:|" + "---:|" * (len(policies) + 5))
    for trace in traces:
        for o in measure(
            trace,
            budgets,
            args.hardware,
            args.quant,
            policies,
            args.geometry,
            args.plan_us,
            args.router_hints,
        ):
            if args.json:
                print(json.dumps({**o.__dict__, "ratios": o.ratios(), "met": o.met()}), flush=True)
            else:
                print(_row(o), flush=True)
    return 0
