"""Blocks back to values on a CUDA GPU in one Triton kernel per matrix, where dequant.py's torch ops
launch ~15-25 kernels and write fp32 intermediates for each of them (an expert the GPU cache holds
in blocks is expanded at every use). Same values, same bits: each value is computed from its
block's fields in the order dequant.py computes it, the kernel built without contracting a
multiply and an add into an fma (`enable_fp_fusion=False`), as torch's separate ops round them.

The kernel reads GGUF's rows and the interleaved layouts (interleave.py) as they lie: a byte's
place is computed from its row, its block and its piece, so interleaved rows need no deinterleave
copy first. Triton's interpreter (TRITON_INTERPRET=1) runs the same kernel on CPU tensors, which is
how tests/test_triton_dequant.py holds it to dequant.py and to gguf's dequantize without a GPU.

This module imports triton: dequant.py imports it only for tensors on a CUDA device."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridmoe.quant.formats import FORMATS, LAYOUTS, Format

TILE_BYTES = 4096  # about the bytes of blocks a program reads: 32 Q4_K or 128 Q8_0 blocks
INT32_MAX = 2**31 - 1  # the kernel's offsets are int32


@triton.jit
def _byte(
    src,
    row,
    blk,
    off,
    mask,
    WIDTH,
    SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    START: tl.constexpr,
    UNIT: tl.constexpr,
):
    """Byte `off` of block `blk` of row `row` (int32), where off lies in the piece that starts at
    START in units of UNIT: GGUF's rows (GROUP 1), or rows interleaved GROUP at a time
    (interleave.py: unit i of row r of a group at unit GROUP i + r of the piece)."""
    if GROUP == 1:
        at = row * WIDTH + blk * SIZE + off
    else:
        rel = off - START
        at = (
            (row // GROUP) * (GROUP * WIDTH)
            + blk * (GROUP * SIZE)
            + START * GROUP
            + ((rel // UNIT) * GROUP + row % GROUP) * UNIT
            + rel % UNIT
        )
    return tl.load(src + at, mask=mask, other=0).to(tl.int32)


@triton.jit
def _half(src, row, blk, mask, WIDTH, SIZE: tl.constexpr, GROUP: tl.constexpr, START: tl.constexpr):
    """The IEEE half at bytes START, START + 1 of a block (a piece, units of 2) as fp32."""
    lo = _byte(src, row, blk, START, mask, WIDTH, SIZE, GROUP, START, 2)
    hi = _byte(src, row, blk, START + 1, mask, WIDTH, SIZE, GROUP, START, 2)
    return (lo | (hi << 8)).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _int8(b):
    """A byte (0..255, int32) as the int8 it holds."""
    return tl.where(b > 127, b - 256, b)


@triton.jit
def _k_scale_min(src, row, blk, s, mask, WIDTH, SIZE: tl.constexpr, GROUP: tl.constexpr):
    """Q4_K / Q5_K: the 6-bit scale and minimum of sub-block s (0..7) from the 12 bytes at 4
    (dequant.py _scales_k4)."""
    a = _byte(src, row, blk, 4 + s % 4, mask, WIDTH, SIZE, GROUP, 4, 1)
    b = _byte(src, row, blk, 8 + s % 4, mask, WIDTH, SIZE, GROUP, 4, 1)
    c = _byte(src, row, blk, 12 + s % 4, mask, WIDTH, SIZE, GROUP, 4, 1)
    sc = tl.where(s < 4, a & 63, (c & 15) | ((a >> 6) << 4))
    mn = tl.where(s < 4, b & 63, (c >> 4) | ((b >> 6) << 4))
    return sc, mn


@triton.jit
def _k4(
    src,
    row,
    blk,
    j,
    mask,
    WIDTH,
    SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    NIB: tl.constexpr,
    FIFTH: tl.constexpr,
):
    """Q4_K / Q5_K values d sc q - dmin mn (dequant.py _k4): the nibbles at NIB, for Q5_K (FIFTH)
    the fifth bits at 16 (bit s of byte j % 32 for sub-block s)."""
    s = j // 32  # sub-block; its nibbles are group s // 2's, low for even s
    d = _half(src, row, blk, mask, WIDTH, SIZE, GROUP, 0)
    dmin = _half(src, row, blk, mask, WIDTH, SIZE, GROUP, 2)
    sc, mn = _k_scale_min(src, row, blk, s, mask, WIDTH, SIZE, GROUP)
    b = _byte(src, row, blk, NIB + (s // 2) * 32 + j % 32, mask, WIDTH, SIZE, GROUP, NIB, 8)
    q = tl.where(s % 2 == 0, b & 15, b >> 4)
    if FIFTH:
        h = _byte(src, row, blk, 16 + j % 32, mask, WIDTH, SIZE, GROUP, 16, 8)
        q = q | (((h >> s) & 1) << 4)
    return (d * sc.to(tl.float32)) * q.to(tl.float32) - dmin * mn.to(tl.float32)


@triton.jit
def _values(
    src, row, blk, j, mask, WIDTH, FMT: tl.constexpr, SIZE: tl.constexpr, GROUP: tl.constexpr
):
    """fp32 values j (0 .. block-1) of block blk of row row, as dequant.py computes them. FMT: the
    GGUF type (formats.py ggml)."""
    if FMT == 8:  # q8_0: d q
        d = _half(src, row, blk, mask, WIDTH, SIZE, GROUP, 0)
        q = _int8(_byte(src, row, blk, 2 + j, mask, WIDTH, SIZE, GROUP, 2, 4))
        v = d * q.to(tl.float32)
    elif FMT == 2:  # q4_0: d (q - 8)
        d = _half(src, row, blk, mask, WIDTH, SIZE, GROUP, 0)
        b = _byte(src, row, blk, 2 + j % 16, mask, WIDTH, SIZE, GROUP, 2, 4)
        q = tl.where(j < 16, b & 15, b >> 4)
        v = d * (q.to(tl.float32) - 8.0)
    elif FMT == 3:  # q4_1: d q + m
        d = _half(src, row, blk, mask, WIDTH, SIZE, GROUP, 0)
        m = _half(src, row, blk, mask, WIDTH, SIZE, GROUP, 2)
        b = _byte(src, row, blk, 4 + j % 16, mask, WIDTH, SIZE, GROUP, 4, 4)
        q = tl.where(j < 16, b & 15, b >> 4)
        v = d * q.to(tl.float32) + m
    elif FMT == 12:  # q4_k: nibbles at 16
        v = _k4(src, row, blk, j, mask, WIDTH, SIZE, GROUP, 16, False)
    elif FMT == 13:  # q5_k: fifth bits at 16, nibbles at 48
        v = _k4(src, row, blk, j, mask, WIDTH, SIZE, GROUP, 48, True)
    else:  # q6_k (14): d sc (q - 32); half h, quarter r of it, element l of the quarter
        h = j // 128
        r = (j % 128) // 32
        low = _byte(src, row, blk, 64 * h + 32 * (r % 2) + j % 32, mask, WIDTH, SIZE, GROUP, 0, 8)
        low = tl.where(r < 2, low & 15, low >> 4)
        high = _byte(src, row, blk, 128 + 32 * h + j % 32, mask, WIDTH, SIZE, GROUP, 128, 8)
        q = low | (((high >> (2 * r)) & 3) << 4)
        sc = _int8(_byte(src, row, blk, 192 + j // 16, mask, WIDTH, SIZE, GROUP, 192, 1))
        d = _half(src, row, blk, mask, WIDTH, SIZE, GROUP, 208)
        v = (d * sc.to(tl.float32)) * (q.to(tl.float32) - 32.0)
    return v


@triton.jit
def _bf16_bits(v):
    """fp32 v -> the int16 bits of bf16(v), rounded to nearest even as torch rounds (NaN: the quiet
    NaN). In integers, since Triton's interpreter rounds its bf16 casts half up."""
    u = v.to(tl.uint32, bitcast=True)
    r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return tl.where(v != v, 0x7FC0, r).to(tl.uint16).to(tl.int16, bitcast=True)


@triton.jit
def _dequantize(
    src,
    dst,
    BLOCKS,
    NS,
    WIDTH,
    FMT: tl.constexpr,
    BLOCK: tl.constexpr,
    SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    TILE: tl.constexpr,
    BF16: tl.constexpr,
):
    """dst [rows, NS BLOCK] = the values of src's blocks: TILE blocks (of BLOCKS, NS a row) a
    program, each its BLOCK values; dst fp32, or for BF16 the int16 bits of bf16 values."""
    b = tl.program_id(0) * TILE + tl.arange(0, TILE)[:, None]  # [TILE, 1] block of the matrix
    row, blk = b // NS, b % NS
    j = tl.arange(0, BLOCK)[None, :]  # [1, BLOCK]
    mask = b < BLOCKS  # [TILE, 1]
    v = _values(src, row, blk, j, mask, WIDTH, FMT, SIZE, GROUP)  # [TILE, BLOCK]
    if BF16:
        tl.store(dst + b * BLOCK + j, _bf16_bits(v), mask=mask)
    else:
        tl.store(dst + b * BLOCK + j, v, mask=mask)


def dequantize(
    data: torch.Tensor, fmt: Format, cols: int, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """uint8 [rows, row bytes] of `fmt` blocks (GGUF rows or an interleaved layout) -> [rows, cols]
    fp32 (dequant.py's bits) or bf16 (those rounded), in one kernel launch."""
    rows, width = data.shape
    if data.stride(1) != 1 or data.stride(0) != width:
        data = data.contiguous()
    group = fmt.rows if fmt.name in LAYOUTS else 1
    size, ns = fmt.nbytes, cols // fmt.block
    if dtype not in (torch.float32, torch.bfloat16):
        return dequantize(data, fmt, cols).to(dtype)
    most = INT32_MAX // max(width, cols) // group * group  # rows whose offsets fit int32
    if rows > most:  # a launch for each run of rows (whole groups)
        return torch.cat(
            [dequantize(data[r : r + most], fmt, cols, dtype) for r in range(0, rows, most)]
        )
    out = torch.empty(rows, cols, dtype=dtype, device=data.device)
    tile = triton.next_power_of_2(max(1, TILE_BYTES // size))
    blocks = rows * ns
    _dequantize[(triton.cdiv(blocks, tile),)](
        data,
        out.view(torch.int16) if dtype == torch.bfloat16 else out,
        blocks,
        ns,
        width,
        FMT=FORMATS[fmt.blocks_of].ggml,
        BLOCK=fmt.block,
        SIZE=size,
        GROUP=group,
        TILE=tile,
        BF16=dtype == torch.bfloat16,
        enable_fp_fusion=False,
    )
    return out
