"""Token embeddings whose table may stay in blocks (a QTensor): rows are looked up and dequantised
(QTensor.lookup: one native call where it runs)."""

from __future__ import annotations

import torch
from torch import nn

from hybridmoe.quant.tensor import QTensor


class Embedding(nn.Embedding):
    """nn.Embedding (same parameter, same checkpoint name); models/base.py may replace its weight
    with a QTensor, whose looked-up rows come out in `dtype`."""

    quantizable = True
    dtype = torch.float32

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if isinstance(self.weight, QTensor):
            rows = self.weight.lookup(ids.reshape(-1), self.dtype)  # [n, H]
            return rows.reshape(*ids.shape, -1)  # [..., H]
        return super().forward(ids)
