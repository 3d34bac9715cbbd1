"""The Triton kernel that turns blocks back into values on a CUDA GPU (quant/triton_dequant.py),
held to dequant.py's torch ops (the same bits) and to gguf's own dequantiser, for every format and
every interleaved layout. Without a GPU it runs in Triton's interpreter (TRITON_INTERPRET=1: the
same kernel, its operations done by numpy on CPU tensors); with one, compiled, on the device."""

from __future__ import annotations

import importlib

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from hybridmoe.quant import dequant
from hybridmoe.quant.formats import FORMATS, INTERLEAVED, named
from hybridmoe.quant.interleave import interleave
from tests.test_quant import random_blocks

LAYOUTS = [*FORMATS, *(f.name for f in INTERLEAVED.values())]


@pytest.fixture(scope="module")
def interpreted():
    """triton_dequant with its kernels built for Triton's interpreter (the choice is made when a
    kernel is defined), then built again as they were."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        from hybridmoe.quant import triton_dequant

        yield importlib.reload(triton_dequant)
    importlib.reload(triton_dequant)


def blocks(name: str, rows: int, cols: int, seed: int) -> torch.Tensor:
    """uint8 [rows, row bytes] of random valid blocks in format or layout `name`."""
    fmt = named(name)
    raw = random_blocks(FORMATS[fmt.blocks_of], rows, cols, np.random.default_rng(seed))
    data = torch.from_numpy(raw)
    return interleave(data, fmt.blocks_of) if fmt.family else data


@pytest.mark.parametrize("name", LAYOUTS)
@pytest.mark.parametrize("rows,cols", [(16, 256), (48, 768), (32, 2816)])
def test_the_kernel_gives_the_torch_ops_bits_and_gguf_values(interpreted, name, rows, cols):
    fmt = named(name)
    data = blocks(name, rows, cols, seed=rows + cols)
    got = interpreted.dequantize(data, fmt, cols)  # [rows, cols] fp32
    assert torch.equal(got, dequant.dequantize(data, fmt, cols))
    plain = dequant.deinterleave(data, fmt.family) if fmt.family else data
    ref = quants.dequantize(plain.numpy(), GGMLQuantizationType(FORMATS[fmt.blocks_of].ggml))
    np.testing.assert_allclose(got.numpy(), ref, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("name", ["q4_k", "q6_k_x8", "q8_0_x16"])
def test_the_kernel_writes_bf16_as_fp32_rounded(interpreted, name):
    fmt = named(name)
    data = blocks(name, 16, 512, seed=7)
    got = interpreted.dequantize(data, fmt, 512, torch.bfloat16)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, dequant.dequantize(data, fmt, 512).to(torch.bfloat16))


def test_the_kernel_reads_strided_rows(interpreted):
    """Rows with a gap between them (a slice of a wider buffer) are read as the rows they are."""
    data = blocks("q4_k", 8, 512, seed=3)
    wide = torch.zeros(8, data.shape[1] + 32, dtype=torch.uint8)
    wide[:, : data.shape[1]] = data
    got = interpreted.dequantize(wide[:, : data.shape[1]], FORMATS["q4_k"], 512)
    assert torch.equal(got, dequant.dequantize(data, FORMATS["q4_k"], 512))


def test_a_matrix_past_int32_offsets_is_dequantised_a_run_of_rows_at_a_time(
    interpreted, monkeypatch
):
    """Where a matrix's offsets would pass int32, the rows go in runs of whole groups, each its own
    launch, with the same values (the limit lowered here, so the matrix can stay small)."""
    fmt = named("q4_0_x16")
    data = blocks("q4_0_x16", 64, 512, seed=5)
    monkeypatch.setattr(
        interpreted, "INT32_MAX", 40 * 512
    )  # 40 rows -> runs of 32 (whole sixteens)
    launches = []
    kernel = interpreted._dequantize
    monkeypatch.setattr(interpreted, "_dequantize", _Counting(kernel, launches))
    got = interpreted.dequantize(data, fmt, 512)
    assert len(launches) == 2 and torch.equal(got, dequant.dequantize(data, fmt, 512))


class _Counting:
    """A kernel launcher that notes each launch's grid."""

    def __init__(self, kernel, launches: list):
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid):
        self.launches.append(grid)
        return self.kernel[grid]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", LAYOUTS)
def test_a_cuda_gpu_dequantises_in_the_kernel_with_the_cpus_bits(name):
    fmt = named(name)
    data = blocks(name, 64, 2048, seed=11)
    on_gpu = dequant.dequantize(data.cuda(), fmt, 2048)  # the kernel, compiled for the GPU
    assert torch.equal(on_gpu.cpu(), dequant.dequantize(data, fmt, 2048))
