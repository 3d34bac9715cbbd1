"""Interleaved rows (quant/interleave.py): Q4_K, Q5_K and Q6_K rows in eights (q4_k_x8, q5_k_x8,
q6_k_x8), Q8_0, Q4_0 and Q4_1 rows in sixteens (q8_0_x16, q4_0_x16, q4_1_x16): the layouts
native/quant.c states, byte for byte; every product on them (AVX-512 and AVX2 read them as they
lie) gives the bits of the same rows in GGUF's layout, on both paths, so test_quant.py's
bound against gguf's dequantiser holds for them unchanged (checked here too); products of 16 or more
tokens on AMX-INT8 tiles (where the CPU has them) give the bits of the VNNI path; and every other
reader of the bytes (the torch fallback, a GPU's dequantiser through the accelerator, the trainer's
transposed product, row lookups) takes the layouts."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import quants

from hybridmoe.engine.generate import generate_ids
from hybridmoe.experts.run.expert_bytes import pack, view
from hybridmoe.experts.run.store import ExpertWeights
from hybridmoe.loader import load_model
from hybridmoe.native import quant as kernels
from hybridmoe.quant.formats import FORMATS, INTERLEAVED
from hybridmoe.quant.interleave import deinterleave, interleave
from hybridmoe.quant.tensor import QTensor, for_kernels, matmul
from hybridmoe.quant.transposed import times
from tests.gguf_writer import Q
from tests.test_placement import hybrid
from tests.test_quant import PATHS, quantised_activations, random_blocks
from tests.test_quant_models import GREEDY, PROMPT, wide_mixtral_gguf

Q4_K = FORMATS["q4_k"]
FAMILIES = ("q4_k", "q5_k", "q6_k", "q8_0", "q4_0", "q4_1")


def blocks(fmt: str, rows: int, cols: int, seed: int) -> torch.Tensor:
    return torch.from_numpy(random_blocks(FORMATS[fmt], rows, cols, np.random.default_rng(seed)))


def q4k(rows: int, cols: int, seed: int) -> torch.Tensor:
    return blocks("q4_k", rows, cols, seed)


def in_eights(fmt: str, plain: torch.Tensor, cols: int) -> QTensor:
    return QTensor(interleave(plain, fmt), INTERLEAVED[fmt], cols)


def odd_rows(fmt: str) -> int:
    """Rows past a whole 16 where the layout allows it (rows in eights), else whole sixteens."""
    return 40 if INTERLEAVED[fmt].rows == 8 else 48


def laid_out_by_hand(plain: np.ndarray, fmt: str) -> np.ndarray:
    """The layouts of quant.c's comment, one byte at a time."""
    rows, width = plain.shape
    size = FORMATS[fmt].nbytes
    out = np.zeros_like(plain).reshape(-1)
    if fmt in ("q8_0", "q4_0", "q4_1"):
        head = 4 if fmt == "q4_1" else 2  # d (and q4_1's m)
        for n in range(rows):
            g, r = divmod(n, 16)
            for b in range(width // size):
                src, at = plain[n, size * b : size * (b + 1)], 16 * g * width + 16 * size * b
                out[at + 2 * r : at + 2 * r + 2] = src[0:2]  # d
                if head == 4:
                    out[at + 32 + 2 * r : at + 34 + 2 * r] = src[2:4]  # m
                at += 16 * (head - 2)
                for i in range((size - head) // 4):  # q (nibbles) in units of 4
                    out[at + 32 + 64 * i + 4 * r : at + 36 + 64 * i + 4 * r] = src[
                        head + 4 * i : head + 4 + 4 * i
                    ]
        return out.reshape(rows, width)
    for n in range(rows):
        g, r = divmod(n, 8)
        for s in range(width // size):
            src, at = plain[n, size * s : size * (s + 1)], (8 * g * width) + 8 * size * s
            if fmt in ("q4_k", "q5_k"):
                out[at + 2 * r : at + 2 * r + 2] = src[0:2]  # d
                out[at + 16 + 2 * r : at + 16 + 2 * r + 2] = src[2:4]  # dmin
                for j in range(12):
                    out[at + 32 + 8 * j + r] = src[4 + j]
                qs = 16
                if fmt == "q5_k":
                    for k in range(4):  # qh, then the nibbles after it
                        out[at + 128 + 64 * k + 8 * r : at + 136 + 64 * k + 8 * r] = src[
                            16 + 8 * k : 24 + 8 * k
                        ]
                    at, qs = at + 256, 48
                for k in range(16):
                    out[at + 128 + 64 * k + 8 * r : at + 136 + 64 * k + 8 * r] = src[
                        qs + 8 * k : qs + 8 + 8 * k
                    ]
                continue
            for k in range(16):  # ql
                out[at + 64 * k + 8 * r : at + 64 * k + 8 * r + 8] = src[8 * k : 8 * k + 8]
            for k in range(8):  # qh
                out[at + 1024 + 64 * k + 8 * r : at + 1032 + 64 * k + 8 * r] = src[
                    128 + 8 * k : 136 + 8 * k
                ]
            for j in range(16):  # scales
                out[at + 1536 + 8 * j + r] = src[192 + j]
            out[at + 1664 + 2 * r : at + 1666 + 2 * r] = src[208:210]  # d
    return out.reshape(rows, width)


@pytest.mark.parametrize("fmt", FAMILIES)
def test_interleaved_rows_are_the_stated_layout_and_come_back(fmt):
    plain = blocks(fmt, 3 * INTERLEAVED[fmt].rows, 512, 1)
    x8 = interleave(plain, fmt)
    assert np.array_equal(x8.numpy(), laid_out_by_hand(plain.numpy(), fmt))
    assert torch.equal(deinterleave(x8, fmt), plain)
    if kernels.available():  # the load's rearrangement in place (quant.c) makes the same bytes
        in_place = plain.clone()
        kernels.interleave_rows(in_place, FORMATS[fmt].ggml, 512)
        assert torch.equal(in_place, x8)


@pytest.mark.parametrize("fmt", FAMILIES)
@pytest.mark.parametrize("n,k", [(768, 2048), (16, 256), (0, 768)])
def test_products_on_interleaved_rows_keep_the_rows_bits(fmt, n, k):
    n = n or odd_rows(fmt)
    plain = blocks(fmt, n, k, n)
    x8 = interleave(plain, fmt)
    for m in (1, 2, 3, 5, 70):  # one token; decode batches (an odd one); past a chunk of 64
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(m, k).to(dtype)
            for path in PATHS:
                for workers in (1, 2):
                    want = kernels.linear(x, FORMATS[fmt].ggml, plain, k, path, workers)
                    got = kernels.linear(x, INTERLEAVED[fmt].ggml, x8, k, path, workers)
                    assert torch.equal(got, want), (m, dtype, path, workers)


@pytest.mark.parametrize("fmt", FAMILIES)
def test_many_tokens_on_gguf_rows_are_regrouped_with_the_rows_bits(fmt):
    """GGUF's rows met by 16 or more tokens at a time (blocks left in a file's map) are rearranged a
    group at a time into the interleaved layout and read by its kernel (quant.c regrouped): every
    token's result is the one the rows' own kernel gives it when its tokens come 5 at a time (too
    few to regroup), on every path and thread count, with rows past the last whole group, for 16
    tokens and for a chunk of 64 followed by one of 22."""
    k = 512
    rows = 3 * INTERLEAVED[fmt].rows + 5
    plain = blocks(fmt, rows, k, rows)
    ggml = FORMATS[fmt].ggml
    for m in (16, 86):
        x = torch.randn(m, k).to(torch.bfloat16)
        for path in PATHS:
            for workers in (1, 2):
                whole = kernels.linear(x, ggml, plain, k, path, workers)
                apart = [
                    kernels.linear(x[i : i + 5], ggml, plain, k, path, workers)
                    for i in range(0, m, 5)
                ]
                assert torch.equal(whole, torch.cat(apart)), (m, path, workers)


@pytest.mark.skipif(not kernels.available(), reason="needs the quant kernels (any x86-64 CPU)")
@pytest.mark.parametrize("near,far", [(0, "_MM_HINT_T1"), (1, "_MM_HINT_T1"), (0, "_MM_HINT_NTA")])
def test_one_token_products_read_the_same_bits_however_the_weights_are_asked_for(near, far):
    """quant.c is built to ask for a one-token product's weights just ahead into L1 on Intel's cores
    (NEAR_PREFETCH) and further ahead as non-temporal on AMD's Zen 5 (FAR_HINT), into L2 elsewhere;
    each build gives the bits of this machine's library, on both paths."""
    from hybridmoe.native.build import load

    flags = [f for f in kernels.FLAGS if not f.startswith(("-DNEAR_PREFETCH", "-DFAR_HINT"))]
    other = load(
        kernels.SOURCE,
        [*flags, f"-DNEAR_PREFETCH={near}", f"-DFAR_HINT={far}"],
        kernels.SIGNATURES,
        kernels.HEADERS,
    )
    for fmt in FAMILIES:
        n, k = odd_rows(fmt) + 3 * INTERLEAVED[fmt].rows, 2048
        plain = blocks(fmt, n, k, 7)
        for layout, data in ((FORMATS[fmt], plain), (INTERLEAVED[fmt], interleave(plain, fmt))):
            x = torch.randn(1, k).to(torch.bfloat16)
            for path in PATHS:
                y = torch.empty(1, n)
                status = other.hm_qlinear(
                    layout.ggml, data.data_ptr(), data.stride(0), n, k, x.data_ptr(), k, 1, 1,
                    y.data_ptr(), n, 1, path,
                )  # fmt: skip
                assert status == 0
                assert torch.equal(y, kernels.linear(x, layout.ggml, data, k, path, 1)), (fmt, path)


@pytest.fixture
def tiles_back_on():
    yield
    kernels.use_tiles(True)


@pytest.mark.parametrize("fmt", FAMILIES)
def test_many_tokens_on_the_tiles_keep_the_vnni_paths_bits(fmt, tiles_back_on):
    """Products of 16+ consecutive tokens, and routed experts' tokens (quantised as their own rows
    for the tiles), with the AMX-INT8 tiles on and off: the same bits. Shapes with rows past the
    last whole 16 and tokens past the last whole 16 (those go to the VNNI path) and one token
    tile or several. Where the CPU has no AMX-INT8 both runs take the VNNI path. Experts in a
    Q4_K_M file's mix too: gate and up in Q4_K, down in `fmt`."""
    for n, k, m in ((16, 256, 32), (odd_rows(fmt), 768, 21), (768, 2048, 70), (48, 512, 129)):
        x8 = interleave(blocks(fmt, n, k, n + m), fmt)
        x = torch.randn(m, k).to(torch.bfloat16)
        ys = []
        for on in (True, False):
            kernels.use_tiles(on)
            ys.append([kernels.linear(x, INTERLEAVED[fmt].ggml, x8, k, None, w) for w in (1, 2)])
        assert all(torch.equal(a, b) for a, b in zip(*ys)), (n, k, m)
        assert torch.equal(*ys[0]), "a thread count changed a bit"
        # several products of one quantisation (q, k and v), the first in GGUF's layout
        plain = blocks("q4_k", n, k, 7)
        weights = [(FORMATS["q4_k"].ggml, plain), (INTERLEAVED[fmt].ggml, x8)]
        kernels.use_tiles(True)
        both = kernels.linears(x, weights, k)
        assert torch.equal(both[1], ys[1][0])
        assert torch.equal(both[0], kernels.linear(x, FORMATS["q4_k"].ggml, plain, k))
    hidden, inter, count, top = 512, 256, 6, 3
    experts = [
        (
            in_eights("q4_k", q4k(2 * inter, hidden, 30 + e), hidden),
            in_eights(fmt, blocks(fmt, hidden, inter, 40 + e), inter),
        )
        for e in range(count)
    ]
    table = kernels.expert_table(experts)
    tokens = 40  # ~20 tokens an expert: past AMX_MIN_TOKENS (16), some with a second partial tile
    gen = torch.Generator().manual_seed(5)
    ids = torch.stack([torch.randperm(count, generator=gen)[:top] for _ in range(tokens)])
    weights = torch.softmax(torch.randn(tokens, top, generator=gen), -1)
    x = torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16)
    mixes = []
    for on in (True, False):
        kernels.use_tiles(on)
        mixes.append(kernels.moe_tokens(table, ids, weights, x, inter, 2))
    assert torch.equal(*mixes)


@pytest.mark.parametrize("fmt", FAMILIES)
def test_interleaved_rows_match_gguf_within_the_activation_bound(fmt):
    """test_quant.py's check, on the layouts: fp32 rounding against the product with the
    quantised activations, and the activations' rounding bound against the true ones."""
    raw = blocks(fmt, 48, 768, 3)
    w = quants.dequantize(raw.numpy(), gguf.GGMLQuantizationType[fmt.upper()]).astype(np.float64)
    x = np.random.default_rng(4).standard_normal((1, 768)).astype(np.float32)
    y = kernels.linear(
        torch.from_numpy(x), INTERLEAVED[fmt].ggml, interleave(raw, fmt), 768
    ).numpy()
    xq, step = quantised_activations(x, FORMATS[fmt].block)
    exact_on_xq = xq @ w.T
    assert np.abs(y - exact_on_xq).max() <= 1e-5 * np.abs(exact_on_xq).max()
    bound = (np.abs(w)[None] * step[:, None, :] / 2).sum(-1)  # [M, N]
    assert (
        np.abs(y - x.astype(np.float64) @ w.T) <= bound + 1e-5 * np.abs(exact_on_xq).max()
    ).all()


# Byte ranges of a block set to one value for test_the_integer_sums_hold_at_their_extremes: every
# quant at its largest (Q8_0 at -128, whose magnitude is the largest), every sub-block scale and
# minimum at its largest; the fp16 scales stay as random_blocks drew them
EXTREMES = {
    "q4_k": [(4, 144, 0xFF)],  # 6-bit scales and minimums 63, nibbles 15
    "q5_k": [(4, 176, 0xFF)],  # and every fifth bit: values 31
    "q6_k": [(0, 192, 0xFF), (192, 208, 0x7F)],  # values 63, int8 scales 127
    "q8_0": [(2, 34, 0x80)],
    "q4_0": [(2, 18, 0xFF)],
    "q4_1": [(4, 20, 0xFF)],
}


@pytest.mark.parametrize("fmt", FAMILIES)
def test_the_integer_sums_hold_at_their_extremes(fmt):
    """Blocks whose every quant and scale is at its largest against activations of one sign at
    theirs (127 after quantising): each path's word and dword sums at the bounds quant.c states
    for them (a word that wrapped would be off by 2^16 x a scale). Every path, rows in GGUF's
    layout and interleaved, gives the same bits, and the float64 product with the quantised
    activations."""
    f = FORMATS[fmt]
    raw = random_blocks(f, 32, 768, np.random.default_rng(5)).reshape(32, -1, f.nbytes)
    for lo, hi, value in EXTREMES[fmt]:
        raw[:, :, lo:hi] = value
    raw = torch.from_numpy(raw.reshape(32, -1).copy())
    w = quants.dequantize(raw.numpy(), gguf.GGMLQuantizationType[fmt.upper()]).astype(np.float64)
    for sign in (1.0, -1.0):
        x = torch.full((3, 768), sign)
        want = kernels.linear(x, f.ggml, raw, 768, PATHS[0], 1)
        for path in PATHS:
            for data, ggml in ((raw, f.ggml), (interleave(raw, fmt), INTERLEAVED[fmt].ggml)):
                assert torch.equal(kernels.linear(x, ggml, data, 768, path, 1), want), path
        exact = x.double().numpy() @ w.T  # the activations quantise to 127 (x 1 / 127) exactly
        assert np.abs(want.numpy() - exact).max() <= 1e-5 * np.abs(exact).max()


@pytest.mark.parametrize("fmt", FAMILIES)
def test_experts_and_a_tokens_mix_on_interleaved_rows_keep_their_bits(fmt):
    hidden, inter, count = 512, 256, 4
    plain = [
        (blocks(fmt, 2 * inter, hidden, 10 + e), blocks(fmt, hidden, inter, 20 + e))
        for e in range(count)
    ]
    f = FORMATS[fmt]
    as_q = [(QTensor(gu, f, hidden), QTensor(d, f, inter)) for gu, d in plain]
    as_x8 = [(in_eights(fmt, gu, hidden), in_eights(fmt, d, inter)) for gu, d in plain]
    xs = [torch.randn(m, hidden) for m in (1, 1, 3, 1)]
    for path in PATHS:
        for a, b in zip(kernels.experts(xs, as_q, path, 2), kernels.experts(xs, as_x8, path, 2)):
            assert torch.equal(a, b)
        ids, weights = torch.tensor([[3, 0, 2]]), torch.tensor([[0.5, 0.3, 0.2]])
        x = torch.randn(1, hidden).to(torch.bfloat16)
        mixes = [
            kernels.moe_tokens(kernels.expert_table(ws), ids, weights, x, inter, 2, path)
            for ws in (as_q, as_x8)
        ]
        assert torch.equal(*mixes)


@pytest.mark.parametrize("fmt", FAMILIES)
def test_every_other_reader_takes_the_layout(fmt):
    f = FORMATS[fmt]
    plain = QTensor(blocks(fmt, 64, 512, 7), f, 512)
    x8 = in_eights(fmt, plain.data, 512)
    assert torch.equal(x8.dequantize(), plain.dequantize())  # the fallback, a GPU's dequantiser
    pick = torch.tensor([5, 0, 63, 17])
    assert torch.equal(x8.rows(pick).data, plain.rows(pick).data)  # row lookups
    assert x8.rows(pick).fmt == f
    g = torch.randn(3, 64)
    assert torch.equal(times(g, x8), times(g, plain))  # the trainer's input gradient
    down = QTensor(blocks(fmt, 512, 256, 8), f, 256)
    expert = ExpertWeights(QTensor.cat([x8, x8]), for_kernels(down))
    buf = torch.zeros(2 * expert.nbytes() + 4096, dtype=torch.uint8)
    held = view(buf, pack(expert, buf))  # the bytes an accelerator's slot holds
    assert held.gate_up.fmt == INTERLEAVED[fmt] and torch.equal(
        held.gate_up.dequantize(), QTensor.cat([plain, plain]).dequantize()
    )
    assert held.down.fmt == expert.down.fmt


@pytest.mark.parametrize("fmt", FAMILIES)
def test_the_torch_fallback_computes_on_interleaved_rows(fmt, monkeypatch):
    plain = QTensor(blocks(fmt, 32, 256, 9), FORMATS[fmt], 256)
    x8 = in_eights(fmt, plain.data, 256)
    monkeypatch.setenv("HYBRIDMOE_QUANT_ISA", "off")
    assert not kernels.available()
    x = torch.randn(3, 256)
    assert torch.equal(matmul(x, x8), matmul(x, plain))


@pytest.mark.parametrize("fmt", FAMILIES)
def test_weights_are_interleaved_in_place_where_their_path_reads_them(fmt, monkeypatch):
    """Every interleaved layout where any path of the kernels runs (they read them as they lie);
    none with the native code off, nor for rows that are not whole groups."""
    f = FORMATS[fmt]
    on = [("avx512", FAMILIES), ("avxvnni", FAMILIES), ("avx2", FAMILIES)]
    for path, interleaved in (*on, ("off", ())):
        monkeypatch.setenv("HYBRIDMOE_QUANT_ISA", path)
        if path == "avx512" and kernels.isa() != kernels.AVX512:
            continue  # a CPU without AVX-512 VNNI
        data = blocks(fmt, 32, 512, 11)
        values = QTensor(data.clone(), f, 512).dequantize()
        kept = for_kernels(QTensor(data, f, 512))
        if fmt in interleaved:
            assert kept.fmt == INTERLEAVED[fmt] and kept.parts[0].data_ptr() == data.data_ptr()
        else:
            assert kept.fmt == f
        assert torch.equal(kept.dequantize(), values)
        assert for_kernels(QTensor(blocks(fmt, 36, 512, 12), f, 512)).fmt == f  # not whole eights


def test_the_emulated_accelerator_runs_experts_kept_in_eights(tmp_path):
    """The emulator computes GPU experts on the kernels from the bytes it was copied: the CPU
    runtime's tokens, with the slots holding the store's (interleaved) bytes."""
    path = wide_mixtral_gguf(tmp_path, Q.Q4_K)
    reference = list(generate_ids(load_model(path, progress=False), PROMPT, GREEDY))
    model = hybrid(path, policy="value", budget="0.5")
    assert list(generate_ids(model, PROMPT, GREEDY)) == reference
    runtime = model.runtime
    assert runtime.stats.total["gpu_runs"] > 0
    for key, slot in runtime.planner.cache.slot_of.items():
        held, stored = runtime.acc.buffers.weights(slot), runtime.store.get(*key)
        assert held.gate_up.fmt == stored.gate_up.fmt
        assert torch.equal(held.gate_up.data.cpu(), stored.gate_up.data)
    runtime.close()
