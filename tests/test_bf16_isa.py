"""The bf16 kernels' three builds (native/bf16.py isa()): with AVX512-BF16's instructions, with
those instructions written out in AVX512F for AVX-512 CPUs without them (bf16.c EMULATE_BF16), and
with every AVX-512 operation written out in AVX2 and FMA for CPUs without AVX-512 (avx2_512.h).
The emulated builds hold no bf16 instruction, the AVX2 one no AVX-512 register; their rounding is
Intel's definition of vcvtneps2bf16 on every kind of value; where the CPU has the instructions,
their dot products give theirs bit for bit on every kind of value, and a whole run of a model
(prefill and decode attention, products, the decode loop, batch invariance on and off) gives every
logit the native build gives."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from hybridmoe.native import bf16 as kernels
from hybridmoe.native.build import library_path, load
from tests.bf16_bits import bf16_with_exponents, same_bits
from tests.test_decode_attention import LAYOUTS, LENGTHS, history, paged_batch, reference
from tests.tiny import build_tiny

ROOT = Path(__file__).resolve().parents[1]
needs_avx512 = pytest.mark.skipif(
    kernels.best_isa() < kernels.EMULATED, reason="the emulated build needs AVX-512 (F, BW, VL)"
)
needs_bf16 = pytest.mark.skipif(
    kernels.best_isa() < kernels.NATIVE,
    reason="the native build, the reference here, needs a CPU with AVX512-BF16",
)


def build(isa: int):
    lib = load(kernels.SOURCE, kernels.flags(isa), kernels.SIGNATURES, kernels.HEADERS)
    assert lib is not None, "the bf16 kernels did not build"
    return lib


def runnable_builds() -> list[int]:
    builds = (kernels.AVX2, kernels.EMULATED, kernels.NATIVE)
    return [isa for isa in builds if isa <= kernels.best_isa()]


def test_the_build_follows_the_cpu_and_the_switch(monkeypatch):
    monkeypatch.setattr(
        kernels, "cpu_flags", lambda: frozenset({"avx512f", "avx512bw", "avx512vl"})
    )
    assert kernels.best_isa() == kernels.EMULATED  # Skylake-SP, Cascade Lake, Ice Lake
    monkeypatch.setattr(kernels, "cpu_flags", lambda: frozenset({"avx512f", "avx2", "fma"}))
    assert kernels.best_isa() == kernels.AVX2  # no BW/VL (Knights Landing): AVX2's build
    monkeypatch.setattr(kernels, "cpu_flags", lambda: frozenset({"avx2", "fma"}))
    assert kernels.best_isa() == kernels.AVX2  # Zen 2 and 3, Alder Lake and later client cores
    monkeypatch.setattr(kernels, "cpu_flags", lambda: frozenset({"avx", "sse4_2"}))
    assert kernels.best_isa() == 0  # torch's path
    flags = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx2", "fma"})
    monkeypatch.setattr(kernels, "cpu_flags", lambda: flags)
    cases = [(None, 3), ("avx512bf16", 3), ("avx512f", 2), ("avx2", 1), ("off", 0), ("junk", 3)]
    for wanted, isa in cases:
        if wanted is None:
            monkeypatch.delenv("HYBRIDMOE_BF16_ISA", raising=False)
        else:
            monkeypatch.setenv("HYBRIDMOE_BF16_ISA", wanted)
        assert kernels.isa() == isa, wanted
    assert "-mavx512bf16" in kernels.flags(kernels.NATIVE)
    emulated = kernels.flags(kernels.EMULATED)
    assert "-mavx512bf16" not in emulated and "-DEMULATE_BF16" in emulated
    avx2 = kernels.flags(kernels.AVX2)
    assert not [f for f in avx2 if f.startswith("-mavx512")] and "-DAVX2_512" in avx2


def disassembly(isa: int) -> str:
    build(isa)
    path = library_path(kernels.SOURCE, kernels.flags(isa), kernels.HEADERS)
    return subprocess.run(
        ["objdump", "-d", "--no-show-raw-insn", str(path)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout


def test_the_avx2_build_holds_no_avx512_instruction():
    """objdump of the AVX2 library: no zmm register, no mask register, none of the 16 vector
    registers only EVEX reaches (the AMX tile functions' instructions run only where the native
    build serves), and no bf16 instruction; the emulated build does hold zmm registers."""
    text = disassembly(kernels.AVX2)
    assert "hm_gemm_bf16" in text and "vfmadd" in text and "ymm" in text
    assert not re.search(r"%zmm|%k[0-7]|%[xy]mm(1[6-9]|2[0-9]|3[01])\b", text)
    assert not re.search(r"\bv(dpbf16ps|cvtneps2bf16|cvtne2ps2bf16)\b", text)
    if kernels.best_isa() >= kernels.EMULATED:  # the test can fail: the AVX-512 builds hold them
        assert re.search(r"%zmm", disassembly(kernels.EMULATED))


@needs_avx512
def test_the_emulated_build_holds_no_bf16_instruction():
    """objdump of the emulated library: no vdpbf16ps, vcvtneps2bf16 or vcvtne2ps2bf16 (the AMX
    tile functions' tdpbf16ps runs only on AMX CPUs, which the native build serves)."""
    build(kernels.EMULATED)
    path = library_path(kernels.SOURCE, kernels.flags(kernels.EMULATED), kernels.HEADERS)
    text = subprocess.run(
        ["objdump", "-d", "--no-show-raw-insn", str(path)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "hm_gemm_bf16" in text and "vfmadd" in text  # the disassembly is there
    assert not re.search(r"\bv(dpbf16ps|cvtneps2bf16|cvtne2ps2bf16)\b", text)
    native = library_path(kernels.SOURCE, kernels.flags(kernels.NATIVE), kernels.HEADERS)
    if native.exists():  # the test can fail: the native build does hold them
        text = subprocess.run(["objdump", "-d", str(native)], capture_output=True, text=True).stdout
        assert re.search(r"\bvdpbf16ps\b", text) and re.search(r"\bvcvtneps2bf16\b", text)


def values_of_every_kind(n: int, seed: int) -> np.ndarray:
    """fp32 bit patterns: arbitrary bits, zeros and subnormals of both signs, the smallest and
    largest normals, infinities, quiet and signalling NaNs, and rounding ties (low half 0x8000)."""
    rng = np.random.default_rng(seed)
    bits = rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)
    special = [0, 0x80000000, 1, 0x807FFFFF, 0x007FFFFF, 0x00800000, 0x80800000, 0x7F7FFFFF]
    special += [0x7F7F8000, 0x7F7F7FFF, 0x7F800000, 0xFF800000, 0x7F800001, 0x7FC00000, 0xFFFFFFFF]
    special += [0x3F808000, 0x3F818000, 0x3F80FFFF, 0x00808000, 0x0080FFFF, 0x7FBFFFFF]
    ties = (bits & 0xFFFF0000) | 0x8000
    tiny = bits & 0x80FFFFFF  # exponents 0 and 1: subnormals and the smallest normals
    return np.concatenate([np.array(special, dtype=np.uint32), bits, ties, tiny])


def intels_rounding(bits: np.ndarray) -> np.ndarray:
    """convert_fp32_to_bfloat16 of Intel's manual (VCVTNEPS2BF16): zero and subnormal values to
    a zero of their sign, NaN to its upper half with the quiet bit set, else to nearest even."""
    mag, hi = bits & 0x7FFFFFFF, bits >> 16
    rounded = (bits.astype(np.uint64) + 0x7FFF + (hi & 1)) >> 16
    out = np.where(mag > 0x7F800000, hi | 0x40, rounded.astype(np.uint32))
    out = np.where(mag < 0x00800000, hi & 0x8000, out)
    return out.astype(np.uint16)


@needs_avx512
@pytest.mark.parametrize("isa", runnable_builds())
def test_the_rounding_is_intels_definition(isa):
    bits = values_of_every_kind(100_003, seed=isa)
    x = torch.from_numpy(bits.view(np.float32).copy())
    out = torch.empty(len(bits), dtype=torch.int16)
    build(isa).hm_round_bf16(x.data_ptr(), len(bits), out.data_ptr())
    assert np.array_equal(out.numpy().view(np.uint16), intels_rounding(bits))


# bf16 exponent fields of each kind of value: tiny (subnormal ones among them) against a partner
# that puts products and sums about fp32's smallest normal, where DAZ and FTZ decide; huge, whose
# products pass fp32's largest; arbitrary bits (NaN and inf among them) as (0, 255)
EXPONENTS = {
    "tiny": ((0, 11), (115, 134)),
    "huge": ((190, 253), (190, 253)),
    "arbitrary": ((0, 255), (0, 255)),
}


def operands(kind: str, w_shape, x_shape, gen):
    """Weights and x rows of one kind: ordinary N(0, 1) values, or the exponents of EXPONENTS."""
    if kind == "ordinary":
        return (torch.randn(*s, generator=gen).to(torch.bfloat16) for s in (w_shape, x_shape))
    (w_lo, w_hi), (x_lo, x_hi) = EXPONENTS[kind]
    w = bf16_with_exponents(w_shape, w_lo, w_hi, gen)
    return w, bf16_with_exponents(x_shape, x_lo, x_hi, gen)


@needs_bf16
@pytest.mark.parametrize("kind", ["ordinary", *EXPONENTS])
def test_the_emulated_products_are_vdpbf16ps_bit_for_bit(kind):
    """hm_gemm_bf16 at 1 row (vdpbf16ps or its emulation), 3 and 9 (the fma pairs, or vdpbf16ps with
    them off), 20 and 70 (widened operands), one and two threads, against the native build."""
    native, emulated, avx2 = (build(i) for i in (kernels.NATIVE, kernels.EMULATED, kernels.AVX2))
    assert native.hm_fma_pairs_check() == 1 and emulated.hm_fma_pairs_check() == 1
    assert avx2.hm_fma_pairs_check() == 1
    gen = torch.Generator().manual_seed(len(kind))
    for n, k in [(37, 100), (8, 64), (5, 31)]:
        w, x70 = operands(kind, (n, k), (70, k), gen)
        for rows in (1, 3, 9, 20, 70):
            x = x70[:rows]
            outs = []
            for lib, pairs, threads in [
                (native, 0, 1), (native, 1, 1), (emulated, 0, 1), (emulated, 1, 1),
                (emulated, 1, 2), (avx2, 0, 1), (avx2, 1, 1), (avx2, 1, 2),
            ]:  # fmt: skip
                lib.hm_set_fma_pairs(pairs)
                y = torch.full((rows, n), 7.0)
                args = (w.data_ptr(), x.data_ptr(), k, y.data_ptr(), n, n, k, rows)
                lib.hm_gemm_bf16_mt(*args, threads) if threads > 1 else lib.hm_gemm_bf16(*args)
                outs.append(y)
            native.hm_set_fma_pairs(1)
            for y in outs[1:]:
                assert same_bits(outs[0], y), (kind, n, k, rows)
    if kind == "ordinary":  # and the bits are a product's
        ref = x.double() @ w.double().t()
        assert torch.allclose(outs[0].double(), ref, rtol=1e-4, atol=1e-4)


def whole_run(path: Path, isa: str) -> dict:
    env = dict(os.environ, HYBRIDMOE_BF16_ISA=isa, HYBRIDMOE_AMX="0")  # AMX scores round otherwise
    run = subprocess.run(
        [sys.executable, "-m", "tests.bf16_isa_run", str(path)],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@needs_bf16
@pytest.mark.parametrize("arch", ["qwen2_moe", "mixtral"])
def test_a_whole_run_on_the_emulated_builds_gives_the_native_bits(arch, tmp_path):
    """Six prompts of 1 to 70 tokens through the engine, batch invariance on and off, in processes
    of their own: the same bits in every logits row and the same tokens on the AVX512F and the AVX2
    builds; torch's path (off) gives other bits, so the digest tells paths apart."""
    build_tiny(arch, tmp_path / arch)
    native, emulated, avx2, off = (
        whole_run(tmp_path / arch, i) for i in ("avx512bf16", "avx512f", "avx2", "off")
    )
    assert (native["isa"], emulated["isa"], avx2["isa"], off["isa"]) == (3, 2, 1, 0)
    assert native["rows"] == emulated["rows"] == avx2["rows"] == 120
    for run in (emulated, avx2):
        assert run["digest"] == native["digest"] and run["tokens"] == native["tokens"]
    assert off["digest"] != native["digest"]


@needs_avx512
@pytest.mark.parametrize("kind", ["ordinary", *EXPONENTS])
def test_the_avx2_build_gives_the_avx512f_builds_bits(kind, tmp_path):
    """The AVX2 build against the AVX512F one, which any AVX-512 CPU runs (where the CPU has
    AVX512-BF16 the tests above hold both to the native build): products of every kind of value at
    1, 3, 9, 20 and 70 rows, one and two threads, and for ordinary values a whole run."""
    emulated, avx2 = build(kernels.EMULATED), build(kernels.AVX2)
    gen = torch.Generator().manual_seed(100 + len(kind))
    for n, k in [(37, 100), (8, 64), (5, 31)]:
        w, x70 = operands(kind, (n, k), (70, k), gen)
        for rows in (1, 3, 9, 20, 70):
            x = x70[:rows]
            outs = []
            for lib, threads in [(emulated, 1), (avx2, 1), (avx2, 2)]:
                y = torch.full((rows, n), 7.0)
                args = (w.data_ptr(), x.data_ptr(), k, y.data_ptr(), n, n, k, rows)
                lib.hm_gemm_bf16_mt(*args, threads) if threads > 1 else lib.hm_gemm_bf16(*args)
                outs.append(y)
            for y in outs[1:]:
                assert same_bits(outs[0], y), (kind, n, k, rows)
    if kind == "ordinary":
        build_tiny("qwen2_moe", tmp_path / "m")
        runs = [whole_run(tmp_path / "m", isa) for isa in ("avx512f", "avx2")]
        assert (runs[0]["isa"], runs[1]["isa"]) == (kernels.EMULATED, kernels.AVX2)
        assert runs[0]["digest"] == runs[1]["digest"] and runs[0]["tokens"] == runs[1]["tokens"]


@needs_avx512
@pytest.mark.parametrize("heads, kv_heads, d, dv", LAYOUTS)
def test_every_builds_decode_attention_gives_the_same_bits(heads, kv_heads, d, dv):
    """hm_decode_attention_bf16 of every build this CPU runs (the AVX2 build's values summed 16
    columns at a time, the AVX-512 builds' 64) on histories of 1 to 1100 positions in shuffled
    blocks, fp32 and bf16 out, one and two threads: the same bits (off the AMX tiles, which a
    library built here leaves off), and the float64 softmax attention's values."""
    libs = [build(isa) for isa in runnable_builds()]
    gen = torch.Generator().manual_seed(heads * 1000 + d)
    q, k_pool, v_pool, tables = paged_batch(heads, kv_heads, d, dv, 16, gen)
    starts = np.cumsum([0] + [len(t) for t in tables[:-1]]).astype(np.int32)
    flat = torch.tensor([b for t in tables for b in t], dtype=torch.int32)
    starts, lengths = torch.from_numpy(starts), torch.tensor(LENGTHS, dtype=torch.int32)
    rows = torch.arange(1, 2 * len(LENGTHS), 2, dtype=torch.int32)
    for out_bf16 in (0, 1):
        outs = []
        for lib, threads in [(lib, t) for lib in libs for t in (1, 2)]:
            out = torch.full((len(q), heads, dv), 7.0, dtype=torch.bfloat16 if out_bf16 else None)
            status = lib.hm_decode_attention_bf16(
                q.data_ptr(), heads * d, k_pool.data_ptr(), kv_heads * d, v_pool.data_ptr(),
                kv_heads * dv, flat.data_ptr(), starts.data_ptr(), lengths.data_ptr(),
                rows.data_ptr(), len(LENGTHS), 16, heads, kv_heads, d, dv, d**-0.5,
                out.data_ptr(), heads * dv, out_bf16, threads,
            )  # fmt: skip
            assert status == 0
            outs.append(out)
        for out in outs[1:]:
            bits = (outs[0].view(torch.int16), out.view(torch.int16))
            assert torch.equal(*bits) if out_bf16 else same_bits(outs[0], out)
    s = len(LENGTHS) - 1  # the longest history, against float64
    k, v = (history(pool, tables[s], LENGTHS[s], 16) for pool in (k_pool, v_pool))
    want = reference(q[2 * s + 1], k, v, d**-0.5)
    assert (outs[0][2 * s + 1].double() - want).abs().max() < 1e-2  # bf16 out


def test_dtype_auto_is_bf16_wherever_the_bf16_kernels_run(monkeypatch):
    """--dtype auto: bf16 with bf16 in hardware, or with the kernels (emulated where the CPU lacks
    AVX512-BF16); fp32 where torch alone would run bf16."""
    from hybridmoe import native
    from hybridmoe.cli.options import compute_dtype

    for hardware, kernels_run, want in [
        (True, True, torch.bfloat16),
        (False, True, torch.bfloat16),  # Cascade Lake: the emulated build
        (True, False, torch.bfloat16),  # no compiler: oneDNN's bf16
        (False, False, torch.float32),
    ]:
        monkeypatch.setattr(native, "cpu_has_native_bf16", lambda h=hardware: h)
        monkeypatch.setattr(native, "available", lambda k=kernels_run: k)
        assert compute_dtype("auto") == want, (hardware, kernels_run)
        assert compute_dtype("float32") == torch.float32
