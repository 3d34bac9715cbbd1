"""The native bf16 kernels against references computed in float64 by torch, and their fallbacks."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from hybridmoe import native
from hybridmoe.experts.runtime import expert_ffn
from hybridmoe.experts.store import ExpertWeights
from hybridmoe.layers.linear import linear

needs_kernels = pytest.mark.skipif(not native.cpu_has_avx512_bf16(), reason="needs a CPU with AVX512-BF16")


def bf16(*shape, gen):
    return torch.randn(*shape, generator=gen).to(torch.bfloat16)


@needs_kernels
@pytest.mark.parametrize("rows, cols", [(1536, 2048), (7, 100), (4, 32), (5, 31), (3, 1)])
def test_gemv_matches_a_float64_product(rows, cols):
    # Odd shapes exercise the masked tail of a row and the rows left over after groups of four.
    gen = torch.Generator().manual_seed(rows * 1000 + cols)
    w, x = bf16(rows, cols, gen=gen), bf16(1, cols, gen=gen)
    ref = w.double() @ x[0].double()  # [rows]: bf16 products are exact, only the sums round
    got = native.gemv(x, w)
    assert got.dtype == torch.float32 and got.shape == (rows,)
    scale = w.double().abs() @ x[0].double().abs()  # [rows]: the bound the fp32 sums' rounding scales with
    assert torch.all((got.double() - ref).abs() <= 1e-6 * scale + 1e-30)


@needs_kernels
def test_expert_matches_swiglu_with_one_bf16_rounding():
    gen = torch.Generator().manual_seed(1)
    hidden, inter = 256, 96
    gate_up, down, x = bf16(2 * inter, hidden, gen=gen) / 8, bf16(hidden, inter, gen=gen) / 8, bf16(1, hidden, gen=gen)
    g, u = (gate_up.double() @ x[0].double()).chunk(2)  # [I] each
    h = (F.silu(g) * u).to(torch.bfloat16)  # [I]: the kernel rounds its down projection's input once
    ref = down.double() @ h.double()  # [H]
    got = native.expert(x, gate_up, down)
    # A few entries of h may round the other way (g, u differ from float64 by fp32 rounding): a loose bound.
    assert torch.allclose(got.double(), ref, rtol=0, atol=1e-2 * ref.abs().max().item())
    # ... and it is much closer than torch's own bf16 path is to the same reference
    torch_path = F.linear(F.silu((x @ gate_up.t())[:, :inter]) * (x @ gate_up.t())[:, inter:], down)[0]
    assert (got.double() - ref).norm() <= (torch_path.double() - ref).norm()


@needs_kernels
def test_linear_and_expert_ffn_take_the_kernels_for_one_bf16_row():
    gen = torch.Generator().manual_seed(2)
    w, b, x = bf16(64, 128, gen=gen), bf16(64, gen=gen), bf16(1, 128, gen=gen)
    with torch.inference_mode():
        got = linear(x, w, b)
    ref = (native.gemv(x, w) + b.float()).to(torch.bfloat16).view(1, 64)
    assert got.dtype == torch.bfloat16 and torch.equal(got, ref)
    # within one bf16 rounding of torch's F.linear
    assert torch.allclose(got.float(), F.linear(x, w, b).float(), rtol=2 ** -7, atol=1e-2)
    weights = ExpertWeights(bf16(2 * 32, 128, gen=gen), bf16(128, 32, gen=gen))
    y = expert_ffn(x, weights)
    assert y.shape == (1, 128) and torch.equal(y, native.expert(x, weights.gate_up, weights.down).to(torch.bfloat16)[None])
    # two rows, or fp32, stay on torch: the same as F.linear bit for bit
    x2 = bf16(2, 128, gen=gen)
    assert torch.equal(linear(x2, w), F.linear(x2, w))


def _available_in_subprocess(env: dict) -> str:
    code = "from hybridmoe import native; print(native.available())"
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True,
                         check=True)
    return out.stdout.strip()


def test_switched_off_or_without_a_compiler_torch_keeps_the_work(tmp_path):
    assert _available_in_subprocess({"HYBRIDMOE_NATIVE": "0"}) == "False"
    # a fresh cache and no compiler: nothing to load, no error, and no half-written library left behind
    assert _available_in_subprocess({"XDG_CACHE_HOME": str(tmp_path), "CC": "/nonexistent/cc"}) == "False"
    assert not list((tmp_path / "hybridmoe" / "native").glob("*.so"))


@needs_kernels
def test_the_library_is_built_once_into_the_cache(tmp_path):
    assert _available_in_subprocess({"XDG_CACHE_HOME": str(tmp_path)}) == "True"
    built = list((tmp_path / "hybridmoe" / "native").iterdir())
    assert len(built) == 1 and built[0].suffix == ".so"
    stamp = built[0].stat().st_mtime_ns
    assert _available_in_subprocess({"XDG_CACHE_HOME": str(tmp_path)}) == "True"
    assert [p.stat().st_mtime_ns for p in (tmp_path / "hybridmoe" / "native").iterdir()] == [stamp]
