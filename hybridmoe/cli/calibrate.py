"""`hybridmoe calibrate`: measure this machine's expert speed and save the cost profile."""

from __future__ import annotations

import sys

from hybridmoe.cli.options import DTYPES, compute_dtype
from hybridmoe.errors import UserError
from hybridmoe.experts.plan.shape import expert_params


def add_parser(sub) -> None:
    p = sub.add_parser(
        "calibrate",
        help="measure CPU (and GPU, PCIe) expert speed; save a cost profile",
        description="Time one routed expert over 1..512 tokens on the CPU (and the GPU and "
        "PCIe copies when CUDA is there), fit the cost model, check it on shapes "
        "not used for fitting, and save the profile as JSON.",
    )
    p.add_argument(
        "--out",
        metavar="FILE",
        default=None,
        help="where to save the profile (default: the cache the engine reads on start)",
    )
    p.add_argument(
        "--dtype",
        choices=["auto", *sorted(DTYPES)],
        default="auto",
        help="expert weights' dtype (auto: as the model commands choose, bfloat16 on CPUs with "
        "native bf16)",
    )
    p.add_argument(
        "--threads", type=int, default=None, help="CPU threads for torch (default: all cores)"
    )
    p.add_argument(
        "--expert-shape",
        metavar="HxI",
        default=None,
        help="also fit on experts of this hidden x intermediate size (e.g. 576x48); the default "
        "--out is then the cache the engine reads for models with that shape",
    )
    p.add_argument(
        "--formats",
        metavar="LIST",
        default=None,
        help="expert formats to measure, comma-separated: the dtype's (bf16 or f32: dense experts) "
        "and GGUF block formats (q8_0, q4_0, q4_1, q4_k, q5_k, q6_k) on the integer kernels; the "
        "profile keeps each one's CPU figures (default: the dtype's)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="fewer shapes and repeats (what the engine runs on first start)",
    )
    p.set_defaults(func=run)


def run(args) -> int:
    import torch

    from hybridmoe.experts.run.calibrate import calibrate, default_profile_path

    if args.threads is not None:
        if args.threads < 1:
            raise UserError(f"--threads {args.threads}: give a positive number of threads")
        torch.set_num_threads(args.threads)
    dtype = compute_dtype(args.dtype)
    model = parse_shape(args.expert_shape) if args.expert_shape else None
    formats = (
        tuple(f.strip() for f in args.formats.split(",") if f.strip()) if args.formats else None
    )
    result = calibrate(dtype, quick=args.quick, model=model, formats=formats)
    out = args.out or default_profile_path(dtype, model)
    try:
        result.save(out)
    except OSError as e:
        raise UserError(f"cannot write {out} ({e.strerror}); pass a writable --out path") from None
    print(report(result), file=sys.stderr)
    print(f"saved {out}")
    return 0


def parse_shape(text: str) -> tuple[int, int]:
    try:
        hidden, inter = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise UserError(f"--expert-shape {text}: give hidden x intermediate, e.g. 576x48") from None
    if hidden < 1 or inter < 1:
        raise UserError(f"--expert-shape {text}: both sizes must be positive")
    return hidden, inter


def model_fit_line(result) -> str:
    """How well the profile fits the model's own experts (fitted, so not a held-out figure), per
    format measured."""
    from hybridmoe.experts.plan.cost_model import quant_bytes
    from hybridmoe.experts.run.calibrate import predict

    h, i = result.model
    parts = []
    for fmt in result.profile.cpu_formats:
        costed = result.profile.for_format(fmt)
        own = [
            s
            for s in result.samples
            if s.kind == "cpu" and s.bytes == expert_params(h, i) * quant_bytes(fmt)
        ]
        errs = " ".join(
            f"n={s.n_tokens}: {100 * (predict(costed, s) / s.seconds - 1):+.0f}%" for s in own
        )
        parts.append(f"{fmt} {errs or '(rows do not fill its blocks: not measured)'}")
    return f"fitted with this model's {h}x{i} experts (weighted); fit error on them: " + "; ".join(
        parts
    )


def cpu_line(p) -> str:
    """The fitted CPU constants: the batched kernel's, then the row-by-row regime's."""
    overlap = {1.0: "the max of", 0.0: "the sum of"}.get(
        p.cpu_overlap, f"{p.cpu_overlap:.0%} overlap of"
    )
    batched = (
        f"{f'n >= {p.cpu_gemm_from}' if p.bw_cpu_one else 'every n'}: {overlap} streaming at "
        f"{p.bw_cpu / 1e9:.1f} GB/s and arithmetic at {p.f_cpu / 1e9:.0f} GFLOP/s, + "
        f"{p.c_cpu * 1e6:.0f} us"
    )
    if not p.bw_cpu_one:
        return batched
    rows = "n = 1" if p.cpu_gemm_from <= 2 else f"n < {p.cpu_gemm_from}, one pass per token"
    c_one = p.c_cpu if p.c_cpu_one is None else p.c_cpu_one
    line = f"{rows}: {p.bw_cpu_one / 1e9:.1f} GB/s + {c_one * 1e6:.0f} us"
    if p.cpu_gemm_from > 2:
        levels = [
            f"{bw / 1e9:.0f} GB/s within {cap / 2**20:.0f} MiB" for cap, bw in p.cpu_caches if bw
        ]
        ram = p.bw_cpu_reread or p.bw_cpu_one
        line += (
            f"; re-reads {', '.join(levels + [f'{ram / 1e9:.0f} GB/s beyond'])} + "
            f"{p.c_cpu_reread * 1e6:.0f} us"
        )
    return f"{batched}; {line}"


def report(result) -> str:
    import torch

    p = result.profile
    tokens = str(result.dtype).removeprefix("torch.")
    lines = [
        f"CPU, {fmt} experts ({tokens} tokens, {torch.get_num_threads()} threads): "
        + cpu_line(p.for_format(fmt))
        for fmt in p.cpu_formats
    ]
    if p.has_gpu:
        lines.append(
            f"GPU: {p.bw_gpu / 1e9:.0f} GB/s, {p.f_gpu / 1e12:.1f} TFLOP/s, {p.c_gpu * 1e6:.0f} "
            f"us; PCIe {p.bw_pcie / 1e9:.1f} GB/s + {p.c_copy * 1e6:.0f} us per copy"
        )
    if result.model:
        lines.append(model_fit_line(result))
    lines.append("held-out checks (shapes not used for fitting):")
    lines.append(
        f"  {'kind':5} {'format':6} {'expert':>10} {'tokens':>6} {'measured':>10} "
        f"{'predicted':>10} {'error':>7}"
    )
    for c in result.checks:
        shape = f"{c.hidden}x{c.intermediate}"
        lines.append(
            f"  {c.kind:5} {c.format:6} {shape:>10} {c.n_tokens:>6} {c.measured * 1e3:>8.3f}ms "
            f"{c.predicted * 1e3:>8.3f}ms {100 * c.error:>+6.1f}%"
        )
    lines.append(
        f"largest CPU error on held-out shapes: {100 * result.max_cpu_error():.1f}% (target: "
        "within 20%)"
    )
    return "\n".join(lines)
