"""Dense projections for a few rows at a time: the batched-decode shape.

Used by the attention, MLP and MLA layers and by the models' LM head; experts/ keeps F.linear
(experts/run/ffn.py expert_ffn says why).

A decode step of B sequences multiplies B rows by every dense weight. In fp32, torch's default
kernel (MKL sgemm) is slow at 2 <= B <= 32 when the weight comes from memory, where oneDNN's linear
on the same unpacked weights is about 1.5-4x faster (docs/notes/2026-11-24-measurements-in-code.md,
"FEW_ROWS"). One row stays on F.linear, so single-sequence decode keeps its exact arithmetic;
prefill chunks (many rows) and other dtypes (bf16 already goes to oneDNN) are unchanged.

Up to native.MAX_ROWS bf16 rows (bf16 decode, one row per sequence) go to the native kernel where it
runs (hybridmoe/native: it streams the weight once for all rows, at about twice oneDNN's speed on
this CPU), accumulated in fp32 and rounded to bf16 as F.linear does. Under
invariance.rows_alone, every bf16 row count goes there (hybridmoe/invariance.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybridmoe import invariance, native
from hybridmoe.layers.lora import LoRA, add_lora
from hybridmoe.quant.tensor import QTensor
from hybridmoe.quant.tensor import linear as qlinear
from hybridmoe.tuning import FEW_ROWS, THREADED_NATIVE_ROWS

_ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def native_rows(x: torch.Tensor) -> int:
    """The most rows of x that `linear` hands to the native bf16 kernel."""
    # one kernel for every row count (a row never depends on the others), or where oneDNN emulates
    # bf16 (the kernels are faster at every count)
    if invariance.active() or native.kernels_beat_onednn():
        return x.numel()
    return native.MAX_ROWS if torch.get_num_threads() == 1 else THREADED_NATIVE_ROWS


def linear(x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, with x: [M, K], weight: [N, K] -> [M, N]: a weight in blocks (QTensor) on the
    integer kernels; a dense one on oneDNN for a few fp32 rows, on the native kernel for a few bf16
    rows."""
    if isinstance(weight, QTensor):
        return qlinear(x, weight, bias)
    if native.applies(x, weight, max_rows=native_rows(x)) and not torch.is_grad_enabled():
        if bias is None or (bias.dtype == torch.bfloat16 and bias.is_contiguous()):
            y = native.linear(x, weight, bias)  # [M, N] bf16, F.linear's arithmetic in one call
        else:
            y = native.gemm(x, weight)  # [M, N] fp32
            y = (y + bias.float()).to(x.dtype)
        return y if x.dim() == 2 else y.view(*x.shape[:-1], weight.shape[0])
    if (
        _ONEDNN
        and x.dim() == 2
        and 1 < x.shape[0] <= FEW_ROWS
        and x.dtype == torch.float32
        and weight.dtype == torch.float32
        and x.device.type == "cpu"
        and not torch.is_grad_enabled()
    ):
        return torch.ops.mkldnn._linear_pointwise(
            x.contiguous(), weight, bias, "none", [], ""
        )  # [M, N]
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """nn.Linear (same parameters, same checkpoint names) computed by `linear` above, plus the LoRA
    adapters attached to it (layers/lora.py), each on the rows that use it. Its weight may be
    replaced by a QTensor (models/base.py does, for weights kept in blocks) unless `quantizable` is
    off (a layer that reads the weight's values itself)."""

    quantizable = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.adapters: dict[str, LoRA] = {}  # name -> adapter; not submodules (layers/lora.py)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear(x, self.weight, self.bias)
        return add_lora(y, x, self.adapters) if self.adapters else y
