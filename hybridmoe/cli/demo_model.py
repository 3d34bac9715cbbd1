"""`hybridmoe demo-model`: build (or rebuild) the built-in demo MoE, and optionally measure it."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hybridmoe.demo.spec import DEFAULT_SPEC
from hybridmoe.errors import UserError


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "demo-model",
        help="build the demo MoE (SmolLM2-135M split into experts)",
        description="Turn SmolLM2-135M-Instruct into a sparse MoE saved as a Hugging Face "
        "directory (Mixtral, or Qwen2-MoE with a shared expert).",
    )
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="output directory (default: the user cache, reused by every command)",
    )
    p.add_argument(
        "--experts",
        type=int,
        default=DEFAULT_SPEC.experts,
        help=f"routed experts per layer ({DEFAULT_SPEC.experts})",
    )
    p.add_argument(
        "--top-k",
        type=int,
        default=DEFAULT_SPEC.top_k,
        help=f"routed experts per token ({DEFAULT_SPEC.top_k})",
    )
    p.add_argument(
        "--shared",
        type=float,
        default=DEFAULT_SPEC.shared,
        help="fraction of each FFN's neurons in an always-active shared expert "
        f"({DEFAULT_SPEC.shared}; 0: none)",
    )
    p.add_argument(
        "--format",
        choices=("hf", "gguf-bf16", "gguf-q8_0", "gguf-q4_k_m"),
        default="hf",
        help="also write it as one GGUF file beside the directory, and print that path "
        "(default hf: the directory only)",
    )
    p.add_argument("--force", action="store_true", help="rebuild even if the output exists")
    p.add_argument(
        "--evaluate",
        action="store_true",
        help="measure perplexity, agreement with the dense model and routing statistics",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from hybridmoe.demo.build import build, is_complete
    from hybridmoe.demo.cache import demo_model_path
    from hybridmoe.demo.spec import MoESpec

    spec = MoESpec(experts=args.experts, top_k=args.top_k, shared=args.shared).validate()
    out = args.out or demo_model_path(spec)
    if args.out is not None and args.out.exists() and not args.out.is_dir():
        raise UserError(f"--out {args.out} is a file; give a directory path.")
    if is_complete(out) and not args.force:
        print(f"demo model already built at {out} (--force rebuilds it)", file=sys.stderr)
    else:
        if out.exists() and any(out.iterdir()) and not is_complete(out) and not args.force:
            raise UserError(
                f"--out {out} is a non-empty directory that is not a demo model; "
                "pick another path or pass --force."
            )
        build(out, spec)
        print(
            f"built the demo model ({spec.active_fraction():.0%} of each FFN active) at {out}",
            file=sys.stderr,
        )
    print(out if args.format == "hf" else gguf_file(out, args.format, args.force))
    if args.evaluate:
        from hybridmoe.demo.quality import report

        print(report(out))
    return 0


def gguf_file(directory: Path, fmt: str, force: bool) -> Path:
    """The demo model as one GGUF file in `fmt` beside its directory, written once."""
    from hybridmoe.export.gguf_export import export_gguf
    from hybridmoe.export.sources import Checkpoint

    path = directory.parent / f"{directory.name}-{fmt.removeprefix('gguf-')}.gguf"
    if force or not path.exists():
        export_gguf(Checkpoint(directory), path, fmt)
    return path
