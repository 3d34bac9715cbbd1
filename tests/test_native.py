"""The native bf16 kernels against references computed in float64 by torch, and their fallbacks."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from hybridmoe import invariance, native
from hybridmoe.experts.run.ffn import (
    combine_grouped,
    combine_token,
    expert_ffn,
    experts_ffn,
    group_by_expert,
)
from hybridmoe.experts.run.store import ExpertWeights
from hybridmoe.layers.linear import THREADED_NATIVE_ROWS, linear
from tests.bf16_bits import bf16_with_exponents, same_bits

needs_kernels = pytest.mark.skipif(
    not native.cpu_runs_kernels(), reason="needs a CPU with AVX2 and FMA"
)


def bf16(*shape, gen):
    return torch.randn(*shape, generator=gen).to(torch.bfloat16)


def assert_close_to_float64(got, w, x):
    """got: [M, N] fp32 against x @ w^T in float64; bf16 products are exact,
    only the fp32 sums round."""
    ref = x.double() @ w.double().t()  # [M, N]
    scale = (
        x.double().abs() @ w.double().abs().t()
    )  # [M, N]: the bound the fp32 sums' rounding scales with
    assert got.dtype == torch.float32 and got.shape == ref.shape
    assert torch.all((got.double() - ref).abs() <= 1e-6 * scale + 1e-30)


# Odd shapes exercise the masked tail of a row and the weight rows left after blocks of four; every
# row count the x rows left after blocks of four. The large shape at a few row counts.
GEMM_CASES = [
    (rows, cols, m)
    for rows, cols in [(7, 100), (4, 32), (5, 31), (3, 1), (6, 48)]
    for m in range(1, native.MAX_ROWS + 1)
] + [(1536, 2048, m) for m in (1, 3, 4, 5, 8, 16, native.MAX_ROWS)]


@needs_kernels
@pytest.mark.parametrize("rows, cols, m", GEMM_CASES)
def test_gemm_matches_a_float64_product(rows, cols, m):
    gen = torch.Generator().manual_seed(rows * 1000 + cols + m)
    w, x = bf16(rows, cols, gen=gen), bf16(m, cols, gen=gen)
    assert_close_to_float64(native.gemm(x, w), w, x)


@needs_kernels
def test_gemm_takes_strided_rows_and_leading_dimensions():
    gen = torch.Generator().manual_seed(3)
    w, x = bf16(37, 70, gen=gen), bf16(2, 5, 140, gen=gen)
    rows = x[:, :, ::2]  # [2, 5, 70], every other column: not unit stride
    assert_close_to_float64(native.gemm(rows, w), w, rows.reshape(10, 70))
    picked = x.view(10, 140)[::3, :70]  # [4, 70], rows 140 apart
    assert_close_to_float64(native.gemm(picked, w), w, picked)


@needs_kernels
def test_a_rows_result_does_not_depend_on_the_rows_beside_it():
    """Every count of rows, past one panel of x rows (bf16.c PANEL, 64) too."""
    gen = torch.Generator().manual_seed(4)
    w, x = bf16(9, 200, gen=gen), bf16(130, 200, gen=gen)
    alone = torch.cat([native.gemm(x[i : i + 1], w) for i in range(len(x))])  # [M, 9]
    for m in [*range(2, native.MAX_ROWS + 1), 63, 64, 65, 127, 130]:
        assert torch.equal(native.gemm(x[:m], w), alone[:m])


@needs_kernels
@pytest.mark.parametrize(
    "kind, w_exp, x_exp",
    [
        ("wide", (0, 190), (0, 190)),
        ("near the subnormals", (0, 12), (110, 135)),  # products and sums around 2^-126
        ("overflowing", (200, 254), (150, 190)),  # sums past the largest float
    ],
)
def test_a_rows_bits_do_not_depend_on_the_rows_beside_it_for_any_bf16_values(kind, w_exp, x_exp):
    """One x row takes vdpbf16ps, several take two fma a pair with MXCSR's DAZ and FTZ (bf16.c
    PAIRS): the same bits for every kind of bf16 value, subnormal inputs, products and sums below
    the normal range and sums that overflow included (NaN where both give NaN)."""
    gen = torch.Generator().manual_seed(len(kind))
    signed = kind != "overflowing"  # else +inf and -inf would make every sum NaN
    w = bf16_with_exponents((9, 100), *w_exp, gen=gen, signed=signed)
    x = bf16_with_exponents((native.MAX_ROWS, 100), *x_exp, gen=gen, signed=signed)
    alone = torch.cat([native.gemm(x[i : i + 1], w) for i in range(len(x))])  # [M, 9]
    if kind == "overflowing":
        assert alone.isinf().any()
    else:
        assert (alone.isfinite() & (alone != 0)).any()
    for m in range(2, native.MAX_ROWS + 1):
        got, want = native.gemm(x[:m], w), alone[:m]
        assert same_bits(got, want), m


@needs_kernels
@pytest.mark.parametrize(
    "kind, w_exp, x_exp",
    [("wide", (0, 190), (0, 190)), ("near the subnormals", (0, 12), (110, 135))],
)
def test_several_rows_give_the_same_bits_on_fma_pairs_and_on_vdpbf16ps(kind, w_exp, x_exp):
    """Products of several rows take fma pairs where the library's check at load found them giving
    this CPU's vdpbf16ps bits, else vdpbf16ps (bf16.c hm_fma_pairs_check): both paths, in registers
    (8 rows) and widened (70 rows), give the same bits."""
    from hybridmoe.native import bf16 as kernels

    gen = torch.Generator().manual_seed(len(kind) + 7)
    w = bf16_with_exponents((9, 100), *w_exp, gen=gen)
    x = bf16_with_exponents((70, 100), *x_exp, gen=gen)
    before = kernels.fma_pairs_active()  # the default: on where they pass and pay (bf16.py)
    try:
        on = kernels.use_fma_pairs(True)
        pairs = [native.gemm(x[:m], w) for m in (8, 70)]
        assert not kernels.use_fma_pairs(False)
        plain = [native.gemm(x[:m], w) for m in (8, 70)]
    finally:
        kernels.use_fma_pairs(before)
    assert on == kernels._FMA_PAIRS[0]
    for got, want in zip(pairs, plain):
        assert same_bits(got, want)


def swiglu_reference(x, gate_up, down):
    """[M, H] in float64 with the kernel's one bf16 rounding of silu(g) * u."""
    g, u = (x.double() @ gate_up.double().t()).chunk(2, dim=-1)  # [M, I] each
    h = (F.silu(g) * u).to(
        torch.bfloat16
    )  # [M, I]: the kernel rounds its down projection's input once
    return h.double() @ down.double().t()  # [M, H]


@needs_kernels
@pytest.mark.parametrize("m", [1, 2, 3, 4, 7, 8, 16, native.MAX_ROWS])
@pytest.mark.parametrize("hidden, inter", [(256, 96), (100, 48), (64, 5)])
def test_expert_matches_swiglu_with_one_bf16_rounding(m, hidden, inter):
    gen = torch.Generator().manual_seed(m * 7 + hidden + inter)
    gate_up, down, x = (
        bf16(2 * inter, hidden, gen=gen) / 8,
        bf16(hidden, inter, gen=gen) / 8,
        bf16(m, hidden, gen=gen),
    )
    ref = swiglu_reference(x, gate_up, down)
    got = native.expert(x, gate_up, down)
    assert got.dtype == torch.float32 and got.shape == (m, hidden)
    # A few entries of h may round the other way (g, u differ from float64 by fp32 rounding):
    # a loose bound.
    assert torch.allclose(got.double(), ref, rtol=0, atol=1e-2 * ref.abs().max().item())
    # ... and it is much closer than torch's own bf16 path is to the same reference
    gate, up = (x @ gate_up.t()).chunk(2, dim=-1)
    torch_path = F.linear(F.silu(gate) * up, down)
    assert (got.double() - ref).norm() <= (torch_path.double() - ref).norm()
    # each token as if it came alone
    assert torch.equal(got[-1:], native.expert(x[-1:], gate_up, down))


@needs_kernels
@pytest.mark.parametrize("workers", [2, 3])
@pytest.mark.parametrize(
    "rows, cols, m",
    [(1536, 2048, 1), (1536, 576, 5), (49, 100, 3), (3, 1, 1), (1537, 576, 70), (202, 100, 16)],
)
def test_gemm_on_threads_gives_one_threads_bits(rows, cols, m, workers):
    gen = torch.Generator().manual_seed(rows + cols + m)
    w, x = bf16(rows, cols, gen=gen), bf16(m, cols, gen=gen)
    assert torch.equal(native.gemm(x, w, workers=workers), native.gemm(x, w, workers=1))


@needs_kernels
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(
    "rows, cols, m", [(1536, 576, 1), (1537, 100, 5), (3, 1, 2), (1537, 100, 70)]
)
def test_linear_in_one_call_is_the_fp32_product_plus_bias_rounded_once(rows, cols, m, threads):
    """native.linear (bias added and rounded in C, on the pool's threads for a large weight) gives
    the bits of gemm's fp32 product + the bias in fp32, rounded by torch."""
    gen = torch.Generator().manual_seed(rows + m)
    w, b, x = bf16(rows, cols, gen=gen), bf16(rows, gen=gen), bf16(m, cols, gen=gen)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got, plain = native.linear(x, w, b), native.linear(x, w)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(got, (native.gemm(x, w) + b.float()).to(torch.bfloat16))
    assert torch.equal(plain, native.gemm(x, w).to(torch.bfloat16))


@needs_kernels
@pytest.mark.parametrize("workers", [1, 2, 3])
@pytest.mark.parametrize("hidden, inter", [(576, 48), (100, 96), (64, 5)])
def test_a_layers_experts_in_one_call_equal_each_expert_alone(hidden, inter, workers):
    """native.experts splits every expert's rows over the threads; each expert's output must be
    expert()'s, bit for bit, whether its tokens are shared with other experts or not."""
    gen = torch.Generator().manual_seed(hidden + inter)
    shared = bf16(1, hidden, gen=gen)
    xs = [shared, shared, bf16(3, hidden, gen=gen), bf16(native.MAX_ROWS, hidden, gen=gen)]
    weights = [
        (bf16(2 * inter, hidden, gen=gen) * 0.1, bf16(hidden, inter, gen=gen) * 0.1) for _ in xs
    ]
    got = native.experts(xs, weights, workers)
    for x, (gate_up, down), y in zip(xs, weights, got):
        assert torch.equal(y, native.expert(x, gate_up, down))


@needs_kernels
@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("hidden, inter, k", [(576, 48, 8), (100, 96, 3), (64, 5, 1)])
def test_a_tokens_experts_and_their_mix_in_one_call_equal_experts_then_combine(
    hidden, inter, k, workers
):
    """moe_tokens of one token (the router's ids and weights as they come, experts sorted and
    mixed in C) gives the bits of experts_ffn followed by combine_token, the path it replaces for
    a decode token."""
    gen = torch.Generator().manual_seed(hidden + k)
    x = bf16(1, hidden, gen=gen)
    ids = torch.randperm(16, generator=gen)[:k][None]  # [1, K] distinct experts, top-k order
    weights = torch.rand(1, k, generator=gen)  # [1, K] fp32
    store = [
        ExpertWeights(bf16(2 * inter, hidden, gen=gen) * 0.1, bf16(hidden, inter, gen=gen) * 0.1)
        for _ in range(16)
    ]
    ys = experts_ffn([(x, store[e]) for e in ids[0].tolist()], workers)  # [1, H] each
    ref = combine_token(x, ys, weights, ids)
    table = torch.tensor([[w.gate_up.data_ptr(), w.down.data_ptr()] for w in store])  # [E, 2]
    got = native.moe_tokens(table, ids, weights, x, inter, workers)
    assert got.dtype == torch.bfloat16 and torch.equal(got, ref)


@needs_kernels
@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize(
    "tokens, hidden, inter, k", [(2, 576, 48, 8), (70, 576, 48, 8), (33, 100, 70, 3), (9, 64, 5, 1)]
)
def test_a_chunks_experts_and_their_mixes_in_one_call_equal_experts_then_combine(
    tokens, hidden, inter, k, workers
):
    """moe_tokens (a prefill chunk's rows computed as if alone: grouped by expert, gathered, run
    and mixed in C) gives the bits of experts_ffn on each expert's rows followed by
    combine_grouped, the path it replaces; an expert id outside the table is refused."""
    gen = torch.Generator().manual_seed(tokens + hidden + k)
    x = bf16(tokens, hidden, gen=gen)
    ids = torch.stack([torch.randperm(16, generator=gen)[:k] for _ in range(tokens)])  # [T, K]
    weights = torch.rand(tokens, k, generator=gen)  # [T, K] fp32
    store = [
        ExpertWeights(bf16(2 * inter, hidden, gen=gen) * 0.1, bf16(hidden, inter, gen=gen) * 0.1)
        for _ in range(16)
    ]
    with invariance.rows_alone():
        groups = group_by_expert(ids)
        ys = experts_ffn([(x[rows], store[e]) for e, rows, _ in groups], workers)
        ref = combine_grouped(x, groups, ys, weights)  # [T, H]
    table = torch.tensor([[w.gate_up.data_ptr(), w.down.data_ptr()] for w in store])  # [E, 2]
    got = native.moe_tokens(table, ids, weights, x, inter, workers)
    assert got.dtype == torch.bfloat16 and torch.equal(got, ref)
    with pytest.raises(ValueError, match="outside"):
        native.moe_tokens(table[:-1], torch.full_like(ids, 15), weights, x, inter, workers)


@needs_kernels
def test_an_experts_silu_holds_for_gates_far_past_exps_range():
    """h = bf16(silu(g) u) (bf16.c silu_mul_row, e^-g 16 at a time) for gates from -200 to 200,
    where e^-g leaves fp32's range both ways, and for zero and tiny ones: within one bf16 rounding
    of float64 (or below fp32's smallest normal where the exact value is), and 0 where e^-g is
    past fp32's range. The down projection is the identity, so y is h."""
    gates = [-200, -104, -90, -88, -50, -20, -1, -1e-30, 0, 1e-30, 0.5, 1, 20, 88, 90, 104, 200]
    inter, hidden = len(gates), 32  # 17: the row's tail past 16
    g = torch.tensor(gates, dtype=torch.float64).to(torch.bfloat16)
    u = torch.linspace(-3, 3, inter).to(torch.bfloat16)
    gate_up = torch.zeros(2 * inter, hidden, dtype=torch.bfloat16)
    gate_up[:inter, 0], gate_up[inter:, 0] = g, u
    down = torch.eye(hidden, inter, dtype=torch.bfloat16)  # [H, I]
    x = torch.zeros(1, hidden, dtype=torch.bfloat16)
    x[0, 0] = 1
    h = native.expert(x, gate_up, down)[0, :inter].double()
    g64, u64 = g.double(), u.double()
    ref = g64 * torch.sigmoid(g64) * u64
    # below -88.7 e^-g is past fp32's largest (as libm's expf is): silu 0, where the exact value
    # is under 1e-36
    far = g64 < -88.72
    assert torch.all(h[far] == 0) and torch.all(ref[far].abs() < 1e-36)
    near = ~far
    assert torch.all((h - ref)[near].abs() <= 2**-8 * ref[near].abs() + 1.2e-38), (h, ref)


@pytest.fixture
def torch_only(monkeypatch):
    """Within the test, the native path switched off as HYBRIDMOE_NATIVE=0 does (available()
    False)."""

    def run(fn, *args):
        with monkeypatch.context() as m:
            m.setattr(native.bf16, "available", lambda: False)
            return fn(*args)

    return run


@needs_kernels
@pytest.mark.parametrize("m", [1, 2, 5, 8, 16, native.MAX_ROWS])
def test_linear_takes_the_kernel_for_a_few_bf16_rows(m, torch_only):
    gen = torch.Generator().manual_seed(2 + m)
    w, b, x = bf16(67, 130, gen=gen), bf16(67, gen=gen), bf16(m, 130, gen=gen)
    with torch.inference_mode():
        got = linear(x, w, b)
        off = torch_only(linear, x, w, b)
    ref = (native.gemm(x, w) + b.float()).to(torch.bfloat16)  # [M, 67]
    assert got.dtype == torch.bfloat16 and got.shape == (m, 67) and torch.equal(got, ref)
    # within one bf16 rounding of torch's path
    assert torch.equal(off, F.linear(x, w, b))
    assert torch.allclose(got.float(), off.float(), rtol=2**-7, atol=1e-2)
    # leading dimensions are kept
    assert torch.equal(linear(x.view(1, m, 130), w, b), got.view(1, m, 67))


@pytest.fixture
def bf16_in_hardware(monkeypatch):
    """A CPU that multiplies bf16 in hardware, whatever this one does: there oneDNN takes bf16
    products of more rows than decode's (native.kernels_beat_onednn)."""
    monkeypatch.setattr(native, "kernels_beat_onednn", lambda: False)


def test_linear_leaves_more_rows_and_other_dtypes_to_torch(bf16_in_hardware):
    gen = torch.Generator().manual_seed(5)
    w, x = bf16(64, 128, gen=gen), bf16(native.MAX_ROWS + 1, 128, gen=gen)
    assert torch.equal(linear(x, w), F.linear(x, w))
    assert torch.equal(linear(x[:3].float(), w.float()), F.linear(x[:3].float(), w.float()))


@needs_kernels
def test_linear_with_more_threads_keeps_onednn_above_its_threshold(monkeypatch, bf16_in_hardware):
    gen = torch.Generator().manual_seed(6)
    w = bf16(64, 128, gen=gen)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    few, more = (
        bf16(THREADED_NATIVE_ROWS, 128, gen=gen),
        bf16(THREADED_NATIVE_ROWS + 1, 128, gen=gen),
    )
    with torch.inference_mode():
        assert torch.equal(linear(few, w), native.gemm(few, w).to(torch.bfloat16))
        assert torch.equal(linear(more, w), F.linear(more, w))


@needs_kernels
@pytest.mark.parametrize("m", [1, 3, 8, native.MAX_ROWS])
def test_expert_ffn_takes_the_kernel_for_a_few_bf16_tokens(m, torch_only, bf16_in_hardware):
    gen = torch.Generator().manual_seed(10 + m)
    weights = ExpertWeights(bf16(2 * 48, 130, gen=gen) / 8, bf16(130, 48, gen=gen) / 8)
    x = bf16(m, 130, gen=gen)
    y = expert_ffn(x, weights)
    assert y.dtype == torch.bfloat16 and y.shape == (m, 130)
    assert torch.equal(y, native.expert(x, weights.gate_up, weights.down).to(torch.bfloat16))
    # torch's path rounds gate and up to bf16 too: the two agree to a few bf16 roundings
    off = torch_only(expert_ffn, x, weights)
    assert torch.allclose(y.float(), off.float(), rtol=2**-6, atol=2e-2 * off.abs().max().item())
    # more tokens stay on torch's path
    many = bf16(native.MAX_ROWS + 1, 130, gen=gen)
    assert torch.equal(expert_ffn(many, weights), torch_only(expert_ffn, many, weights))


@needs_kernels
@pytest.mark.parametrize("threads", [1, 2])
def test_without_bf16_in_hardware_the_kernels_take_every_row_count(monkeypatch, threads):
    """Where oneDNN emulates bf16 (no AVX512-BF16 or AMX), products and experts of any row count
    go to the kernels, with the bits of the kernels' own calls."""
    monkeypatch.setattr(native, "kernels_beat_onednn", lambda: True)
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    gen = torch.Generator().manual_seed(12)
    w, x = bf16(64, 128, gen=gen), bf16(70, 128, gen=gen)
    weights = ExpertWeights(bf16(2 * 48, 130, gen=gen) / 8, bf16(130, 48, gen=gen) / 8)
    xe = bf16(native.MAX_ROWS + 9, 130, gen=gen)
    with torch.inference_mode():
        assert torch.equal(linear(x, w), native.gemm(x, w).to(torch.bfloat16))
        assert not torch.equal(linear(x, w), F.linear(x, w))  # oneDNN's sums differ
        y = expert_ffn(xe, weights)
        assert torch.equal(y, native.expert(xe, weights.gate_up, weights.down).to(torch.bfloat16))


def _available_in_subprocess(env: dict) -> str:
    code = "from hybridmoe import native; print(native.available())"
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.strip()


def test_switched_off_or_without_a_compiler_torch_keeps_the_work(tmp_path):
    assert _available_in_subprocess({"HYBRIDMOE_NATIVE": "0"}) == "False"
    # a fresh cache and no compiler: nothing to load, no error,
    # and no half-written library left behind
    assert (
        _available_in_subprocess({"XDG_CACHE_HOME": str(tmp_path), "CC": "/nonexistent/cc"})
        == "False"
    )
    assert not list((tmp_path / "hybridmoe" / "native").glob("*.so"))


@needs_kernels
def test_the_library_is_built_once_into_the_cache(tmp_path):
    assert _available_in_subprocess({"XDG_CACHE_HOME": str(tmp_path)}) == "True"
    built = list((tmp_path / "hybridmoe" / "native").iterdir())
    assert len(built) == 1 and built[0].suffix == ".so"
    stamp = built[0].stat().st_mtime_ns
    assert _available_in_subprocess({"XDG_CACHE_HOME": str(tmp_path)}) == "True"
    assert [p.stat().st_mtime_ns for p in (tmp_path / "hybridmoe" / "native").iterdir()] == [stamp]


@needs_kernels
def test_a_library_exposes_only_the_functions_it_types():
    """An untyped ctypes function takes every argument as a C int, cutting pointers: the loaded
    library must not offer one."""
    lib = native.bf16.library()
    assert callable(lib.hm_gemm_bf16)
    assert lib.hm_gemm_bf16.argtypes and len(lib.hm_gemm_bf16.argtypes) == 8
    with pytest.raises(AttributeError):
        getattr(lib, "hm_experts_mix_bf16")  # noqa: B009 (in the .so, not typed in bf16.py)


@needs_kernels
@pytest.mark.parametrize("nta,far", [(0, "_MM_HINT_T1"), (1, "_MM_HINT_T1"), (0, "_MM_HINT_NTA")])
def test_one_row_products_read_the_same_bits_however_the_weights_are_asked_for(nta, far):
    """bf16.c is built to ask for a one-row product's weights as non-temporal on AMD's Zen 4
    (WEIGHTS_NTA), into L1 and 4 KB ahead into L2 elsewhere, those 4 KB as non-temporal on Zen 5
    (FAR_HINT); each build gives the bits of a float64-checked product on every machine."""
    from hybridmoe.native import bf16 as kernels
    from hybridmoe.native.build import load

    flags = [
        f for f in kernels.flags(kernels.isa()) if not f.startswith(("-DWEIGHTS_NTA", "-DFAR_HINT"))
    ]
    flags += [f"-DWEIGHTS_NTA={nta}", f"-DFAR_HINT={far}"]
    other = load(kernels.SOURCE, flags, kernels.SIGNATURES, kernels.HEADERS)
    gen = torch.Generator().manual_seed(11 + nta)
    for rows, cols in [(4099, 2048), (7, 100), (1553, 576), (5, 31)]:
        w, x = bf16(rows, cols, gen=gen), bf16(1, cols, gen=gen)
        y = torch.empty(1, rows, dtype=torch.bfloat16)
        wp, xp, yp = w.data_ptr(), x.data_ptr(), y.data_ptr()
        other.hm_linear_bf16(wp, xp, cols, 0, yp, rows, rows, cols, 1, 1)  # one row, one thread
        assert torch.equal(y, kernels.linear(x, w))
        ref = x.double() @ w.double().t()  # [1, rows]
        bound = 2.0**-8 * ref.abs() + 1e-6 * (x.double().abs() @ w.double().abs().t())
        assert torch.all((y.double() - ref).abs() <= bound)  # one bf16 rounding of fp32 sums
