"""`hybridmoe export`: write a Hugging Face model (the demo model by default) as a GGUF file that
llama.cpp and hybridmoe both load."""

from __future__ import annotations

import sys
from pathlib import Path

from hybridmoe.errors import UserError

FORMATS = ("gguf-bf16", "gguf-q8_0", "gguf-q4_k_m")  # hybridmoe/export/gguf_types.py


def add_parser(sub) -> None:
    p = sub.add_parser(
        "export",
        help="write a model as a GGUF file (bf16, q8_0 or q4_k_m) for hybridmoe or llama.cpp",
        description="Write a Hugging Face model directory as one GGUF file in llama.cpp's layout, "
        "with its tokenizer: BF16, Q8_0, or Q4_K_M's mix of types as llama-quantize chooses it "
        "(our quantiser rounds K-quants by a min/max fit, not llama.cpp's search).",
    )
    p.add_argument(
        "--model",
        metavar="DIR",
        default=None,
        help="Hugging Face model directory (default: the demo model)",
    )
    p.add_argument("--format", required=True, choices=FORMATS, help="the file's types")
    p.add_argument("--out", required=True, metavar="FILE", help="the .gguf file to write")
    p.add_argument(
        "--no-tokenizer", action="store_true", help="write the weights and metadata only"
    )
    p.add_argument(
        "--threads", type=int, default=2, help="threads that quantise in parallel (default 2)"
    )
    p.set_defaults(func=run)


def run(args) -> int:
    from hybridmoe.export.gguf_export import export_gguf
    from hybridmoe.export.sources import Checkpoint

    if args.threads < 1:
        raise UserError(f"--threads {args.threads}: give a positive number of threads")
    out = Path(args.out).expanduser()
    if out.is_dir():
        raise UserError(f"--out {out} is a directory; give the path of the .gguf file to write")
    source = Checkpoint(_model_dir(args.model))
    export_gguf(source, out, args.format, threads=args.threads, tokenizer=not args.no_tokenizer)
    print(out)
    if source.tokenizer_dir is None and not args.no_tokenizer:
        print(f"{source.directory} has no tokenizer.json: the file has none", file=sys.stderr)
    return 0


def _model_dir(model: str | None) -> Path:
    if model is None:
        from hybridmoe.demo.cache import ensure_demo_model

        return ensure_demo_model()
    path = Path(model).expanduser()
    if not path.exists():
        raise UserError(f"--model {path}: no such directory; pass a Hugging Face model directory")
    if not path.is_dir():
        raise UserError(
            f"--model {path}: a file; export reads Hugging Face model directories "
            "(config.json and *.safetensors)"
        )
    return path
