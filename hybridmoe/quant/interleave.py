"""Rows in eights (the q4_k_x8 and q6_k_x8 layouts): the same bytes as a Q4_K or Q6_K matrix whose
rows are a multiple of 8, each eight rows' super-blocks side by side so that one 64-byte load holds
the same 8 bytes of eight rows (native/quant.c, "rows in eights", states the layouts and why). Rows
8g .. 8g+7 keep their place in memory, so slices of whole eights stay valid. Torch ops, so that a
GPU turns an expert's bytes back as the CPU does.

Super-block s of eight rows: each piece of a row's block (PIECES: `length` bytes from `start`, in
units of `unit` bytes) with the same piece of the other seven rows, unit i of row r at unit 8i + r,
the pieces one after another. Q4_K (1152 bytes): d (fp16), dmin, the 12 scale bytes, the 128 bytes
of nibbles in units of 8. Q6_K (1680 bytes): ql (128 bytes in units of 8), qh (64 in units of 8),
the 16 int8 scales, d."""

from __future__ import annotations

import torch

ROWS = 8  # rows side by side
# block format -> (bytes of a super-block, its pieces as (start, unit, length)): quant.c X8_PIECES
PIECES = {
    "q4_k": (144, ((0, 2, 2), (2, 2, 2), (4, 1, 12), (16, 8, 128))),
    "q6_k": (210, ((0, 8, 128), (128, 8, 64), (192, 1, 16), (208, 2, 2))),
}


def interleave(data: torch.Tensor, fmt: str) -> torch.Tensor:
    """uint8 [N, row bytes] rows of `fmt` blocks (q4_k or q6_k; N a multiple of 8) -> the same
    shape in rows in eights (a new tensor; a model's weights are rearranged in place at load by
    quant.c's hm_to_x8, which tests/test_quant_rows_in_eights.py holds to this)."""
    n, width = data.shape
    size, pieces = PIECES[fmt]
    ns = width // size
    b = data.reshape(n // ROWS, ROWS, ns, size).transpose(1, 2)  # [G, ns, 8, size]
    flat = []
    for start, unit, length in pieces:
        p = b[..., start : start + length].reshape(*b.shape[:3], length // unit, unit)
        flat.append(p.transpose(2, 3).reshape(*b.shape[:2], -1))  # [G, ns, units * 8 * unit]
    return torch.cat(flat, dim=-1).reshape(n, width)  # [G, ns, 8 * size] -> [N, row bytes]


def deinterleave(data: torch.Tensor, fmt: str) -> torch.Tensor:
    """interleave's inverse: uint8 [N, row bytes] rows in eights of `fmt` -> the GGUF rows."""
    n, width = data.shape
    size, pieces = PIECES[fmt]
    ns = width // size
    b = data.reshape(n // ROWS, ns, ROWS * size)  # [G, ns, 8 * size]
    rows, at = [], 0
    for _, unit, length in pieces:  # pieces lie in the order of their starts in a row
        p = b[..., at : at + ROWS * length].reshape(*b.shape[:2], length // unit, ROWS, unit)
        rows.append(p.transpose(2, 3).reshape(*b.shape[:2], ROWS, length))  # [G, ns, 8, length]
        at += ROWS * length
    return torch.cat(rows, dim=-1).transpose(1, 2).reshape(n, width)  # [G, 8, ns, size]
