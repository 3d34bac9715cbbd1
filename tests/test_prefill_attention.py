"""The native prefill-attention kernel: a chunk of n queries, the last n of L positions, over its
bf16 history with a causal mask. Against plain softmax attention in float64, and in the engine
against torch's path."""

from __future__ import annotations

import pytest
import torch

from hybridmoe import native
from hybridmoe.layers import attention
from tests.tiny import bf16_batch_greedy

needs_kernels = pytest.mark.skipif(
    not native.cpu_runs_kernels(), reason="needs a CPU with AVX2 and FMA"
)


def reference(q, k, v, scale):
    """q: [n, h, d], k: [L, kvh, d], v: [L, kvh, dv] -> [n, h, dv] in float64; query i sits at
    position L - n + i and sees keys 0..L-n+i; query head i uses KV head i // (h // kvh)."""
    n, L, groups = q.shape[0], k.shape[0], q.shape[1] // k.shape[1]
    k, v = (
        k.double().repeat_interleave(groups, 1),
        v.double().repeat_interleave(groups, 1),
    )  # [L, h, d]
    scores = torch.einsum("nhd,lhd->hnl", q.double(), k) * scale  # [h, n, L]
    visible = torch.arange(L)[None, :] <= torch.arange(n)[:, None] + (L - n)  # [n, L]
    return torch.einsum("hnl,lhd->nhd", scores.masked_fill(~visible, float("-inf")).softmax(-1), v)


def inputs(n, L, heads, kv_heads, d, dv, seed):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(n, heads, d, generator=gen).to(torch.bfloat16)
    k = torch.randn(L, kv_heads, d, generator=gen).to(torch.bfloat16)
    v = torch.randn(L, kv_heads, dv, generator=gen).to(torch.bfloat16)
    return q, k, v


# MHA and GQA; head sizes that are multiples of 32 and ones that are not (odd, masked tails),
# dv != d
LAYOUTS = [
    (9, 3, 64, 64),
    (32, 4, 128, 128),
    (4, 4, 64, 64),
    (8, 2, 80, 80),
    (6, 3, 16, 40),
    (4, 4, 23, 12),
]
# (n, L): single queries, a fresh prompt (L = n), a later chunk (L > n); n off the 64-key and
# 48-row blocks, and chunks long enough that whole key blocks lie above some rows' diagonal
CHUNKS = [
    (1, 1),
    (1, 70),
    (2, 2),
    (3, 3),
    (3, 130),
    (17, 17),
    (50, 50),
    (130, 130),
    (37, 200),
    (100, 301),
]


@needs_kernels
@pytest.mark.parametrize("heads, kv_heads, d, dv", LAYOUTS)
def test_kernel_matches_softmax_attention_in_float64(heads, kv_heads, d, dv):
    for n, L in CHUNKS:
        q, k, v = inputs(n, L, heads, kv_heads, d, dv, seed=n * 1000 + L + d)
        want = reference(q, k, v, d**-0.5)
        got = native.prefill_attention(q, k, v, d**-0.5, out_dtype=torch.float32)
        # fp32 sums of exact bf16 products, exp to ~2e-7: far below bf16's 4e-3
        assert (got.double() - want).abs().max() < 1e-5, (n, L)
        # bf16 output: the fp32 result rounded once, so within half a bf16 step of the exact result
        got16 = native.prefill_attention(q, k, v, d**-0.5)
        assert torch.equal(got16, got.to(torch.bfloat16)), (n, L)
        assert torch.all((got16.double() - want).abs() <= 2**-8 * want.abs() + 1e-5), (n, L)


@needs_kernels
def test_a_query_sees_the_same_keys_whatever_chunk_it_came_in():
    """Query i of a chunk over L positions gives what it gives alone over its first L - n + i + 1
    positions: keys after it are masked, in the key blocks it shares with later rows and in the
    blocks it skips."""
    q, k, v = inputs(200, 260, 9, 3, 64, 64, seed=7)
    chunk = native.prefill_attention(q, k, v, 0.125, out_dtype=torch.float32)
    for i in [0, 1, 15, 16, 47, 63, 64, 100, 199]:
        alone = native.prefill_attention(
            q[i : i + 1], k[: 61 + i], v[: 61 + i], 0.125, out_dtype=torch.float32
        )
        torch.testing.assert_close(chunk[i], alone[0], rtol=1e-5, atol=1e-6)


@needs_kernels
def test_histories_may_be_strided_views():
    """K and V as rows of wider pools (a paged pool's consecutive blocks, MLA's split keys and
    values)."""
    gen = torch.Generator().manual_seed(9)
    pool = torch.randn(400, 2, 3, 48, generator=gen).to(torch.bfloat16)  # [slots, k|v, kvh, d]
    q = torch.randn(90, 6, 40, generator=gen).to(torch.bfloat16)
    k, v = pool[50:250, 0, :, :40], pool[50:250, 1, :, 8:]  # [L, kvh, 40] each, strided
    want = reference(q, k, v, 0.2)
    got = native.prefill_attention(q, k, v, 0.2, out_dtype=torch.float32)
    assert (got.double() - want).abs().max() < 1e-5


@needs_kernels
def test_large_scores_do_not_overflow_the_softmax():
    q, k, v = inputs(70, 150, 4, 2, 64, 64, seed=5)
    q = (
        q * 300
    )  # scores in the thousands: exp without the running maximum subtracted would overflow
    got = native.prefill_attention(q, k, v, 0.125, out_dtype=torch.float32)
    assert torch.isfinite(got).all()
    assert (
        got.double() - reference(q, k, v, 0.125)
    ).abs().max() < 1e-3  # near ties: fp32 rounding of s


@needs_kernels
def test_causal_attention_takes_the_kernel_for_bf16_chunks_only(monkeypatch):
    calls = []
    real = native.prefill_attention
    monkeypatch.setattr(
        native, "prefill_attention", lambda *a: calls.append(a[0].shape[0]) or real(*a)
    )
    cases = [(5, torch.bfloat16, False), (1, torch.bfloat16, False), (5, torch.float32, False)]
    cases.append((5, torch.bfloat16, True))  # a training pass: the kernel has no backward
    for n, dtype, grad in cases:
        q, k, v = (t.to(dtype) for t in inputs(n, 9, 4, 2, 32, 32, seed=n))
        want = reference(q, k, v, 0.2)
        with torch.set_grad_enabled(grad):
            got = attention.causal_attention(q, k, v, 0.2)
        assert got.dtype == dtype and (got.double() - want).abs().max() < 1e-2
    assert calls == [5]


@needs_kernels
@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize(
    "arch", ["llama", "qwen3_moe", "deepseek_v2"]
)  # heads of 16, 32 (GQA); MLA
def test_engine_greedy_output_is_that_of_torchs_attention(arch, tmp_path, monkeypatch):
    generate = bf16_batch_greedy(arch, tmp_path)
    calls = []
    real = native.prefill_attention
    monkeypatch.setattr(
        native, "prefill_attention", lambda *a: calls.append(a[0].shape[0]) or real(*a)
    )
    with_kernel = generate()
    assert calls and max(calls) > 16  # prompts' chunks went through the kernel
    monkeypatch.setattr(native, "prefill_applies", lambda *a: False)
    calls.clear()
    assert generate() == with_kernel
    assert calls == []
