"""`hybridmoe bench published`: the simulator's prediction for each published decode figure
(sim/published.py), beside it, with the error."""

from __future__ import annotations

import json


def add_parser(sub) -> None:
    p = sub.add_parser(
        "published",
        help="simulated against published decode figures of MoE models on CPU+GPU machines",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument("--json", action="store_true", help="one JSON object per row")
    p.set_defaults(func=run)


def run(args) -> int:
    from hybridmoe.sim.published import ROWS, check

    if not args.json:
        print("| model | machine | setting | published tok/s | simulated | error | source |")
        print("|---|---|---|---:|---:|---:|---|")
    for row in ROWS:
        c = check(row)
        if args.json:
            print(json.dumps({**row.__dict__, "predicted": c.predicted, "error": c.error}))
        else:
            print(
                f"| {row.model} | {row.machine} (`{row.hardware}`) | {row.engine} | "
                f"{row.tok_s:.1f} | {c.predicted:.1f} | {100 * c.error:+.1f}% | {row.source} |"
            )
    return 0
