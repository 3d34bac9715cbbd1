"""Blocks back to values, in torch ops that run on the CPU and on a GPU alike: the fallback where
the native kernels do not run, and how an accelerator expands an expert it holds in blocks
(formats.py gives each layout). data: uint8 [rows, row bytes] -> float32 [rows, cols]. On a CUDA
GPU with triton (every CUDA build of torch brings it) one kernel computes the same values
(triton_dequant.py)."""

from __future__ import annotations

import importlib.util
from functools import cache

import torch

from hybridmoe.quant.formats import LAYOUTS, Format
from hybridmoe.quant.interleave import deinterleave


def _f16(b: torch.Tensor) -> torch.Tensor:
    """[..., 2] bytes of an IEEE half -> [...] float32."""
    return b.contiguous().view(torch.float16).squeeze(-1).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[..., 16] bytes -> [..., 32]: the low nibbles, then the high ones."""
    return torch.cat([qs & 15, qs >> 4], dim=-1)


def _q8_0(b: torch.Tensor) -> torch.Tensor:  # [R, nb, 34]
    return _f16(b[..., :2])[..., None] * b[..., 2:].contiguous().view(torch.int8).float()


def _q4_0(b: torch.Tensor) -> torch.Tensor:  # [R, nb, 18]
    return _f16(b[..., :2])[..., None] * (_nibbles(b[..., 2:]).float() - 8.0)


def _q4_1(b: torch.Tensor) -> torch.Tensor:  # [R, nb, 20]
    return _f16(b[..., :2])[..., None] * _nibbles(b[..., 4:]).float() + _f16(b[..., 2:4])[..., None]


def _scales_k4(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., 12] packed bytes -> 6-bit scales and minimums of the 8 blocks, [..., 8] each."""
    s = s.int()
    sc = torch.cat([s[..., 0:4] & 63, (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)], dim=-1)
    mn = torch.cat([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], dim=-1)
    return sc, mn


def _k4(b: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Q4_K / Q5_K values from blocks b [R, ns, bytes] and their q [R, ns, 8, 32]."""
    sc, mn = _scales_k4(b[..., 4:16])  # [R, ns, 8]
    d, dmin = _f16(b[..., 0:2])[..., None], _f16(b[..., 2:4])[..., None]
    return (d * sc)[..., None] * q.float() - (dmin * mn)[..., None]


def _k_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[R, ns, 128] -> [R, ns, 8, 32]: group g's low nibbles are block 2g, its high nibbles 2g+1."""
    g = qs.reshape(*qs.shape[:-1], 4, 1, 32)
    return torch.cat([g & 15, g >> 4], dim=-2).reshape(*qs.shape[:-1], 8, 32)


def _q4_k(b: torch.Tensor) -> torch.Tensor:  # [R, ns, 144]
    return _k4(b, _k_nibbles(b[..., 16:144]))


def _q5_k(b: torch.Tensor) -> torch.Tensor:  # [R, ns, 176]
    shifts = torch.arange(8, device=b.device, dtype=torch.uint8)[:, None]  # block j takes bit j
    high = (b[..., None, 16:48] >> shifts) & 1  # [R, ns, 8, 32]
    return _k4(b, _k_nibbles(b[..., 48:176]) | (high << 4))


def _q6_k(b: torch.Tensor) -> torch.Tensor:  # [R, ns, 210]
    blocks = []
    for h in range(2):  # half h: blocks 4h .. 4h+3
        ql, qh = b[..., 64 * h : 64 * h + 64], b[..., 128 + 32 * h : 160 + 32 * h]
        for r in range(4):
            low = ql[..., 32 * (r & 1) : 32 * (r & 1) + 32]
            low = low & 15 if r < 2 else low >> 4
            blocks.append(low | (((qh >> (2 * r)) & 3) << 4))
    q = torch.stack(blocks, dim=-2).reshape(*b.shape[:-1], 16, 16).float() - 32.0  # [R, ns, 16, 16]
    sc = b[..., 192:208].contiguous().view(torch.int8).float()  # [R, ns, 16]
    return (_f16(b[..., 208:210])[..., None] * sc)[..., None] * q


_DEQUANT = {
    "q8_0": _q8_0,
    "q4_0": _q4_0,
    "q4_1": _q4_1,
    "q4_k": _q4_k,
    "q5_k": _q5_k,
    "q6_k": _q6_k,
}


@cache
def triton_present() -> bool:
    return importlib.util.find_spec("triton") is not None


def dequantize(
    data: torch.Tensor, fmt: Format, cols: int, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """uint8 [rows, row bytes] of `fmt` blocks -> [rows, cols]: float32, or those values in
    `dtype`."""
    if data.is_cuda and triton_present():
        from hybridmoe.quant import triton_dequant

        return triton_dequant.dequantize(data, fmt, cols, dtype)
    rows = data.shape[0]
    if fmt.name in LAYOUTS:
        data = deinterleave(data, fmt.family)
    blocks = data.reshape(rows, cols // fmt.block, fmt.nbytes)
    return _DEQUANT[fmt.blocks_of](blocks).reshape(rows, cols).to(dtype)
