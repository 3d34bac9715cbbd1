"""A token embedding's rows of blocks back to values in one native call (QTensor.lookup through
native/quant.c's hm_qrows) against the torch ops of quant/dequant.py it replaces, bit for bit, and
against gguf's own dequantiser, an independent reference in numpy's fp32 (ggml's formulas, e.g.
Q4_K's (d sc) q - (dmin m)): every product there is exact (an fp16 scale times small integers) and
only the last addition rounds, so exact equality with it too."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import quants

from hybridmoe.layers.embedding import Embedding
from hybridmoe.native import quant as kernels
from hybridmoe.quant.formats import FORMATS, Q4_K_X8, QUANTIZE_TO
from hybridmoe.quant.interleave import interleave
from hybridmoe.quant.tensor import QTensor
from tests.test_quant import random_blocks

DTYPES = (torch.float32, torch.bfloat16)
ROWS, COLS = 40, 768  # 768: whole super-blocks of 256 and an odd count (24) of blocks of 32
# how each table is made: quantised from random weights (the formats the package quantises to),
# random bytes with small fp16 scales (every bit pattern of the quants), or random bytes with any
# finite fp16 scales (zeros, subnormals, both signs, up to 65504)
CASES = [(n, "quantised") for n in QUANTIZE_TO] + [
    (n, kind) for n in FORMATS for kind in ("bytes", "any scales")
]
SCALE_AT = {"q8_0": [0], "q4_0": [0], "q4_1": [0, 2], "q4_k": [0, 2], "q5_k": [0, 2], "q6_k": [208]}


def halves_at(raw: np.ndarray, fmt, at: int, halves: np.ndarray) -> None:
    """Write fp16 `halves` [rows, blocks] at byte `at` of every block of raw [rows, row bytes]."""
    blocks = raw.reshape(raw.shape[0], -1, fmt.nbytes)
    blocks[:, :, at : at + 2] = halves.astype(np.float16).view(np.uint8).reshape(*halves.shape, 2)


def table(name: str, kind: str, rng) -> QTensor:
    """A [ROWS, COLS] table in `name`'s blocks, made as CASES says."""
    fmt = FORMATS[name]
    if kind == "quantised":
        return QTensor.quantize(torch.from_numpy(rng.standard_normal((ROWS, COLS))).float(), name)
    raw = random_blocks(fmt, ROWS, COLS, rng)
    if kind == "any scales":
        for at in SCALE_AT[name]:
            bits = rng.integers(0, 2**16, size=(ROWS, COLS // fmt.block), dtype=np.uint16)
            bits[(bits & 0x7C00) == 0x7C00] &= 0x83FF  # inf and NaN exponents -> a subnormal
            halves_at(raw, fmt, at, bits.view(np.float16))
    return QTensor(torch.from_numpy(raw), fmt, COLS)


def some_ids(n: int, rng) -> torch.Tensor:
    """n random row ids; from two on, the first again (a prompt repeats tokens) and the last row."""
    ids = rng.integers(0, ROWS, size=n)
    if n > 1:
        ids[n // 2], ids[-1] = ids[0], ROWS - 1
    return torch.from_numpy(ids)


@pytest.mark.parametrize("name,kind", CASES)
@pytest.mark.parametrize("n", [1, 7])
def test_native_rows_are_the_torch_paths_bits_and_ggufs_values(name, kind, n):
    rng = np.random.default_rng(hash((name, kind, n)) % 2**32)
    w, ids = table(name, kind, rng), some_ids(n, rng)
    for dtype in DTYPES:
        native = kernels.rows(w.data, w.fmt.ggml, COLS, ids, dtype)  # [n, K]
        assert native.dtype == dtype and native.shape == (n, COLS)
        assert torch.equal(native, w.rows(ids).dequantize(dtype))
    ref = quants.dequantize(w.data.numpy()[ids.numpy()], gguf.GGMLQuantizationType(w.fmt.ggml))
    assert np.array_equal(kernels.rows(w.data, w.fmt.ggml, COLS, ids, torch.float32).numpy(), ref)


@pytest.mark.parametrize("dtype", DTYPES)
def test_non_finite_scales_give_nan_and_inf_where_torch_does(dtype):
    """No valid block has them, but a damaged file may: inf * 0 is NaN in both, and a NaN stays
    a NaN in bf16 (a plain rounding of its bits carries a NaN of payload 0x3ff into a zero)."""
    fmt, rng = FORMATS["q4_k"], np.random.default_rng(3)
    raw = random_blocks(fmt, ROWS, COLS, rng)
    # inf, -inf, NaNs of payload 0x200 and 0x3ff of either sign, and 1
    bits = np.array([0x7C00, 0xFC00, 0x7E00, 0x7FFF, 0xFFFF, 0x3C00], dtype=np.uint16)
    halves_at(raw, fmt, 0, rng.choice(bits, size=(ROWS, COLS // fmt.block)).view(np.float16))
    w = QTensor(torch.from_numpy(raw), fmt, COLS)
    ids = torch.arange(ROWS)
    native, ref = kernels.rows(w.data, fmt.ggml, COLS, ids, dtype), w.dequantize(dtype)
    assert native.isnan().any() and native.isinf().any()
    assert torch.equal(native.isnan(), ref.isnan())
    assert torch.equal(native.nan_to_num(0.0, 1.0, -1.0), ref.nan_to_num(0.0, 1.0, -1.0))


@pytest.mark.parametrize("bad", [ROWS, ROWS + 1000, -1])
def test_a_row_id_out_of_range_is_an_index_error(bad):
    w = table("q4_k", "quantised", np.random.default_rng(4))
    with pytest.raises(IndexError, match="out of range"):
        kernels.rows(w.data, w.fmt.ggml, COLS, torch.tensor([0, bad, 1]), torch.float32)
    with pytest.raises(IndexError):
        w.lookup(torch.tensor([bad]))


def test_rows_in_eights_are_refused_natively_and_looked_up_in_torch():
    w = table("q4_k", "quantised", np.random.default_rng(5))
    x8 = QTensor(interleave(w.data, "q4_k"), Q4_K_X8, COLS)
    with pytest.raises(ValueError, match="does not suit"):
        kernels.rows(x8.data, Q4_K_X8.ggml, COLS, torch.tensor([0]), torch.float32)
    ids = torch.tensor([9, 0, 9, 39])
    assert torch.equal(x8.lookup(ids, torch.bfloat16), w.lookup(ids, torch.bfloat16))


def test_a_table_in_two_parts_looks_up_each_parts_rows():
    rng = np.random.default_rng(6)
    top, bottom = table("q6_k", "bytes", rng), table("q6_k", "quantised", rng)
    both = QTensor.cat([top, bottom])
    ids = torch.tensor([ROWS + 3, 2, ROWS - 1, ROWS, 2])
    expected = torch.cat([top.dequantize(), bottom.dequantize()])[ids]
    assert torch.equal(both.lookup(ids), expected)


@pytest.mark.parametrize("name", list(FORMATS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_embedding_gives_the_same_rows_with_the_kernels_off(name, dtype, monkeypatch):
    rng = np.random.default_rng(hash((name, str(dtype))) % 2**32)
    emb = Embedding(ROWS, COLS)
    delattr(emb, "weight")  # as models/base.py puts a table in blocks in its place
    emb.weight, emb.dtype = table(name, "bytes", rng), dtype
    ids = torch.from_numpy(rng.integers(0, ROWS, size=(2, 3)))  # [B, T]
    assert kernels.available()
    on = emb(ids)  # [B, T, H]
    monkeypatch.setenv("HYBRIDMOE_QUANT_ISA", "off")
    assert not kernels.available()
    off = emb(ids)
    assert on.shape == (2, 3, COLS) and on.dtype == dtype and torch.equal(on, off)
