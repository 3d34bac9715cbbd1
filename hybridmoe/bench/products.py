"""`hybridmoe bench products`: the integer kernels' products of many tokens against dequantising
the weights and calling oneDNN (issue 12's bar for prefill).

For each format and shape (the Qwen3-30B-A3B shapes by default: an expert's gate/up and down, the
attention's q and o), random N(0, 0.02) weights quantised by hybridmoe's quantiser (Q4_1: gguf's;
Q5_K, which nothing here quantises to: hybridmoe's Q4_K blocks with a fifth bit of 0, the same
weights) and laid out as the loader leaves them (Q4_K, Q5_K and Q6_K in rows of eights, Q8_0, Q4_0
and Q4_1 in rows of sixteens where the AVX-512 path runs), and each token count: ours
(`native/quant.py linear`: AVX512-VNNI, or AMX-INT8 tiles for those layouts from 16 tokens where the
CPU has them) against the fastest dequantise + multiply we have (`native/quant.py rows`, quant.c's
dequantiser, to bf16, then `F.linear`: oneDNN, on AMX where the CPU has it), alternating, medians.
The largest difference between the two results, relative to the largest output, is reported too
(the activations' int8 rounding and the bf16 weights: about 1%).

By default each side multiplies the same weights again and again, from the caches where they fit;
`--from-ram` gives every timed product a copy of the weights that the copies timed since have pushed
out of the caches (tuning.ROTATE_BYTES of them, as `calibrate` times experts), so that it reads them
from RAM as a decode step's experts and a prefill's first pass over a matrix do.
"""

from __future__ import annotations

import json
import statistics
import time

from hybridmoe.errors import UserError
from hybridmoe.quant.formats import QUANTIZE_TO

SHAPES = "768x2048,2048x768,4096x2048,2048x4096"  # N x K: gate/up, down, q, o of Qwen3-30B-A3B
FORMATS = ("q4_k", "q8_0", "q6_k")  # the default
READ_ONLY = ("q4_1", "q5_k")  # formats GGUF files hold that hybridmoe does not quantise to


def add_parser(sub) -> None:
    p = sub.add_parser(
        "products",
        help="many-token products on GGUF blocks against dequantise + oneDNN",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument("--formats", default=",".join(FORMATS), help="block formats, comma-separated")
    p.add_argument("--shapes", default=SHAPES, help="N x K weight shapes, comma-separated")
    p.add_argument("--tokens", default="64,512", help="token counts, comma-separated")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=7, help="timed runs of each, after one warm-up")
    p.add_argument(
        "--from-ram",
        action="store_true",
        help="each product reads its weights from RAM (copies rotated beyond the caches)",
    )
    p.add_argument("--json", action="store_true", help="one JSON object per product")
    p.set_defaults(func=run)


def _shapes(text: str) -> list[tuple[int, int]]:
    out = []
    for item in text.split(","):
        try:
            n, k = (int(v) for v in item.lower().split("x"))
        except ValueError:
            raise UserError(f"--shapes: {item!r} is not N x K (e.g. 768x2048)") from None
        if n <= 0 or k <= 0 or k % 256:
            raise UserError(f"--shapes: {item}: N > 0, and K a multiple of 256 (one super-block)")
        out.append((n, k))
    return out


def measure(
    fmt: str, n: int, k: int, tokens: int, threads: int, repeats: int, from_ram: bool = False
) -> dict:
    """Ours and dequantise + oneDNN on one product: medians in ms, the ratio, the difference;
    `from_ram`: each timed product on a copy of the weights that has left the caches."""
    import torch
    import torch.nn.functional as F

    from hybridmoe.native import quant as kernels
    from hybridmoe.quant.formats import LAYOUTS
    from hybridmoe.quant.tensor import QTensor, for_kernels
    from hybridmoe.tuning import ROTATE_BYTES

    gen = torch.Generator().manual_seed(n * 7 + k)
    plain = _weights(torch.randn(n, k, generator=gen) * 0.02, fmt)
    ours_w = for_kernels(QTensor(plain.data.clone(), plain.fmt, k))  # as the loader leaves it
    # the copies each side's products take in turn: one, or enough that a copy comes round again
    # only after ROTATE_BYTES of others (this side's other copies, all of the other side's) have
    # passed through the caches
    copies = int(ROTATE_BYTES // (2 * plain.data.numel())) + 2 if from_ram else 1
    ours_ws = [ours_w.data] + [ours_w.data.clone() for _ in range(copies - 1)]
    plains = [plain.data] + [plain.data.clone() for _ in range(copies - 1)]
    rows = torch.arange(n)
    x = torch.randn(tokens, k, generator=gen).to(torch.bfloat16)

    def ours(i=0):
        return kernels.linear(x, ours_w.fmt.ggml, ours_ws[i % copies], k, workers=threads)

    def dequantised(i=0):
        w = kernels.rows(plains[i % copies], plain.fmt.ggml, k, rows, torch.bfloat16)
        return F.linear(x, w)

    times: dict[str, list[float]] = {"ours": [], "onednn": []}
    for i in range(repeats + 1):
        for name, f in (("ours", ours), ("onednn", dequantised)):
            t0 = time.perf_counter()
            f(i)
            if i:  # the first of each is a warm-up
                times[name].append(time.perf_counter() - t0)
    a, b = ours(), dequantised().float()
    ms = {name: 1e3 * statistics.median(v) for name, v in times.items()}
    return {
        "format": fmt,
        "layout": ours_w.fmt.name,
        "shape": f"{n}x{k}",
        "tokens": tokens,
        "threads": threads,
        "from_ram": from_ram,
        "weight_copies": copies,  # each side's, each of weight_bytes
        "weight_bytes": plain.data.numel(),
        "ours_ms": ms["ours"],
        "onednn_ms": ms["onednn"],
        "ratio": ms["onednn"] / ms["ours"],  # > 1: ours is faster
        "tiles": ours_w.fmt.name in LAYOUTS
        and kernels.tiles_active()
        and tokens >= kernels.TILES_FROM_TOKENS,
        "max_rel_diff": float((a - b).abs().max() / b.abs().max()),
    }


def _weights(w, fmt: str):
    """w [n, k] as a QTensor of `fmt`: hybridmoe's quantiser, or for the read-only formats gguf's
    (Q4_1) or hybridmoe's Q4_K with each block widened to Q5_K by a fifth bit of 0 (d, dmin and
    the scales kept, 32 zero bytes of high bits after them: the same values)."""
    import gguf
    import numpy as np
    import torch
    from gguf import quants

    from hybridmoe.quant.formats import FORMATS as BLOCKS
    from hybridmoe.quant.tensor import QTensor

    if fmt == "q4_1":
        data = quants.quantize(w.numpy(), gguf.GGMLQuantizationType.Q4_1)
        return QTensor(torch.from_numpy(np.ascontiguousarray(data)), BLOCKS[fmt], w.shape[1])
    if fmt == "q5_k":
        q4 = QTensor.quantize(w, "q4_k").data.reshape(w.shape[0], -1, 144)  # [n, k / 256, 144]
        high = torch.zeros(*q4.shape[:2], 32, dtype=torch.uint8)
        data = torch.cat([q4[..., :16], high, q4[..., 16:]], dim=-1).reshape(w.shape[0], -1)
        return QTensor(data, BLOCKS[fmt], w.shape[1])
    return QTensor.quantize(w, fmt)


def run(args) -> int:
    import torch

    from hybridmoe.native import quant as kernels

    formats = [f.strip() for f in args.formats.split(",")]
    bad = [f for f in formats if f not in QUANTIZE_TO + READ_ONLY]
    if bad:
        raise UserError(
            f"--formats: {', '.join(bad)} not among {', '.join(QUANTIZE_TO + READ_ONLY)}"
        )
    shapes = _shapes(args.shapes)
    try:
        counts = [int(t) for t in args.tokens.split(",")]
    except ValueError:
        raise UserError(f"--tokens: {args.tokens!r} is not a list of token counts") from None
    if min(counts) <= 0 or args.threads <= 0 or args.repeats <= 0:
        raise UserError("--tokens, --threads and --repeats must be positive")
    if not kernels.available():
        raise UserError("the integer kernels do not run here (no AVX2, or HYBRIDMOE_NATIVE=0)")
    torch.set_num_threads(args.threads)
    for fmt in formats:
        for n, k in shapes:
            for tokens in counts:
                r = measure(fmt, n, k, tokens, args.threads, args.repeats, args.from_ram)
                if args.json:
                    print(json.dumps(r), flush=True)
                else:
                    print(
                        f"{fmt:5} {r['shape']:>10} x {tokens:4} tokens: ours {r['ours_ms']:8.2f} ms"
                        f"{' (tiles)' if r['tiles'] else '        '}  dequantise + oneDNN "
                        f"{r['onednn_ms']:8.2f} ms  ratio {r['ratio']:.2f}x",
                        flush=True,
                    )
    return 0
