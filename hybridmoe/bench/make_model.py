"""`hybridmoe bench make-model`: write a random-weight benchmark model (see bench/model.py), as a
Hugging Face directory or as one GGUF file, with a tokenizer (bench/tokenizer.py)."""

from __future__ import annotations

from hybridmoe.bench.model import SHAPES

FORMATS = ("hf", "gguf-bf16", "gguf-q8_0", "gguf-q4_k_m")


def add_parser(sub) -> None:
    p = sub.add_parser(
        "make-model",
        help="write a random-weight model with the layer shapes of a real MoE",
        description="Build a random-weight model with a real MoE's layer shapes and save it "
        "(atomically): --format hf builds transformers' own class and saves a Hugging Face "
        "directory; the gguf formats write one GGUF file tensor by tensor from seeded random "
        "values (quantised by hybridmoe's quantiser), never holding the model in memory.",
    )
    p.add_argument(
        "--shape", choices=sorted(SHAPES), default="qwen3-30b-a3b", help="whose layer shapes"
    )
    p.add_argument("--layers", type=int, default=4, help="decoder layers (default 4)")
    p.add_argument(
        "--out",
        required=True,
        metavar="PATH",
        help="directory or .gguf file to create (must not exist)",
    )
    p.add_argument("--format", choices=FORMATS, default="hf", help="what to write (default hf)")
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16", help="--format hf's dtype")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--threads", type=int, default=2, help="threads that quantise in parallel (gguf formats)"
    )
    p.set_defaults(func=run)


def run(args) -> int:
    from pathlib import Path

    from hybridmoe.errors import UserError

    if args.layers < 1:
        raise UserError(f"--layers {args.layers}: give at least 1")
    if args.threads < 1:
        raise UserError(f"--threads {args.threads}: give a positive number of threads")
    out = Path(args.out).expanduser().resolve()
    if out.exists():
        raise UserError(f"{out} exists; remove it or choose another --out")
    print(_write_hf(args, out) if args.format == "hf" else _write_gguf(args, out))
    return 0


def _write_hf(args, out):
    import torch

    from hybridmoe.bench.model import make_model

    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    return make_model(args.shape, args.layers, out, dtype, args.seed)


def _write_gguf(args, out):
    import tempfile
    from pathlib import Path

    from hybridmoe.bench.model import SHAPES
    from hybridmoe.bench.random_model import RandomSource
    from hybridmoe.bench.tokenizer import write_tokenizer
    from hybridmoe.export.gguf_export import export_gguf

    with tempfile.TemporaryDirectory(prefix="hybridmoe-tokenizer-") as tok:
        write_tokenizer(Path(tok), SHAPES[args.shape]["vocab_size"])
        source = RandomSource(args.shape, args.layers, args.seed, Path(tok))
        return export_gguf(source, out, args.format, threads=args.threads)
