"""`hybridmoe bench deferral`: what expert deferral (--defer-experts N) costs in quality and buys
in speed.

Quality: the demo model on the CPU runtime, fed its held-out text one decode step at a time with
each N, against N = 0: perplexity and top-1 agreement. Speed: the simulator at the Qwen3-30B-A3B
shape (a synthetic trace, Q4 experts), every routed expert on the CPU and the rest on the GPU
(KTransformers' setting, where deferral was proposed), and the value policy at a 10% budget.
"""

from __future__ import annotations

import json


def add_parser(sub) -> None:
    p = sub.add_parser(
        "deferral",
        help="expert deferral: quality on the demo model, simulated speed at Qwen3-30B-A3B",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument("--defer", default="0,1,2,3", help="values of N")
    p.add_argument("--sequences", type=int, default=16, help="held-out sequences scored")
    p.add_argument("--hardware", default="rtx4090-ddr5", help="profile of the speed figures")
    p.add_argument("--json", action="store_true", help="one JSON object per N")
    p.set_defaults(func=run)


def quality(n: int, sequences: int):
    import torch

    from hybridmoe.demo import fit
    from hybridmoe.demo.cache import ensure_demo_model
    from hybridmoe.demo.quality import decoded_stats
    from hybridmoe.experts.plan.profiles import PROFILES
    from hybridmoe.experts.run.hybrid_runtime import HybridConfig, make_runtime
    from hybridmoe.loader import load_model

    config = HybridConfig(defer_experts=n)
    model = load_model(
        ensure_demo_model(),
        dtype=torch.float32,
        runtime_factory=lambda s, d: make_runtime(s, d, config, PROFILES["this-machine-2core"]),
        progress=False,
    )
    text = fit.corpus("evaluation")
    return decoded_stats(model, *(t[:sequences] for t in (text.ids, text.mask, text.scored)))


def speed(n: int, hardware: str) -> dict[str, float]:
    from hybridmoe.experts.plan.profiles import get_profile
    from hybridmoe.sim.advisor import synthetic_for
    from hybridmoe.sim.shapes import get_shape
    from hybridmoe.sim.simulator import SimConfig, simulate

    shape = get_shape("qwen3-30b-a3b")
    cost = get_profile(hardware).for_expert(shape.experts, "q4")
    lines = synthetic_for(shape, 160)
    out = {}
    for policy, budget in (("cpu", "0"), ("value", "0.1")):
        r = simulate(lines, shape, cost, SimConfig(policy=policy, budget=budget, defer_experts=n))
        out[policy] = r.tokens_per_s
    return out


def run(args) -> int:
    import torch

    torch.set_num_threads(1)
    rows, base = [], None
    for n in (int(v) for v in args.defer.split(",")):
        ppl, preds = quality(n, args.sequences)
        base = base or (ppl, preds)
        fast = speed(n, args.hardware)
        rows.append(
            {
                "defer": n,
                "ppl": ppl,
                "ppl_ratio": ppl / base[0],
                "top1_agreement": float((preds == base[1]).float().mean()),
                "scored_tokens": len(preds),
                "sim_tok_s_all_cpu": fast["cpu"],
                "sim_tok_s_value_10pct": fast["value"],
            }
        )
        r, first = rows[-1], rows[0]
        if args.json:
            print(json.dumps(r), flush=True)
        else:
            print(
                f"N={n}: perplexity {ppl:.3f} ({r['ppl_ratio']:.4f}x N=0), top-1 agreement with "
                f"N=0 {r['top1_agreement']:.2%} on {r['scored_tokens']} tokens; simulated "
                f"{fast['cpu']:.1f} tok/s all experts on the CPU "
                f"({fast['cpu'] / first['sim_tok_s_all_cpu']:.3f}x), {fast['value']:.1f} value "
                f"at 10% ({fast['value'] / first['sim_tok_s_value_10pct']:.3f}x)",
                flush=True,
            )
    return 0
