"""Q4_K rows in eights (the q4_k_x8 format): the same bytes as a Q4_K matrix whose rows are a
multiple of 8, each eight rows' super-blocks side by side so that one 64-byte load holds the same
8 bytes of eight rows (native/quant.c, "Q4_K rows in eights", states the layout and why). Rows 8g ..
8g+7 keep their place in memory, so slices of whole eights stay valid. Torch ops, so that a GPU
turns an expert's bytes back as the CPU does.

Super-block s of eight rows, 1152 bytes: d of the 8 rows (fp16 each), their dmin, their 12 scale
bytes (byte j of row r at 8j + r), their nibbles (8 bytes of row r's 128: bytes 8k .. 8k+7 at
64k + 8r)."""

from __future__ import annotations

import torch

ROWS = 8  # rows side by side
SUPER = 144  # bytes of a Q4_K super-block


def interleave(data: torch.Tensor) -> torch.Tensor:
    """uint8 [N, row bytes] Q4_K rows (N a multiple of 8) -> the same shape in q4_k_x8 (a new
    tensor; a model's weights are rearranged in place at load by quant.c's hm_q4k_to_x8, which
    tests/test_quant_rows_in_eights.py holds to this)."""
    n, width = data.shape
    ns = width // SUPER
    b = data.reshape(n // ROWS, ROWS, ns, SUPER).transpose(1, 2)  # [G, ns, 8, 144]
    parts = (
        b[..., 0:2],  # [G, ns, 8, 2]: d of each row
        b[..., 2:4],
        b[..., 4:16].transpose(-1, -2),  # [G, ns, 12, 8]: byte j of each row
        b[..., 16:].reshape(*b.shape[:2], ROWS, 16, 8).transpose(2, 3),  # [G, ns, 16, 8, 8]
    )
    flat = [p.reshape(*b.shape[:2], -1) for p in parts]
    return torch.cat(flat, dim=-1).reshape(n, width)  # [G, ns, 1152] -> [N, row bytes]


def deinterleave(data: torch.Tensor) -> torch.Tensor:
    """interleave's inverse: uint8 [N, row bytes] in q4_k_x8 -> the Q4_K rows."""
    n, width = data.shape
    ns = width // SUPER
    b = data.reshape(n // ROWS, ns, ROWS * SUPER)  # [G, ns, 1152]
    d = b[..., 0:16].reshape(*b.shape[:2], ROWS, 2)  # [G, ns, 8, 2]
    dmin = b[..., 16:32].reshape(*b.shape[:2], ROWS, 2)
    scales = b[..., 32:128].reshape(*b.shape[:2], 12, ROWS).transpose(-1, -2)  # [G, ns, 8, 12]
    qs = b[..., 128:].reshape(*b.shape[:2], 16, ROWS, 8).transpose(2, 3)  # [G, ns, 8, 16, 8]
    rows = torch.cat([d, dmin, scales, qs.reshape(*qs.shape[:3], 128)], dim=-1)  # [G, ns, 8, 144]
    return rows.transpose(1, 2).reshape(n, width)
