"""`hybridmoe bench SUB`: benchmarks (not tests). Each sub-benchmark is a module with
`add_parser(sub)`."""

from __future__ import annotations

import importlib

# sub-benchmark name -> module; a module that is not written yet is left out of the command
BENCHMARKS = {
    "generate": "hybridmoe.bench.generate",
    "serve": "hybridmoe.bench.serve",
    "make-model": "hybridmoe.bench.make_model",
    "sim-vs-real": "hybridmoe.bench.sim_vs_real",
    "planner": "hybridmoe.bench.planner",
    "published": "hybridmoe.bench.published",
    "deferral": "hybridmoe.bench.deferral",
    "policy-goals": "hybridmoe.bench.policy_goals",
    "finetune": "hybridmoe.bench.finetune",
    "determinism": "hybridmoe.bench.determinism",
    "first-run": "hybridmoe.bench.first_run",
    "products": "hybridmoe.bench.products",
}


def add_parser(sub) -> None:
    p = sub.add_parser(
        "bench",
        help="benchmarks: generation speed, serving, benchmark models",
        description="Benchmarks (not tests). Run `hybridmoe bench SUB --help` for each.",
    )
    benches = p.add_subparsers(dest="bench", metavar="SUB")
    benches.required = True
    for module in BENCHMARKS.values():
        importlib.import_module(module).add_parser(benches)
