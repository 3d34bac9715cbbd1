"""quant.c hm_qmoe_tokens (native/quant.py moe_tokens): a prefill chunk's routed experts in blocks
and their weighted sums in one call, the tokens quantised once for every expert, give the bits of
the runtime's way (experts/run/ffn.py: tokens grouped by expert and gathered, experts_ffn, then
combine_grouped), on both paths and any thread count, in every format family; a decode token's
(T = 1) is combine_token's (tests/test_decode_blocks_quant.py checks that inside engine runs)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hybridmoe.experts.run.ffn import combine_grouped, experts_ffn, group_by_expert
from hybridmoe.experts.run.store import ExpertWeights
from hybridmoe.native import quant as kernels
from hybridmoe.quant.formats import FORMATS, Q4_K_X8
from hybridmoe.quant.interleave import interleave
from hybridmoe.quant.tensor import QTensor
from hybridmoe.tuning import FEW_TOKENS
from tests.test_quant import PATHS, random_expert

pytestmark = pytest.mark.skipif(
    kernels.best_isa() == 0, reason="needs AVX2 for the integer kernels"
)
HIDDEN, INTER, EXPERTS, TOP = 512, 256, 12, 4


def in_eights(w):
    """An expert's Q4_K matrices as load leaves them where AVX-512 runs (rows in eights)."""
    return tuple(QTensor(interleave(m.data, "q4_k"), Q4_K_X8, m.shape[1]) for m in w)


def layer(formats: tuple[str, str], seed: int):
    rng = np.random.default_rng(seed)
    experts = [random_expert(rng, HIDDEN, INTER, *formats) for _ in range(EXPERTS)]
    return [in_eights(w) for w in experts] if formats == ("q4_k", "q4_k") else experts


def routed(tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A router's choice: ids [T, K] distinct per token, unsorted, some experts unused; weights
    [T, K] fp32."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(EXPERTS - 2, generator=g)[:TOP] for _ in range(tokens)])
    weights = torch.rand(tokens, TOP, generator=g).softmax(-1)
    return ids, weights


def the_runtimes_way(x, experts, ids, weights, workers):
    groups = group_by_expert(ids)
    pairs = [(x[rows], ExpertWeights(*experts[e])) for e, rows, _ in groups]
    return combine_grouped(x, groups, experts_ffn(pairs, workers), weights)  # [T, H]


@pytest.mark.parametrize(
    "formats", [("q4_k", "q4_k"), ("q4_k", "q6_k"), ("q8_0", "q8_0"), ("q4_0", "q4_1")]
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_chunks_experts_and_mix_in_one_call_give_the_runtimes_bits(formats, dtype):
    experts = layer(formats, 5)
    table = kernels.expert_table(experts)
    for tokens in (2, FEW_TOKENS, 70):  # both of combine_grouped's ways; panels, tails of tokens
        x = torch.randn(tokens, HIDDEN).to(dtype)
        ids, weights = routed(tokens, tokens)
        want = the_runtimes_way(x, experts, ids, weights, 2)
        for path in PATHS:
            for workers in (1, 2, 3):
                got = kernels.moe_tokens(table, ids, weights, x, INTER, workers, path)
                assert got.dtype == dtype and torch.equal(got, want), (tokens, path, workers)


def test_an_expert_id_outside_the_table_is_refused():
    experts = layer(("q8_0", "q8_0"), 6)
    ids, weights = routed(3, 1)
    ids[1, 2] = EXPERTS
    with pytest.raises(ValueError):
        kernels.moe_tokens(
            kernels.expert_table(experts), ids, weights, torch.randn(3, HIDDEN), INTER, 1
        )


def test_the_layouts_differ_only_in_bytes():
    """Q4_K rows in eights give the plain rows' mix (the table's formats are read)."""
    rng = np.random.default_rng(7)
    plain = [random_expert(rng, HIDDEN, INTER, "q4_k", "q4_k") for _ in range(EXPERTS)]
    x, (ids, weights) = torch.randn(40, HIDDEN).bfloat16(), routed(40, 2)
    mixes = [
        kernels.moe_tokens(kernels.expert_table(ws), ids, weights, x, INTER, 2)
        for ws in (plain, [in_eights(w) for w in plain])
    ]
    assert FORMATS["q4_k"].ggml != Q4_K_X8.ggml and torch.equal(*mixes)
