"""Q4_K rows in eights (q4_k_x8, quant/interleave.py): the layout native/quant.c states, byte for
byte; every product on it (one token on AVX-512 reads it as it lies, everything else puts rows back)
gives the bits of the same Q4_K rows in GGUF's layout, on both paths, so test_quant.py's bound
against gguf's dequantiser holds for it unchanged (checked here too); products of 32 or more
tokens on AMX-INT8 tiles (where the CPU has them) give the bits of the VNNI path; and every other
reader of the bytes (the torch fallback, a GPU's dequantiser through the accelerator, the
trainer's transposed product, row lookups) takes the layout."""

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
from hybridmoe.quant.formats import FORMATS, Q4_K_X8
from hybridmoe.quant.interleave import deinterleave, interleave
from hybridmoe.quant.tensor import QTensor, for_kernels, matmul
from hybridmoe.quant.transposed import times
from tests.gguf_writer import Q
from tests.test_placement import hybrid
from tests.test_quant import PATHS, quantised_activations, random_blocks
from tests.test_quant_models import GREEDY, PROMPT, wide_mixtral_gguf

Q4_K = FORMATS["q4_k"]


def q4k(rows: int, cols: int, seed: int) -> torch.Tensor:
    return torch.from_numpy(random_blocks(Q4_K, rows, cols, np.random.default_rng(seed)))


def laid_out_by_hand(plain: np.ndarray) -> np.ndarray:
    """The layout of quant.c's comment, one byte at a time."""
    rows, width = plain.shape
    out = np.zeros_like(plain).reshape(-1)
    for n in range(rows):
        g, r = divmod(n, 8)
        for s in range(width // 144):
            src, at = plain[n, 144 * s : 144 * s + 144], (8 * g * width) + 1152 * s
            out[at + 2 * r : at + 2 * r + 2] = src[0:2]  # d
            out[at + 16 + 2 * r : at + 16 + 2 * r + 2] = src[2:4]  # dmin
            for j in range(12):
                out[at + 32 + 8 * j + r] = src[4 + j]
            for k in range(16):
                out[at + 128 + 64 * k + 8 * r : at + 128 + 64 * k + 8 * r + 8] = src[
                    16 + 8 * k : 24 + 8 * k
                ]
    return out.reshape(rows, width)


def test_rows_in_eights_are_the_stated_layout_and_come_back():
    plain = q4k(24, 512, 1)
    x8 = interleave(plain)
    assert np.array_equal(x8.numpy(), laid_out_by_hand(plain.numpy()))
    assert torch.equal(deinterleave(x8), plain)
    if kernels.available():  # the load's rearrangement in place (quant.c) makes the same bytes
        in_place = plain.clone()
        kernels.to_rows_in_eights(in_place, 512)
        assert torch.equal(in_place, x8)


@pytest.mark.parametrize("n,k", [(768, 2048), (16, 256), (40, 768)])
def test_products_on_rows_in_eights_keep_q4_ks_bits(n, k):
    plain = q4k(n, k, n)
    x8 = interleave(plain)
    for m in (1, 2, 5, 70):  # one token; decode batches; past a chunk of 64
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(m, k).to(dtype)
            for path in PATHS:
                for workers in (1, 2):
                    want = kernels.linear(x, Q4_K.ggml, plain, k, path, workers)
                    got = kernels.linear(x, Q4_K_X8.ggml, x8, k, path, workers)
                    assert torch.equal(got, want), (m, dtype, path, workers)


@pytest.fixture
def tiles_back_on():
    yield
    kernels.use_tiles(True)


def test_many_tokens_on_the_tiles_keep_the_vnni_paths_bits(tiles_back_on):
    """Products of 32+ consecutive tokens, and routed experts' tokens (quantised as their own rows
    for the tiles), with the AMX-INT8 tiles on and off: the same bits. Shapes with rows past the
    last whole 16 and tokens past the last whole 16 (those go to the VNNI path) and one token
    tile or several. Where the CPU has no AMX-INT8 both runs take the VNNI path."""
    for n, k, m in ((16, 256, 32), (40, 768, 48), (768, 2048, 70), (48, 512, 129)):
        x8 = interleave(q4k(n, k, n + m))
        x = torch.randn(m, k).to(torch.bfloat16)
        ys = []
        for on in (True, False):
            kernels.use_tiles(on)
            ys.append([kernels.linear(x, Q4_K_X8.ggml, x8, k, None, w) for w in (1, 2)])
        assert all(torch.equal(a, b) for a, b in zip(*ys)), (n, k, m)
        assert torch.equal(*ys[0]), "a thread count changed a bit"
    hidden, inter, count, top = 512, 256, 6, 3
    experts = [
        (
            QTensor(interleave(q4k(2 * inter, hidden, 30 + e)), Q4_K_X8, hidden),
            QTensor(interleave(q4k(hidden, inter, 40 + e)), Q4_K_X8, inter),
        )
        for e in range(count)
    ]
    table = kernels.expert_table(experts)
    tokens = 96  # ~48 tokens an expert: past AMX_MIN_TOKENS
    gen = torch.Generator().manual_seed(5)
    ids = torch.stack([torch.randperm(count, generator=gen)[:top] for _ in range(tokens)])
    weights = torch.softmax(torch.randn(tokens, top, generator=gen), -1)
    x = torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16)
    mixes = []
    for on in (True, False):
        kernels.use_tiles(on)
        mixes.append(kernels.moe_tokens(table, ids, weights, x, inter, 2))
    assert torch.equal(*mixes)


def test_rows_in_eights_match_gguf_within_the_activation_bound():
    """test_quant.py's check, on the layout: fp32 rounding against the product with the
    quantised activations, and the activations' rounding bound against the true ones."""
    raw = q4k(48, 768, 3)
    w = quants.dequantize(raw.numpy(), gguf.GGMLQuantizationType.Q4_K).astype(np.float64)
    x = np.random.default_rng(4).standard_normal((1, 768)).astype(np.float32)
    y = kernels.linear(torch.from_numpy(x), Q4_K_X8.ggml, interleave(raw), 768).numpy()
    xq, step = quantised_activations(x, 256)
    exact_on_xq = xq @ w.T
    assert np.abs(y - exact_on_xq).max() <= 1e-5 * np.abs(exact_on_xq).max()
    bound = (np.abs(w)[None] * step[:, None, :] / 2).sum(-1)  # [M, N]
    assert (
        np.abs(y - x.astype(np.float64) @ w.T) <= bound + 1e-5 * np.abs(exact_on_xq).max()
    ).all()


def test_experts_and_a_tokens_mix_on_rows_in_eights_keep_their_bits():
    hidden, inter, count = 512, 256, 4
    plain = [(q4k(2 * inter, hidden, 10 + e), q4k(hidden, inter, 20 + e)) for e in range(count)]
    as_q = [(QTensor(gu, Q4_K, hidden), QTensor(d, Q4_K, inter)) for gu, d in plain]
    as_x8 = [
        (QTensor(interleave(gu), Q4_K_X8, hidden), QTensor(interleave(d), Q4_K_X8, inter))
        for gu, d in plain
    ]
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


def test_every_other_reader_takes_the_layout():
    plain = QTensor(q4k(64, 512, 7), Q4_K, 512)
    x8 = QTensor(interleave(plain.data), Q4_K_X8, 512)
    assert torch.equal(x8.dequantize(), plain.dequantize())  # the fallback, a GPU's dequantiser
    pick = torch.tensor([5, 0, 63, 17])
    assert torch.equal(x8.rows(pick).data, plain.rows(pick).data)  # row lookups
    assert x8.rows(pick).fmt == Q4_K
    g = torch.randn(3, 64)
    assert torch.equal(times(g, x8), times(g, plain))  # the trainer's input gradient
    down = QTensor(q4k(512, 256, 8), Q4_K, 256)
    expert = ExpertWeights(QTensor.cat([x8, x8]), for_kernels(down))
    buf = torch.zeros(2 * expert.nbytes() + 4096, dtype=torch.uint8)
    held = view(buf, pack(expert, buf))  # the bytes an accelerator's slot holds
    assert held.gate_up.fmt == Q4_K_X8 and torch.equal(
        held.gate_up.dequantize(), QTensor.cat([plain, plain]).dequantize()
    )
    assert held.down.fmt == expert.down.fmt


def test_the_torch_fallback_computes_on_rows_in_eights(monkeypatch):
    plain = QTensor(q4k(32, 256, 9), Q4_K, 256)
    x8 = QTensor(interleave(plain.data), Q4_K_X8, 256)
    monkeypatch.setenv("HYBRIDMOE_QUANT_ISA", "off")
    assert not kernels.available()
    x = torch.randn(3, 256)
    assert torch.equal(matmul(x, x8), matmul(x, plain))


def test_weights_take_rows_in_eights_in_place_where_avx512_reads_them(monkeypatch):
    data = q4k(32, 512, 11)
    values = QTensor(data.clone(), Q4_K, 512).dequantize()
    kept = for_kernels(QTensor(data, Q4_K, 512))
    if kernels.isa() == kernels.AVX512:
        assert kept.fmt == Q4_K_X8 and kept.parts[0].data_ptr() == data.data_ptr()
    else:
        assert kept.fmt == Q4_K
    assert torch.equal(kept.dequantize(), values)
    monkeypatch.setenv("HYBRIDMOE_QUANT_ISA", "avx2")  # the AVX2 path reads GGUF's layout
    assert for_kernels(QTensor(q4k(32, 512, 12), Q4_K, 512)).fmt == Q4_K
    assert for_kernels(QTensor(q4k(36, 512, 12), Q4_K, 512)).fmt == Q4_K  # not whole eights


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
