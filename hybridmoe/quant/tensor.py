"""A weight matrix kept in a block format, and products with it.

`QTensor` holds a [rows, cols] matrix as `data`, uint8 [rows, row bytes] of GGUF blocks
(formats.py), often a view of the model file. `matmul(x, w)` multiplies by it on the native integer
kernels (native/quant.py) where they run, else by dequantising and using torch."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybridmoe import native
from hybridmoe.native import quant as kernels
from hybridmoe.quant.dequant import dequantize
from hybridmoe.quant.formats import FORMATS, Format


class QTensor:
    def __init__(self, data: torch.Tensor, fmt: Format, cols: int):
        if data.dtype != torch.uint8 or data.dim() != 2 or data.shape[1] != fmt.row_bytes(cols):
            raise ValueError(
                f"{fmt.name} blocks for {cols} columns need uint8 rows of "
                f"{fmt.row_bytes(cols)} bytes"
            )
        self.data, self.fmt, self.cols = data, fmt, cols

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.data.shape[0], self.cols))

    def dim(self) -> int:
        return 2

    @property
    def device(self) -> torch.device:
        return self.data.device

    def nbytes(self) -> int:
        return self.data.numel()

    def rows(self, index) -> QTensor:
        """The rows `index` selects (a slice, a list or a tensor of row numbers)."""
        return QTensor(self.data[index], self.fmt, self.cols)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize(self.data, self.fmt, self.cols).to(dtype)  # [rows, cols]

    def to(self, device) -> QTensor:
        return QTensor(self.data.to(device), self.fmt, self.cols)

    @classmethod
    def cat(cls, parts: list[QTensor]) -> QTensor:
        """Rows of `parts` one after another (a copy); all of one format and width."""
        if len({(p.fmt, p.cols) for p in parts}) != 1:
            raise ValueError("only matrices of one block format and width are stacked")
        return cls(torch.cat([p.data for p in parts]), parts[0].fmt, parts[0].cols)

    @classmethod
    def quantize(cls, weight: torch.Tensor, fmt_name: str) -> QTensor:
        """A dense [rows, cols] matrix quantised to `fmt_name` (native/quant.c's quantisers)."""
        fmt = FORMATS[fmt_name]
        return cls(
            kernels.quantize(weight, fmt.ggml, fmt.row_bytes(weight.shape[1])), fmt, weight.shape[1]
        )

    def __repr__(self) -> str:
        return f"QTensor({self.fmt.name}, {tuple(self.shape)})"


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
    """x [..., K] times w [N, K]^T -> [..., N] in x's dtype (fp32 accumulation)."""
    rows = x.reshape(-1, x.shape[-1])  # [M, K]
    if native_applies(rows, w):
        y = kernels.linear(rows, w.fmt.ggml, w.data, w.cols)  # [M, N] fp32
    else:
        y = F.linear(rows.float(), w.dequantize(torch.float32))
    return y.to(x.dtype).reshape(*x.shape[:-1], w.shape[0])


def linear(x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear for a dense or a QTensor weight."""
    if not isinstance(weight, QTensor):
        return F.linear(x, weight, bias)
    y = matmul(x, weight)
    return y if bias is None else y + bias.to(y.dtype)


__all__ = ["QTensor", "dense", "matmul", "linear", "native_applies", "native"]
