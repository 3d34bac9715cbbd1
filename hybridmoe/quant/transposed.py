"""The product by a block-format matrix the other way round, g [M, N] @ W [N, K]: what the backward
of y = x W^T needs for the gradient of x, through frozen quantised weights (LoRA training).

The integer kernels (native/quant.c) take x W^T only: a block runs along a row of W (along K), and
this product sums down W's columns, across blocks, which would need W re-blocked the other way. So
W is dequantised a tile of TRAIN_DEQUANT_ROWS rows at a time into g's dtype and multiplied there;
the tiles' products add up in fp32. At most one tile's values exist at once, whatever W's size (an
LM head of 150k rows as well as an expert): nothing of W's full size is ever made in fp32."""

from __future__ import annotations

import torch

from hybridmoe import tuning
from hybridmoe.quant.dequant import dequantize


def times(g: torch.Tensor, w) -> torch.Tensor:
    """g [M, N] @ W [N, K] for a QTensor W -> [M, K] in g's dtype (fp32 accumulation across
    tiles)."""
    out = torch.zeros(g.shape[0], w.cols, dtype=torch.float32)  # [M, K]
    start = 0
    for part in w.parts:  # parts' rows follow one another
        for first in range(0, part.shape[0], tuning.TRAIN_DEQUANT_ROWS):
            rows = part[first : first + tuning.TRAIN_DEQUANT_ROWS]  # [n, row bytes], a view
            tile = dequantize(rows, w.fmt, w.cols).to(g.dtype)  # [n, K]
            n = rows.shape[0]
            out += g[:, start + first : start + first + n] @ tile
        start += part.shape[0]
    return out.to(g.dtype)
