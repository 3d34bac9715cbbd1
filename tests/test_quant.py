"""Products with weights kept in GGUF blocks (native/quant.c), against gguf's own dequantiser and
float64 arithmetic.

The kernels quantise each activation row to int8 once, per block of 32 values (Q8_0, Q4_0, Q4_1) or
of 256 (the K-quants), rounding x / d to the nearest integer with d = max|x| / 127. Everything after
that is exact integer arithmetic and fp32 scaling, so the error has two parts, both checked:

- against the product of the weights with the *quantised* activations (xq * d, computed here the
  same way in float64), only fp32 rounding: relative error below 1e-5;
- against the product with the true activations, at most sum_i |w_i| * d_i / 2 per output (each
  activation moves by at most half its block's step d_i): this bound, computed per output from the
  data, is asserted exactly (plus fp32 rounding).

The AVX2 and AVX-512 paths give the same bits; the torch fallback (dequantise, multiply) is what
runs where neither does.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import quants

from hybridmoe.native import quant as kernels
from hybridmoe.quant.formats import FORMATS, INTERLEAVED
from hybridmoe.quant.tensor import QTensor, linear, linears, matmul

Q = gguf.GGMLQuantizationType
PATHS = kernels.paths()  # every path this CPU runs; each must give the others' bits


def random_blocks(fmt, rows: int, cols: int, rng) -> np.ndarray:
    """Valid blocks of any format: random bytes, with sane fp16 scales where the format keeps
    them."""
    raw = rng.integers(0, 256, size=(rows, cols // fmt.block, fmt.nbytes), dtype=np.uint8)
    scales = {
        "q8_0": [0],
        "q4_0": [0],
        "q4_1": [0, 2],
        "q4_k": [0, 2],
        "q5_k": [0, 2],
        "q6_k": [208],
    }
    for at in scales[fmt.name]:
        half = rng.uniform(-0.02, 0.02, size=raw.shape[:2]).astype(np.float16)
        raw[:, :, at : at + 2] = half.view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(rows, -1)


def quantised_activations(x: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """What the kernel multiplies by, in float64: x rounded per block (and each block's step d)."""
    rows, cols = x.shape
    b = x.reshape(rows, cols // block, block).astype(np.float64)
    amax = np.abs(x.reshape(rows, cols // block, block)).max(-1, keepdims=True).astype(np.float32)
    d = amax / np.float32(127)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    q = np.rint(x.reshape(rows, cols // block, block) * inv)  # the kernel's lrintf(v * id), in fp32
    return (q * d.astype(np.float64)).reshape(rows, cols), np.broadcast_to(d, b.shape).reshape(
        rows, cols
    )


@pytest.mark.parametrize("name", list(FORMATS))
@pytest.mark.parametrize("rows_x", [1, 3, 11, 70])  # 70: AVX-512's panels, past a chunk of 64
def test_every_format_matches_gguf_within_the_activation_bound(name, rows_x):
    fmt, rng = FORMATS[name], np.random.default_rng(hash((name, rows_x)) % 2**32)
    n, k = 37, 768  # 768: whole super-blocks of 256 and an odd count (24) of blocks of 32
    raw = random_blocks(fmt, n, k, rng)
    w = quants.dequantize(raw, Q(fmt.ggml)).astype(np.float64)  # [N, K]
    x = rng.standard_normal((rows_x, k)).astype(np.float32)
    ys = [
        kernels.linear(torch.from_numpy(x), fmt.ggml, torch.from_numpy(raw), k, path).numpy()
        for path in PATHS
    ]
    for y in ys[1:]:
        assert np.array_equal(y, ys[0]), "the AVX2 and AVX-512 paths differ"
    xq, step = quantised_activations(x, 256 if fmt.block == 256 else 32)
    exact_on_xq = xq @ w.T
    assert np.abs(ys[0] - exact_on_xq).max() <= 1e-5 * np.abs(exact_on_xq).max()
    bound = (np.abs(w)[None] * step[:, None, :] / 2).sum(-1)  # [M, N]
    assert (
        np.abs(ys[0] - x.astype(np.float64) @ w.T) <= bound + 1e-5 * np.abs(exact_on_xq).max()
    ).all()


def test_bf16_activations_are_the_same_values():
    fmt, rng = FORMATS["q4_k"], np.random.default_rng(5)
    raw = torch.from_numpy(random_blocks(fmt, 16, 512, rng))
    x = torch.randn(4, 512).to(torch.bfloat16)
    assert torch.equal(
        kernels.linear(x, fmt.ggml, raw, 512), kernels.linear(x.float(), fmt.ggml, raw, 512)
    )


# 96: an odd count of blocks of 32, which AVX-512's panels leave to the one-row kernel
@pytest.mark.parametrize(
    "name,k", [(n, 512) for n in FORMATS] + [(n, 96) for n in FORMATS if FORMATS[n].block == 32]
)
def test_a_rows_result_does_not_depend_on_its_batch(name, k):
    fmt, rng = FORMATS[name], np.random.default_rng(6)
    raw = torch.from_numpy(random_blocks(fmt, 39, k, rng))  # 39: panels of 4 rows and 3 left over
    x = torch.randn(70, k)
    for path in PATHS:
        batch = kernels.linear(x, fmt.ggml, raw, k, path)
        for i in (0, 7, 12, 63, 64, 69):
            assert torch.equal(
                batch[i : i + 1], kernels.linear(x[i : i + 1], fmt.ggml, raw, k, path)
            )
            assert torch.equal(
                batch[i : i + 9][:1], kernels.linear(x[i : i + 9], fmt.ggml, raw, k, path)[:1]
            )


@pytest.mark.parametrize("name", ["q8_0", "q4_0", "q4_k", "q6_k"])
def test_quantisers_write_blocks_that_decode_close_to_the_input(name):
    fmt = FORMATS[name]
    w = torch.randn(24, 512)
    q = QTensor.quantize(w, name)
    back = torch.from_numpy(
        quants.dequantize(q.data.numpy(), Q(fmt.ggml))
    )  # gguf decodes our blocks
    assert torch.equal(back, q.dequantize())
    step = {"q8_0": 1 / 127, "q4_0": 1 / 8, "q4_k": 1 / 15, "q6_k": 1 / 32}[name]
    # every value within one quantisation step of its block's range (plus the scales' rounding)
    assert (back - w).abs().mean() < step * w.abs().max() / 2
    if name in ("q8_0", "q4_0"):  # these two are quantised as gguf's reference quantiser does
        assert np.array_equal(q.data.numpy(), quants.quantize(w.numpy(), Q(fmt.ggml)))


def test_the_expert_is_the_two_products_with_silu_between():
    rng = np.random.default_rng(8)
    hidden, inter, m = 512, 256, 5
    gate_up = QTensor(
        torch.from_numpy(random_blocks(FORMATS["q4_k"], 2 * inter, hidden, rng)),
        FORMATS["q4_k"],
        hidden,
    )
    down = QTensor(
        torch.from_numpy(random_blocks(FORMATS["q6_k"], hidden, inter, rng)), FORMATS["q6_k"], inter
    )
    x = torch.randn(m, hidden)
    y = kernels.expert(x, gate_up, down)
    gate, up = kernels.linear(x, gate_up.fmt.ggml, gate_up.data, hidden).chunk(2, dim=-1)
    h = F.silu(gate) * up
    assert torch.allclose(
        y, kernels.linear(h, down.fmt.ggml, down.data, inter), rtol=1e-5, atol=1e-6
    )
    ref = F.linear(
        F.silu(x.double() @ gate_up.dequantize().double()[:inter].T)
        * (x.double() @ gate_up.dequantize().double()[inter:].T),
        down.dequantize().double(),
    )
    assert (y.double() - ref).abs().max() < 0.05 * ref.abs().max()  # two activation roundings


def random_expert(rng, hidden: int, inter: int, gu: str = "q4_k", dn: str = "q6_k"):
    gate_up = QTensor(
        torch.from_numpy(random_blocks(FORMATS[gu], 2 * inter, hidden, rng)), FORMATS[gu], hidden
    )
    down = QTensor(
        torch.from_numpy(random_blocks(FORMATS[dn], hidden, inter, rng)), FORMATS[dn], inter
    )
    return gate_up, down


@pytest.mark.parametrize("formats", [("q4_k", "q6_k"), ("q8_0", "q8_0"), ("q4_0", "q4_1")])
def test_a_layers_experts_in_one_call_equal_each_alone_on_any_thread_count(formats):
    rng = np.random.default_rng(10)
    hidden, inter = 512, 256
    weights = [random_expert(rng, hidden, inter, *formats) for _ in range(5)]
    token = torch.randn(1, hidden)
    # decode (one token shared by several experts) and a batch's uneven groups, bf16 and fp32
    xs = [token, token, torch.randn(11, hidden), torch.randn(2, hidden), token]
    alone = [kernels.expert(x, *w) for x, w in zip(xs, weights)]
    for path in PATHS:
        for workers in (1, 2, 3):
            together = kernels.experts(xs, weights, path=path, workers=workers)
            assert all(torch.equal(a, b) for a, b in zip(alone, together)), (path, workers)
    bf16 = [x.bfloat16() for x in xs]
    assert all(
        torch.equal(kernels.expert(x, *w), y)
        for x, w, y in zip(bf16, weights, kernels.experts(bf16, weights, workers=2))
    )


def test_threads_split_a_linear_without_changing_a_bit():
    fmt, rng = FORMATS["q4_k"], np.random.default_rng(11)
    raw = torch.from_numpy(random_blocks(fmt, 1000, 512, rng))  # many units of rows
    for m in (1, 9, 40):
        x = torch.randn(m, 512)
        one = kernels.linear(x, fmt.ggml, raw, 512, workers=1)
        for workers in (2, 4):
            assert torch.equal(one, kernels.linear(x, fmt.ggml, raw, 512, workers=workers))


def test_products_of_the_same_rows_in_one_call_equal_each_alone_on_any_thread_count():
    """A decode step's q, k and v in one call (hm_qlinear_many): the rows quantised once per kind
    of activations the formats read (Q4_K and Q5_K share theirs, Q6_K and each format of blocks of
    32 have their own), every product's units shared out together; each output is `linear`'s,
    bit for bit, on 1 to 3 threads, one token, a few, and a panel's worth."""
    rng, cols = np.random.default_rng(12), 512
    names = ["q4_k", "q6_k", "q4_k", "q8_0", "q4_0", "q4_1", "q5_k", "q8_0"]
    rows = [1000, 130, 60, 600, 70, 90, 300, 20]  # several units of rows, and a unit alone
    weights = [
        (FORMATS[n].ggml, torch.from_numpy(random_blocks(FORMATS[n], r, cols, rng)))
        for n, r in zip(names, rows)
    ]
    for m in (1, 3, 12):
        for x in (torch.randn(m, cols), torch.randn(m, cols).bfloat16()):
            alone = [kernels.linear(x, fmt, raw, cols, workers=1) for fmt, raw in weights]
            for path in PATHS:
                for workers in (1, 2, 3):
                    together = kernels.linears(x, weights, cols, path=path, workers=workers)
                    assert all(torch.equal(a, b) for a, b in zip(alone, together)), (m, path)


def test_an_attentions_projections_in_one_call_equal_each_alone():
    """quant/tensor.py linears (a prefill chunk's q, k and v): each output is `linear`'s, bit for
    bit, in x's dtype, with a bias and with a weight in two parts; with gradients recorded it takes
    each `linear` (differentiable)."""
    rng, cols = np.random.default_rng(13), 512
    made = [("q4_k", 96), ("q6_k", 32), ("q8_0", 40)]
    weights = [
        QTensor(torch.from_numpy(random_blocks(FORMATS[n], r, cols, rng)), FORMATS[n], cols)
        for n, r in made
    ]
    halves = weights[0].parts[0].split(48)  # the first weight again, as two parts
    weights.append(QTensor(list(halves), FORMATS["q4_k"], cols))
    biases = [None, torch.randn(32).bfloat16(), None, torch.randn(96)]
    for x in (torch.randn(70, cols).bfloat16(), torch.randn(2, 5, cols)):
        alone = [linear(x, w, b) for w, b in zip(weights, biases)]
        together = linears(x, weights, biases)
        assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(alone, together))
    x = torch.randn(9, cols, requires_grad=True)
    y = linears(x, weights[:2], biases[:2])
    sum(t.sum() for t in y).backward()
    assert x.grad is not None


def vnni_asm_flags(on: bool) -> list[str]:
    """The quant library's flags as an assembler that takes AVX-VNNI's forms (or not) builds it."""
    return [f for f in kernels.FLAGS if not f.startswith("-DAVXVNNI_ASM")] + [
        f"-DAVXVNNI_ASM={int(on)}"
    ]


def test_the_path_follows_the_cpu_and_the_switch(monkeypatch):
    """The widest path the CPU runs, or the widest at or below HYBRIDMOE_QUANT_ISA's: AVX-512 VNNI
    without AVX-VNNI (Zen 4, Ice Lake servers) leaves `avxvnni` on plain AVX2; AVX-VNNI without
    AVX-512 (Alder Lake and later client cores) takes it by default."""
    base = {"avx2", "fma", "f16c"}
    avx512 = {"avx512_vnni", "avx512bw", "avx512vl", "avx512dq"}
    cpus = {
        "zen4": (base | avx512, [kernels.AVX2, kernels.AVX512]),
        "zen5": (base | avx512 | {"avx_vnni"}, [kernels.AVX2, kernels.AVXVNNI, kernels.AVX512]),
        "alder lake": (base | {"avx_vnni"}, [kernels.AVX2, kernels.AVXVNNI]),
        "zen3": (base, [kernels.AVX2]),
        "no fma": ({"avx2", "f16c", "avx_vnni"}, []),
    }
    want = {  # (cpu, HYBRIDMOE_QUANT_ISA) -> path
        ("zen4", None): kernels.AVX512, ("zen4", "avxvnni"): kernels.AVX2,
        ("zen5", None): kernels.AVX512, ("zen5", "avxvnni"): kernels.AVXVNNI,
        ("zen5", "avx2"): kernels.AVX2, ("zen5", "off"): 0,
        ("alder lake", None): kernels.AVXVNNI, ("alder lake", "avx512"): kernels.AVXVNNI,
        ("alder lake", "avx2"): kernels.AVX2, ("zen3", None): kernels.AVX2,
        ("zen3", "avxvnni"): kernels.AVX2, ("no fma", None): 0,
    }  # fmt: skip
    monkeypatch.setattr(kernels, "FLAGS", vnni_asm_flags(True))  # an assembler that takes it
    for (cpu, switch), path in want.items():
        flags, runs = cpus[cpu]
        monkeypatch.setattr(kernels, "cpu_flags", lambda flags=flags: frozenset(flags))
        if switch is None:
            monkeypatch.delenv("HYBRIDMOE_QUANT_ISA", raising=False)
        else:
            monkeypatch.setenv("HYBRIDMOE_QUANT_ISA", switch)
        assert kernels.paths() == runs and kernels.isa() == path, (cpu, switch)
        assert kernels.best_isa() == (runs[-1] if runs else 0)


def test_the_assembler_probe_says_no_for_what_it_cannot_assemble(monkeypatch):
    """build.assembles: False for an instruction the assembler does not know and for a compiler
    that fails; the answer is cached per instruction, so each case asks anew."""
    from hybridmoe.native import build

    build.assembles.cache_clear()
    assert not build.assembles("vnosuchinstruction %%ymm0, %%ymm0")
    monkeypatch.setenv("CC", "false")  # found, and fails whatever it is asked
    build.assembles.cache_clear()
    assert not build.assembles(kernels.VNNI_ASM)
    build.assembles.cache_clear()


@pytest.mark.skipif(not kernels.available(), reason="needs the quant kernels (any x86-64 CPU)")
def test_without_an_assembler_for_avx_vnni_the_library_builds_and_leaves_its_path_out(monkeypatch):
    """An assembler that does not take AVX-VNNI's forms (binutils before 2.36): quant.c builds
    without them (AVXVNNI_ASM=0), its AVX2 path gives the bits of the library built with them,
    and the AVX-VNNI path is not offered."""
    from hybridmoe.native.build import load

    without = vnni_asm_flags(False)
    lib = load(kernels.SOURCE, without, kernels.SIGNATURES, kernels.HEADERS)
    assert lib is not None
    fmt, rng = FORMATS["q4_k"], np.random.default_rng(11)
    w = torch.from_numpy(random_blocks(fmt, 64, 512, rng))
    kernels.interleave_rows(w, fmt.ggml, 512)
    x = torch.randn(5, 512)
    x8 = INTERLEAVED["q4_k"].ggml
    want = kernels.linear(x, x8, w, 512, kernels.AVX2, 1)
    y = torch.empty(5, 64)
    args = (x8, w.data_ptr(), w.stride(0), 64, 512, x.data_ptr(), 512, 0, 5)
    assert lib.hm_qlinear(*args, y.data_ptr(), 64, 1, kernels.AVX2) == 0
    assert torch.equal(y, want)
    monkeypatch.setattr(kernels, "FLAGS", without)
    monkeypatch.setattr(
        kernels, "cpu_flags", lambda: frozenset({"avx2", "fma", "f16c", "avx_vnni"})
    )
    assert kernels.paths() == [kernels.AVX2]


def test_without_the_kernels_the_product_is_dequantise_then_multiply(monkeypatch):
    fmt, rng = FORMATS["q4_1"], np.random.default_rng(9)
    w = QTensor(torch.from_numpy(random_blocks(fmt, 16, 256, rng)), fmt, 256)
    x = torch.randn(3, 256)
    monkeypatch.setenv("HYBRIDMOE_QUANT_ISA", "off")
    assert not kernels.available()
    assert torch.equal(matmul(x, w), F.linear(x, w.dequantize()))
    monkeypatch.setenv("HYBRIDMOE_QUANT_ISA", "avx2")
    assert kernels.available() and kernels.isa() == kernels.AVX2


@pytest.mark.parametrize("name", ["q8_0", "q4_k", "q6_k"])
def test_many_rows_not_alone_dequantise_and_call_onednn(name):
    """From DEQUANTISE_FROM_ROWS bf16 rows, with rows not computed as if alone (--deterministic
    off), a product is F.linear on the weight dequantised to bf16, bit for bit; as if alone, or
    with fewer rows, it stays on the integer kernels (a row's bits then never depend on the
    others). Q4_K in rows of eights stays on the integer kernels (their tiles)."""
    from hybridmoe import invariance
    from hybridmoe.native import bf16 as bf16_kernels
    from hybridmoe.quant.tensor import for_kernels
    from hybridmoe.tuning import DEQUANTISE_FROM_ROWS

    fmt = FORMATS[name]
    w = QTensor(torch.from_numpy(random_blocks(fmt, 48, 512, np.random.default_rng(11))), fmt, 512)
    many = torch.randn(DEQUANTISE_FROM_ROWS + 3, 512).to(torch.bfloat16)
    dequantised = F.linear(many, w.dequantize(torch.bfloat16))
    integer = kernels.linear(many, fmt.ggml, w.data, 512).to(torch.bfloat16)
    assert not torch.equal(dequantised, integer)  # the two paths are told apart
    with invariance.rows_alone(False):
        got = linears(many, [w], [None])[0]
        assert torch.equal(got, linear(many, w))
        assert torch.equal(got, dequantised if bf16_kernels.cpu_has_native_bf16() else integer)
        few = many[: DEQUANTISE_FROM_ROWS - 1]
        assert torch.equal(linear(few, w), integer[: DEQUANTISE_FROM_ROWS - 1])
        eights = for_kernels(QTensor(w.data.clone(), fmt, 512))  # rearranged in place
        if eights.fmt.name == "q4_k_x8":
            assert torch.equal(linear(many, eights), integer)
    with invariance.rows_alone(True):
        assert torch.equal(linear(many, w), integer)
        assert torch.equal(linears(many, [w], [None])[0], integer)


@pytest.mark.parametrize("name", ["q8_0", "q4_k", "q6_k"])
def test_the_gradient_through_blocks_is_the_dequantised_matrixs(name):
    """x W^T with W in blocks (two parts, more rows than one dequantised tile) is differentiable in
    x: its gradient g W equals autograd's through the dequantised matrix."""
    from hybridmoe import tuning

    g = torch.Generator().manual_seed(0)
    rows = tuning.TRAIN_DEQUANT_ROWS + 40
    parts = [QTensor.quantize(torch.randn(n, 256, generator=g), name) for n in (rows, 24)]
    w = QTensor.cat(parts)  # [rows + 24, 256], in two places
    x = torch.randn(5, 256, generator=g, requires_grad=True)
    up = torch.randn(5, w.shape[0], generator=g)  # dLoss/dy
    (matmul(x, w) * up).sum().backward()
    ref = x.detach().clone().requires_grad_(True)
    (F.linear(ref, w.dequantize()) * up).sum().backward()
    assert torch.allclose(x.grad, ref.grad, rtol=1e-5, atol=1e-5)
