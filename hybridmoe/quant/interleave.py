"""Interleaved rows: the q4_k_x8, q5_k_x8 and q6_k_x8 layouts (rows in eights) and q8_0_x16,
q4_0_x16 and q4_1_x16 (rows in sixteens). The same bytes as a matrix of those blocks whose rows are
a multiple of 8 (16), each group of rows' blocks side by side so that one 64-byte load holds the
same bytes of every row of the group (native/quant.c, "rows in eights" and "rows in sixteens",
states the layouts and why). Rows of a group keep their place in memory, so slices of whole groups
stay valid. Torch ops, so that a GPU turns an expert's bytes back as the CPU does.

Block s of a group of n rows: each piece of a row's block (PIECES: `length` bytes from `start`, in
units of `unit` bytes) with the same piece of the other rows, unit i of row r at unit n i + r, the
pieces one after another. Q4_K (8 rows, 1152 bytes): d (fp16), dmin, the 12 scale bytes, the 128
bytes of nibbles in units of 8. Q5_K (8 rows, 1408 bytes): as Q4_K's, its 32 bytes of fifth bits (in
units of 8) before the nibbles. Q6_K (8 rows, 1680 bytes): ql (128 bytes in units of 8), qh (64 in
units of 8), the 16 int8 scales, d. Q8_0 (16 rows, 544 bytes): d, the 32 int8 values in units of 4.
Q4_0 (16 rows, 288 bytes): d, the 16 bytes of nibbles in units of 4. Q4_1 (16 rows, 320 bytes): d,
m, the 16 bytes of nibbles in units of 4."""

from __future__ import annotations

import torch

# block format -> (rows a group, bytes of a block, its pieces as (start, unit, length)): quant.c
# X8_PIECES
PIECES = {
    "q4_k": (8, 144, ((0, 2, 2), (2, 2, 2), (4, 1, 12), (16, 8, 128))),
    "q5_k": (8, 176, ((0, 2, 2), (2, 2, 2), (4, 1, 12), (16, 8, 32), (48, 8, 128))),
    "q6_k": (8, 210, ((0, 8, 128), (128, 8, 64), (192, 1, 16), (208, 2, 2))),
    "q8_0": (16, 34, ((0, 2, 2), (2, 4, 32))),
    "q4_0": (16, 18, ((0, 2, 2), (2, 4, 16))),
    "q4_1": (16, 20, ((0, 2, 2), (2, 2, 2), (4, 4, 16))),
}


def interleave(data: torch.Tensor, fmt: str) -> torch.Tensor:
    """uint8 [N, row bytes] rows of `fmt` blocks (q4_k, q5_k, q6_k, q8_0, q4_0 or q4_1; N a multiple
    of the group's rows) -> the same shape interleaved (a new tensor; a model's weights are
    rearranged in place at load by quant.c's hm_interleave, which tests/test_quant_interleaved.py
    holds to this)."""
    n, width = data.shape
    rows, size, pieces = PIECES[fmt]
    ns = width // size
    b = data.reshape(n // rows, rows, ns, size).transpose(1, 2)  # [G, ns, rows, size]
    flat = []
    for start, unit, length in pieces:
        p = b[..., start : start + length].reshape(*b.shape[:3], length // unit, unit)
        flat.append(p.transpose(2, 3).reshape(*b.shape[:2], -1))  # [G, ns, units * rows * unit]
    return torch.cat(flat, dim=-1).reshape(n, width)  # [G, ns, rows * size] -> [N, row bytes]


def deinterleave(data: torch.Tensor, fmt: str) -> torch.Tensor:
    """interleave's inverse: uint8 [N, row bytes] interleaved rows of `fmt` -> the GGUF rows."""
    n, width = data.shape
    rows, size, pieces = PIECES[fmt]
    ns = width // size
    b = data.reshape(n // rows, ns, rows * size)  # [G, ns, rows * size]
    out, at = [], 0
    for _, unit, length in pieces:  # pieces lie in the order of their starts in a row
        p = b[..., at : at + rows * length].reshape(*b.shape[:2], length // unit, rows, unit)
        out.append(p.transpose(2, 3).reshape(*b.shape[:2], rows, length))  # [G, ns, rows, length]
        at += rows * length
    return torch.cat(out, dim=-1).transpose(1, 2).reshape(n, width)  # [G, rows, ns, size]
