"""A weight matrix kept in a block format, and products with it.

`QTensor` holds a [rows, cols] matrix as `parts`, uint8 [rows_i, row bytes] tensors of GGUF blocks
(formats.py) whose rows follow one another: one part for a matrix in one buffer, more where a
matrix is put together without copying (an expert's gate and up rows, two places of the model
file). Parts are often views of the model file's memory map (loader/gguf_file.py). `matmul(x, w)`
multiplies by it on the native integer kernels (native/quant.py) where they run, else by
dequantising and using torch; many bf16 rows that need not be computed as if alone
(--deterministic off) dequantise the weight to bf16 and use oneDNN (`dequantised_applies`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybridmoe import invariance, native
from hybridmoe.native import bf16 as bf16_kernels
from hybridmoe.native import quant as kernels
from hybridmoe.quant.dequant import dequantize
from hybridmoe.quant.formats import FORMATS, INTERLEAVED, LAYOUTS, Format
from hybridmoe.quant.interleave import deinterleave
from hybridmoe.quant.transposed import times
from hybridmoe.tuning import DEQUANTISE_FROM_ROWS


class QTensor:
    def __init__(
        self,
        data: torch.Tensor | tuple[torch.Tensor, ...],
        fmt: Format,
        cols: int,
        keep_layout: bool = False,
    ):
        parts = (data,) if isinstance(data, torch.Tensor) else tuple(data)
        for part in parts:
            if part.dtype != torch.uint8 or part.dim() != 2 or part.shape[1] != fmt.row_bytes(cols):
                raise ValueError(
                    f"{fmt.name} blocks for {cols} columns need uint8 rows of "
                    f"{fmt.row_bytes(cols)} bytes"
                )
        self.parts, self.fmt, self.cols = parts, fmt, cols
        # the blocks stay as they lie (for_kernels leaves them): a file map too large to be
        # rewritten into the process's own memory (loader/gguf_file.py)
        self.keep_layout = keep_layout
        self._runs: dict[tuple[int, int], tuple[int, int] | None] = {}

    @property
    def data(self) -> torch.Tensor:
        """The blocks as one uint8 [rows, row bytes] tensor: the part itself where there is one,
        else a copy joining the parts (kernels take `parts` or `row_run`, never this copy)."""
        return self.parts[0] if len(self.parts) == 1 else torch.cat(self.parts)

    def row_run(self, start: int, count: int) -> tuple[int, int] | None:
        """(address, row stride) of rows start .. start+count-1 where they lie in one part, for a
        kernel's pointer table (cached: a decode step asks hundreds of times); None otherwise."""
        key = (start, count)
        if key not in self._runs:
            first, self._runs[key] = start, None
            for part in self.parts:
                if 0 <= first and first + count <= part.shape[0]:
                    self._runs[key] = (part.data_ptr() + first * part.stride(0), part.stride(0))
                    break
                first -= part.shape[0]
        return self._runs[key]

    @property
    def shape(self) -> torch.Size:
        return torch.Size((sum(p.shape[0] for p in self.parts), self.cols))

    def dim(self) -> int:
        return 2

    @property
    def device(self) -> torch.device:
        return self.parts[0].device

    def nbytes(self) -> int:
        return sum(p.numel() for p in self.parts)

    def rows(self, index) -> QTensor:
        """The rows `index` selects (a slice, a list or a tensor of row numbers); interleaved rows
        come out as the GGUF rows they are (a copy of the whole matrix first: for loading,
        not for a step)."""
        if self.fmt.name in LAYOUTS:
            rows = deinterleave(self.data, self.fmt.family)[index]
            return QTensor(rows, FORMATS[self.fmt.family], self.cols)
        return QTensor(self.data[index], self.fmt, self.cols)

    def lookup(self, ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """rows(ids).dequantize(dtype) for row ids [n] -> [n, cols], the same bits: in one native
        call where it takes them (one part in a GGUF format, on the CPU, fp32 or bf16 out), since
        the ~15 torch ops of dequant.py on a row cost ~200 us a decode step (token embeddings)."""
        if (
            len(self.parts) == 1
            and self.fmt.name in FORMATS
            and self.device.type == ids.device.type == "cpu"
            and dtype in (torch.float32, torch.bfloat16)
            and kernels.available()
        ):
            return kernels.rows(self.parts[0], self.fmt.ggml, self.cols, ids, dtype)
        return self.rows(ids).dequantize(dtype)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        values = [dequantize(p, self.fmt, self.cols, dtype) for p in self.parts]
        return values[0] if len(values) == 1 else torch.cat(values)  # [rows, cols]

    def to(self, device) -> QTensor:
        parts = tuple(p.to(device) for p in self.parts)
        return QTensor(parts, self.fmt, self.cols, self.keep_layout)

    @classmethod
    def cat(cls, matrices: list[QTensor]) -> QTensor:
        """Rows of `matrices` one after another, their parts kept as they are (no copy); all of
        one format and width."""
        if len({(m.fmt, m.cols) for m in matrices}) != 1:
            raise ValueError("only matrices of one block format and width are stacked")
        parts = tuple(p for m in matrices for p in m.parts)
        keep = any(m.keep_layout for m in matrices)
        return cls(parts, matrices[0].fmt, matrices[0].cols, keep)

    @classmethod
    def quantize(cls, weight: torch.Tensor, fmt_name: str) -> QTensor:
        """A dense [rows, cols] matrix quantised to `fmt_name` (native/quant.c's quantisers)."""
        fmt = FORMATS[fmt_name]
        return cls(
            kernels.quantize(weight, fmt.ggml, fmt.row_bytes(weight.shape[1])), fmt, weight.shape[1]
        )

    def __repr__(self) -> str:
        return f"QTensor({self.fmt.name}, {tuple(self.shape)})"


def for_kernels(m: QTensor) -> QTensor:
    """m in the layout the CPU kernels read fastest: Q4_K, Q5_K and Q6_K rows in eights, Q8_0,
    Q4_0 and Q4_1 rows in sixteens (quant/interleave.py), which every path of the kernels reads
    as it lies (on AVX2 too: quant.c dotk_x8_avx2, Q4_K one token from RAM 23 -> 37 GB/s on Zen
    5 capped to AVX2; dotk6_x8_avx2, Q6_K 23 -> 32 GB/s), where they run and every part's rows are
    whole groups of unpadded rows; else m. The bytes are rearranged in place: a part viewing a
    model file's copy-on-write map turns its pages into the process's own, in the place of the
    file's, so resident memory does not grow; but those pages can no longer be dropped, so the
    loader marks a file's blocks `keep_layout` where they would not fit in the free memory
    (loader/gguf_file.py)."""
    if (
        m.fmt.name not in INTERLEAVED
        or m.keep_layout
        or m.device.type != "cpu"
        or not kernels.available()
    ):
        return m
    layout = INTERLEAVED[m.fmt.name]
    if not all(p.shape[0] % layout.rows == 0 and p.is_contiguous() for p in m.parts):
        return m
    for part in m.parts:
        kernels.interleave_rows(part, m.fmt.ggml, m.cols)
    return QTensor(m.parts, layout, m.cols)


def dense(m, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A matrix as a dense tensor in `dtype`, whether it came in blocks or not."""
    return m.dequantize(dtype) if isinstance(m, QTensor) else m.to(dtype)


def native_applies(x: torch.Tensor, *weights: QTensor) -> bool:
    """Whether the integer kernels take this product: CPU tensors, fp32 or bf16 rows."""
    return (
        x.device.type == "cpu"
        and x.dtype in (torch.float32, torch.bfloat16)
        and all(w.device.type == "cpu" for w in weights)
        and kernels.available()
    )


def matmul(x: torch.Tensor, w: QTensor) -> torch.Tensor:
    """x [..., K] times w [N, K]^T -> [..., N] in x's dtype (fp32 accumulation); differentiable in
    x (the frozen weight has no gradient: LoRA training through quantised projections)."""
    if torch.is_grad_enabled() and x.requires_grad:
        return _Product.apply(x, w)
    return _product(x, w)


class _Product(torch.autograd.Function):
    """x W^T on the kernels, with dL/dx = dL/dy W through W's blocks a tile at a time
    (transposed.py): autograd never keeps a dequantised copy of W."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.w = w
        return _product(x, w)

    @staticmethod
    def backward(ctx, grad):
        g = grad.reshape(-1, grad.shape[-1])  # [M, N]
        return times(g, ctx.w).reshape(*grad.shape[:-1], ctx.w.cols), None


def dequantised_applies(rows: torch.Tensor, w: QTensor) -> bool:
    """Whether the product of these rows with w dequantises w to bf16 and calls oneDNN: many bf16
    rows (DEQUANTISE_FROM_ROWS), each not computed as if alone (invariance off), weights in blocks
    the C dequantiser reads (not interleaved rows: the tiles take those), a CPU that multiplies bf16
    in hardware (where oneDNN outruns the integer kernels on many rows)."""
    return (
        rows.shape[0] >= DEQUANTISE_FROM_ROWS
        and rows.dtype == torch.bfloat16
        and not invariance.active()
        and w.fmt.name not in LAYOUTS
        and bf16_kernels.cpu_has_native_bf16()
    )


def _dequantised(rows: torch.Tensor, w: QTensor) -> torch.Tensor:
    """rows [M, K] bf16 times w^T, w dequantised to bf16 one part at a time -> [M, N] fp32."""
    ys = []
    for p in w.parts:
        dense = kernels.rows(p, w.fmt.ggml, w.cols, torch.arange(p.shape[0]), torch.bfloat16)
        ys.append(F.linear(rows, dense).float())  # [M, N_i]
    return torch.cat(ys, dim=1) if len(ys) > 1 else ys[0]


def _product(x: torch.Tensor, w: QTensor) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])  # [M, K]
    if native_applies(rows, w):
        if dequantised_applies(rows, w):
            return _joined([_dequantised(rows, w)], x, w)
        return _joined([kernels.linear(rows, w.fmt.ggml, p, w.cols) for p in w.parts], x, w)
    return _joined([F.linear(rows.float(), w.dequantize(torch.float32))], x, w)


def _joined(ys: list[torch.Tensor], x: torch.Tensor, w: QTensor) -> torch.Tensor:
    """The products [M, N_i] fp32 of w's parts as one [..., N] in x's dtype and leading shape."""
    y = ys[0] if len(ys) == 1 else torch.cat(ys, dim=1)  # [M, N]
    return y.to(x.dtype).reshape(*x.shape[:-1], w.shape[0])


def linear(x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear for a dense or a QTensor weight."""
    if not isinstance(weight, QTensor):
        return F.linear(x, weight, bias)
    y = matmul(x, weight)
    return y if bias is None else y + bias.to(y.dtype)


def linears(x: torch.Tensor, weights: list[QTensor], biases: list) -> list[torch.Tensor]:
    """linear(x, w, b) for each weight and bias, the same bits, in one kernel call where the kernels
    take them all (an attention's q, k and v at prefill): x quantised once per kind of activations
    the formats read, and every product's rows in one region of the threads, where three calls
    quantised x three times, each on one thread, and the two small products scaled 1.5x on two
    threads (docs/notes/2026-12-06-prefill-two-threads.md)."""
    rows = x.reshape(-1, x.shape[-1])  # [M, K]
    parts = [(w.fmt.ggml, p) for w in weights for p in w.parts]
    if (
        (torch.is_grad_enabled() and x.requires_grad)
        or len(parts) > 8
        or any(w.cols != rows.shape[1] for w in weights)
        or not native_applies(rows, *weights)
        or any(dequantised_applies(rows, w) for w in weights)
    ):
        return [linear(x, w, b) for w, b in zip(weights, biases)]
    ys = iter(kernels.linears(rows, parts, rows.shape[1]))  # [M, N_i] fp32 each
    out = []
    for w, b in zip(weights, biases):
        y = _joined([next(ys) for _ in w.parts], x, w)
        out.append(y if b is None else y + b.to(y.dtype))
    return out


__all__ = [
    "QTensor",
    "dense",
    "for_kernels",
    "matmul",
    "linear",
    "linears",
    "native_applies",
    "native",
]
