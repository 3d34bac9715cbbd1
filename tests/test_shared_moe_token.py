"""native.shared_moe_token (bf16.c hm_shared_moe_token_bf16, hm_shared_moe_tokens_bf16): a
Qwen2-MoE block's decode tokens after its router, with the layer's residual sum, against torch's
ops one by one; its silu and sigmoid against torch's on every bf16 value."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybridmoe import native
from hybridmoe.experts.run.ffn import combine_token, experts_ffn
from hybridmoe.experts.run.store import ExpertWeights
from hybridmoe.layers.linear import linear

needs_kernels = pytest.mark.skipif(
    not native.cpu_runs_kernels(), reason="needs a CPU with AVX2 and FMA"
)

BF16 = torch.bfloat16


def bf16(*shape, gen, scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(BF16)


def experts_of(hidden, inter, n, gen, scale=0.1):
    store = [
        ExpertWeights(bf16(2 * inter, hidden, gen=gen, scale=scale), bf16(hidden, inter, gen=gen))
        for _ in range(n)
    ]
    table = torch.tensor([[w.gate_up.data_ptr(), w.down.data_ptr()] for w in store])  # [E, 2]
    return store, table


def same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values, NaN equal to NaN (the sums on the way may turn -0 into +0)."""
    return bool(((a == b) | (a.isnan() & b.isnan())).all())


@needs_kernels
@pytest.mark.parametrize("workers", [1, 2, 3])
@pytest.mark.parametrize("hidden, inter, shared, k", [(576, 48, 768, 8), (100, 96, 40, 3)])
def test_a_shared_moe_token_is_torchs_block_and_residual_sum(hidden, inter, shared, k, workers):
    """resid + (routed + sigmoid(logit) * down(silu(gate) * up)), every step rounded to bf16 as
    torch rounds it (models/qwen2_moe.py forward, layers/decoder.py's sum), routed as moe_token."""
    gen = torch.Generator().manual_seed(hidden + workers)
    x, resid = bf16(1, hidden, gen=gen), bf16(1, hidden, gen=gen)
    store, table = experts_of(hidden, inter, 16, gen)
    ids = torch.randperm(16, generator=gen)[:k][None]  # [1, K], top-k order
    weights = torch.rand(1, k, generator=gen)  # [1, K] fp32
    row = bf16(1, 5 + 2 * shared, gen=gen, scale=2.0)  # [1, N]: the gate logit at 3, gate, up
    down = bf16(hidden, shared, gen=gen, scale=0.05)  # [H, S]
    routed = combine_token(
        x, experts_ffn([(x, store[e]) for e in ids[0].tolist()], 1), weights, ids
    )
    gate, up = row[:, 4 : 4 + shared], row[:, 4 + shared : 4 + 2 * shared]  # [1, S] each
    y = F.linear(F.silu(gate) * up, down)  # [1, H]
    ref = resid + (routed + torch.sigmoid(row[:, 3:4]) * y)
    got = native.shared_moe_token(table, ids, weights, x, inter, (row, 3, down), resid, workers)
    assert got.dtype == BF16 and torch.equal(got, ref)


@needs_kernels
@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("tokens", [2, 5, 9])
def test_a_step_of_several_tokens_gives_each_its_bits_alone(tokens, workers):
    """T tokens in one call (each expert read once for its tokens, the shared expert's down over
    the T rows) give each token the bits of its own call and of torch's block; an expert id
    outside the table is refused."""
    hidden, inter, shared, k = 576, 48, 768, 8
    gen = torch.Generator().manual_seed(tokens + 10 * workers)
    x, resid = bf16(tokens, hidden, gen=gen), bf16(tokens, hidden, gen=gen)
    store, table = experts_of(hidden, inter, 16, gen)
    ids = torch.stack([torch.randperm(16, generator=gen)[:k] for _ in range(tokens)])  # [T, K]
    weights = torch.rand(tokens, k, generator=gen)  # [T, K] fp32
    rows = bf16(tokens, 5 + 2 * shared, gen=gen, scale=2.0)  # [T, N]
    down = bf16(hidden, shared, gen=gen, scale=0.05)  # [H, S]
    got = native.shared_moe_token(table, ids, weights, x, inter, (rows, 3, down), resid, workers)
    for t in range(tokens):
        one = slice(t, t + 1)
        alone = native.shared_moe_token(
            table, ids[one], weights[one], x[one], inter, (rows[one], 3, down), resid[one], 1
        )
        assert torch.equal(got[one], alone)
        routed = combine_token(
            x[one],
            experts_ffn([(x[one], store[e]) for e in ids[t].tolist()], 1),
            weights[one],
            ids[one],
        )
        gate, up = rows[one, 4 : 4 + shared], rows[one, 4 + shared : 4 + 2 * shared]
        ref = resid[one] + (
            routed + torch.sigmoid(rows[one, 3:4]) * F.linear(F.silu(gate) * up, down)
        )
        assert torch.equal(got[one], ref)
    ids[tokens - 1, 0] = 16
    with pytest.raises(ValueError, match="outside"):
        native.shared_moe_token(table, ids, weights, x, inter, (rows, 3, down), resid, workers)


def _call(row, down, hidden):
    """shared_moe_token with one expert of weight 0 (routed = 0) and resid 0: out = bf16(s y)."""
    gen = torch.Generator().manual_seed(0)
    store, table = experts_of(hidden, 4, 1, gen, scale=0.0)
    x, zero = torch.zeros(1, hidden, dtype=BF16), torch.zeros(1, hidden, dtype=BF16)
    ids, w = torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, 1)
    return native.shared_moe_token(table, ids, w, x, 4, (row, 0, down), zero, 1)[0]


EVERY_BF16 = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(BF16)  # [65536]


@needs_kernels
def test_its_silu_is_torchs_on_every_bf16_value():
    """Down = the identity, up = 1 and sigmoid(64) = 1 in bf16: the output is down(silu(gate)),
    which must be the model's down_proj(F.silu(gate) * 1) for each of the 65536 bf16 inputs (the
    product passes every value but subnormals, which vdpbf16ps reads as 0 on both paths)."""
    n = 256
    eye = torch.eye(n, dtype=BF16)  # [S, S]
    ones = torch.ones(n, dtype=BF16)
    for start in range(0, 1 << 16, n):
        g = EVERY_BF16[start : start + n]
        row = torch.cat([torch.tensor([64.0], dtype=BF16), g, ones])[None]
        with torch.inference_mode():  # the model's product for a decode row: the native one
            ref = linear((F.silu(g) * ones)[None], eye)[0]
        assert same_values(_call(row, eye, n), ref), f"inputs {start}..{start + n - 1}"


@needs_kernels
def test_its_sigmoid_is_torchs_on_every_bf16_value():
    """silu(64) * 2^-6 = 1 through a down row of ones: the output is sigmoid(logit), which must be
    torch.sigmoid's on a [1, 1] tensor (the shared expert gate's shape) for every bf16 logit."""
    down = torch.ones(16, 1, dtype=BF16)  # [H, 1]
    tail = torch.tensor([64.0, 2.0**-6], dtype=BF16)
    for logit in EVERY_BF16.view(-1, 1, 1):  # [1, 1] each
        got = _call(torch.cat([logit[0], tail])[None], down, 16)
        assert same_values(got, torch.sigmoid(logit)[0].expand(16)), logit.item()
