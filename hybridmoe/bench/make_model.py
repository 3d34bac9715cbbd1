"""`hybridmoe bench make-model`: write a random-weight benchmark model (see bench/model.py)."""

from __future__ import annotations

from hybridmoe.bench.model import SHAPES


def add_parser(sub) -> None:
    p = sub.add_parser(
        "make-model",
        help="write a random-weight model with the layer shapes of a real MoE",
        description="Build a random-weight model with a real MoE's layer shapes using "
        "transformers' own class, and save it (atomically) as a Hugging Face directory.",
    )
    p.add_argument(
        "--shape", choices=sorted(SHAPES), default="qwen3-30b-a3b", help="whose layer shapes"
    )
    p.add_argument("--layers", type=int, default=4, help="decoder layers (default 4)")
    p.add_argument(
        "--out", required=True, metavar="DIR", help="directory to create (must not exist)"
    )
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=run)


def run(args) -> int:
    import torch

    from hybridmoe.bench.model import make_model
    from hybridmoe.errors import UserError

    if args.layers < 1:
        raise UserError(f"--layers {args.layers}: give at least 1")
    try:
        out = make_model(
            args.shape,
            args.layers,
            args.out,
            {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype],
            args.seed,
        )
    except FileExistsError as e:
        raise UserError(str(e)) from None
    print(out)
    return 0
