"""The native decode-attention kernel: one query token per sequence over its paged bf16 history,
read through the block table. Against plain softmax attention in float64, and in the engine against
torch's path."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from hybridmoe import env, native
from hybridmoe.engine.paged_kv import PagedKVCache, PagedKVContext
from hybridmoe.native import bf16
from tests.tiny import bf16_batch_greedy

needs_kernels = pytest.mark.skipif(
    not native.cpu_runs_kernels(), reason="needs a CPU with AVX2 and FMA"
)
# the scores and the values' sums on AMX tiles, and the AVX-512 path (every CPU with the kernels);
# where the CPU has no tiles, asking for them leaves the AVX-512 path on
TILES = [False, True]


@pytest.fixture
def tiles(request):
    """Runs the test with the decode attention on the AMX tiles or off them."""
    on = bf16.use_amx(request.param)
    assert on == (request.param and bf16.cpu_has_amx())  # granted wherever the CPU has them
    yield on
    bf16.use_amx(env.amx_enabled())


LENGTHS = [1, 15, 16, 17, 1100]


def reference(q, k, v, scale):
    """q: [h, d], k: [L, kvh, d], v: [L, kvh, dv] -> [h, dv] in float64; query head i uses KV head
    i // (h // kvh), as transformers' repeat_kv."""
    groups = q.shape[0] // k.shape[1]
    k, v = (
        k.double().repeat_interleave(groups, 1),
        v.double().repeat_interleave(groups, 1),
    )  # [L, h, d]
    p = (torch.einsum("hd,lhd->hl", q.double(), k) * scale).softmax(-1)  # [h, L]
    return torch.einsum("hl,lhd->hd", p, v)


def paged_batch(heads, kv_heads, d, dv, block_size, gen, lengths=LENGTHS):
    """Pools holding len(lengths) histories in shuffled blocks, their tables, and queries on the odd
    rows of [2S, h, d] (the even rows stand for other sequences' tokens, which the kernel must
    skip)."""
    counts = [(n + block_size - 1) // block_size for n in lengths]
    num_blocks = sum(counts) + 7  # a few blocks nobody uses
    k_pool = torch.randn(num_blocks * block_size, kv_heads, d, generator=gen).to(torch.bfloat16)
    v_pool = torch.randn(num_blocks * block_size, kv_heads, dv, generator=gen).to(torch.bfloat16)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables, used = [], 0
    for c in counts:
        tables.append(order[used : used + c])
        used += c
    q = torch.randn(2 * len(lengths), heads, d, generator=gen).to(torch.bfloat16)
    return q, k_pool, v_pool, tables


def history(pool, table, length, block_size):
    pos = torch.arange(length)
    return pool[
        torch.tensor(table)[pos // block_size] * block_size + pos % block_size
    ]  # [L, kvh, d]


def run_kernel(q, k_pool, v_pool, tables, lengths, block_size, scale, out):
    starts = [0]
    for t in tables[:-1]:
        starts.append(starts[-1] + len(t))
    int32 = dict(dtype=torch.int32)
    rows = torch.arange(1, 2 * len(lengths), 2, **int32)
    native.decode_attention(
        q,
        k_pool,
        v_pool,
        torch.tensor([b for t in tables for b in t], **int32),
        torch.tensor(starts, **int32),
        torch.tensor(lengths, **int32),
        rows,
        block_size,
        scale,
        out,
    )


# MHA and GQA; head sizes that are multiples of 32 and ones that are not (masked tails), dv != d
LAYOUTS = [(9, 3, 64, 64), (32, 4, 128, 128), (4, 4, 64, 64), (8, 2, 80, 80), (6, 3, 16, 40)]


@needs_kernels
@pytest.mark.parametrize("tiles", TILES, indirect=True)
@pytest.mark.parametrize("block_size", [16, 4])
@pytest.mark.parametrize("heads, kv_heads, d, dv", LAYOUTS)
def test_kernel_matches_softmax_attention_in_float64(heads, kv_heads, d, dv, block_size, tiles):
    gen = torch.Generator().manual_seed(heads * 1000 + d + block_size)
    q, k_pool, v_pool, tables = paged_batch(heads, kv_heads, d, dv, block_size, gen)
    scale = d**-0.5
    out = torch.full((len(q), heads, dv), 7.0)  # [2S, h, dv] fp32
    run_kernel(q, k_pool, v_pool, tables, LENGTHS, block_size, scale, out)
    for s, (table, length) in enumerate(zip(tables, LENGTHS)):
        k, v = (
            history(k_pool, table, length, block_size),
            history(v_pool, table, length, block_size),
        )
        want = reference(q[2 * s + 1], k, v, scale)
        # fp32 sums of exact bf16 products, exp to ~2e-7: far below bf16's 4e-3
        assert (out[2 * s + 1].double() - want).abs().max() < 1e-5, (s, length)
        assert torch.all(out[2 * s] == 7.0)  # other rows untouched
    # bf16 output: the fp32 result rounded once
    out16 = torch.zeros(len(q), heads, dv, dtype=torch.bfloat16)
    run_kernel(q, k_pool, v_pool, tables, LENGTHS, block_size, scale, out16)
    assert torch.equal(out16[1::2], out[1::2].to(torch.bfloat16))


@needs_kernels
def test_the_tiles_take_the_attention_where_the_cpu_has_them():
    """On an AMX CPU the scores and the weighted sums of values come from the tiles (HYBRIDMOE_AMX
    unset): their bits differ from the AVX-512 path's (the same products summed in another order),
    both within fp32 rounding of attention in float64; head sizes the tiles do not take (keys of
    16, not whole tiles of 32; values of 40, not whole tiles of 16) keep the AVX-512 path, bit for
    bit. Without AMX, asking for the tiles changes nothing."""
    amx = bf16.cpu_has_amx() and bf16.isa() == bf16.NATIVE  # the emulated build: no tiles
    assert bf16.use_amx(True) == amx
    cases = [(32, 4, 128, 128, not amx), (8, 2, 80, 80, not amx), (6, 3, 16, 40, True)]
    try:
        for heads, kv_heads, d, dv, same in cases:
            gen = torch.Generator().manual_seed(d)
            q, k_pool, v_pool, tables = paged_batch(heads, kv_heads, d, dv, 16, gen)
            outs = []
            for on in (True, False):
                bf16.use_amx(on)
                out = torch.zeros(len(q), heads, dv)
                run_kernel(q, k_pool, v_pool, tables, LENGTHS, 16, d**-0.5, out)
                outs.append(out[1::2])
            assert torch.equal(outs[0], outs[1]) == same, (d, same)
            assert (outs[0] - outs[1]).abs().max() < 2e-6
    finally:
        bf16.use_amx(env.amx_enabled())


@needs_kernels
@pytest.mark.parametrize("tiles", TILES, indirect=True)
@pytest.mark.parametrize(
    "heads, kv_heads, d, dv",
    [(32, 4, 128, 128), (9, 3, 64, 64), (16, 16, 128, 128), (8, 2, 64, 64)],
)
def test_a_prefill_chunks_rows_give_each_row_its_bits_alone(heads, kv_heads, d, dv, tiles):
    """A prefill chunk's rows come as sequences of one history, lengths 250..289 (on the tiles, as
    many rows at a time as one tile holds with their heads of a KV head: 2, 5, 8 and 4 here, their
    keys and values read once for all): each row's bits are those it has in a call of its own, and
    the result is attention (float64)."""
    gen = torch.Generator().manual_seed(d + heads)
    block_size, total = 16, 289
    q, k_pool, v_pool, tables = paged_batch(heads, kv_heads, d, dv, block_size, gen, [total])
    lengths = list(range(250, total + 1))
    table = tables[0]
    q = torch.randn(len(lengths), heads, d, generator=gen).to(torch.bfloat16)
    int32 = dict(dtype=torch.int32)

    def call(rows):
        out = torch.zeros(len(lengths), heads, dv)
        native.decode_attention(
            q,
            k_pool,
            v_pool,
            torch.tensor(table, **int32),
            torch.zeros(len(rows), **int32),  # one table for every row
            torch.tensor([lengths[i] for i in rows], **int32),
            torch.tensor(rows, **int32),
            block_size,
            d**-0.5,
            out,
        )
        return out

    together = call(list(range(len(lengths))))
    for i in (0, 1, 2, 17, len(lengths) - 1):
        assert torch.equal(call([i])[i], together[i]), i
        want = reference(
            q[i],
            history(k_pool, table, lengths[i], block_size),
            history(v_pool, table, lengths[i], block_size),
            d**-0.5,
        )
        assert (together[i].double() - want).abs().max() < 1e-5


@needs_kernels
def test_hybridmoe_amx_0_keeps_the_attention_off_the_tiles():
    code = "from hybridmoe.native import bf16; print(bf16.amx_active())"
    for value, want in (("0", "False"), ("1", str(bf16.cpu_has_amx()))):
        run = subprocess.run(
            [sys.executable, "-c", code],
            env={**os.environ, "HYBRIDMOE_AMX": value},
            capture_output=True,
            text=True,
            check=True,
        )
        assert run.stdout.strip() == want, (value, run.stdout, run.stderr)


@needs_kernels
@pytest.mark.parametrize("tiles", TILES, indirect=True)
def test_the_sequences_shared_over_threads_give_the_same_bits(tiles):
    """A prefill chunk's rows come as sequences of lengths 1..n: shared out over the kernels'
    threads, each is computed alone, so one thread and two give the same bits."""
    lengths = list(range(1, 40)) + [300, 2, 129]
    gen = torch.Generator().manual_seed(11)
    q, k_pool, v_pool, tables = paged_batch(8, 2, 64, 64, 16, gen, lengths=lengths)
    outs, before = [], torch.get_num_threads()
    try:
        for threads in (1, 2):  # the kernels take torch's thread count (native/threads.py)
            torch.set_num_threads(threads)
            out = torch.zeros(len(q), 8, 64)  # [2S, h, dv] fp32
            run_kernel(q, k_pool, v_pool, tables, lengths, 16, 0.125, out)
            outs.append(out)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(outs[0], outs[1])
    s = len(lengths) - 2  # and the result is attention: one sequence against float64
    want = reference(
        q[2 * s + 1],
        history(k_pool, tables[s], lengths[s], 16),
        history(v_pool, tables[s], lengths[s], 16),
        0.125,
    )
    assert (outs[1][2 * s + 1].double() - want).abs().max() < 1e-5


@needs_kernels
def test_large_scores_do_not_overflow_the_softmax():
    gen = torch.Generator().manual_seed(5)
    q, k_pool, v_pool, tables = paged_batch(4, 2, 64, 64, 16, gen, lengths=[3, 300])
    q = q * 300  # scores in the thousands: exp without the maximum subtracted would overflow
    out = torch.zeros(len(q), 4, 64)
    run_kernel(q, k_pool, v_pool, tables, [3, 300], 16, 0.125, out)
    for s, (table, length) in enumerate(zip(tables, [3, 300])):
        want = reference(
            q[2 * s + 1],
            history(k_pool, table, length, 16),
            history(v_pool, table, length, 16),
            0.125,
        )
        assert torch.isfinite(out[2 * s + 1]).all()
        assert (
            out[2 * s + 1].double() - want
        ).abs().max() < 1e-3  # scores near ties: fp32 rounding of s


class Counting:
    def __init__(self, monkeypatch):
        self.calls, real = [], native.decode_attention

        def spy(*args):
            self.calls.append(len(args[6]))  # sequences in the call
            real(*args)

        monkeypatch.setattr(native, "decode_attention", spy)


def attention_layer(dtype):
    from hybridmoe.layers.attention import Attention

    class Cfg(dict):
        def get(self, key, default=None):
            return super().get(key, default)

        def head_dim(self):
            return 64

    cfg = Cfg(hidden_size=256, num_attention_heads=9, num_key_value_heads=3)
    torch.manual_seed(0)
    layer = Attention(cfg, 0, rotary=None)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.05)
    return layer.to(dtype)


@needs_kernels
def test_the_layer_takes_the_kernel_for_one_token_sequences_only(monkeypatch):
    """A step with two decode tokens and a 5-token prefill chunk: the kernel takes the decode
    sequences (in one call), causal_attention the chunk; the result is within bf16 rounding of
    causal_attention everywhere."""
    layer, gen = attention_layer(torch.bfloat16), torch.Generator().manual_seed(1)
    cache = PagedKVCache(num_blocks=32, block_size=4)
    tables, starts, seq_lens = [[3, 9, 1, 20], [7], [30, 2, 5, 11]], [9, 2, 7], [1, 1, 5]
    T = sum(seq_lens)
    x = torch.randn(T, 256, generator=gen).to(torch.bfloat16)
    cos_sin = (torch.ones(T, 64), torch.zeros(T, 64))
    # histories: fill the pools as earlier steps would have
    before = PagedKVContext(cache, tables, [0, 0, 0], starts)
    with torch.inference_mode():
        layer(
            torch.randn(sum(starts), 256, generator=gen).to(torch.bfloat16),
            (torch.ones(sum(starts), 64), torch.zeros(sum(starts), 64)),
            before,
        )
        pools = tuple(p.clone() for p in cache.pools[0])
        spy = Counting(monkeypatch)
        got = layer(x, cos_sin, PagedKVContext(cache, tables, starts, seq_lens))
        assert spy.calls == [2]
        cache.pools[0] = pools  # the same histories again, through torch's path
        monkeypatch.setattr(native, "attention_applies", lambda *a: False)
        want = layer(x, cos_sin, PagedKVContext(cache, tables, starts, seq_lens))
    assert spy.calls == [2]
    assert torch.allclose(
        got.float(), want.float(), rtol=2**-6, atol=2e-3 * want.abs().max().item()
    )
    assert torch.equal(got[2:], want[2:])  # the prefill chunk's rows: the same path both times


def test_other_contexts_and_dtypes_keep_torchs_path(monkeypatch):
    from tests.contiguous_kv import BatchKVContext, SequenceKV

    spy = Counting(monkeypatch)
    gen = torch.Generator().manual_seed(2)
    with torch.inference_mode():
        # a context without the paged view
        layer = attention_layer(torch.bfloat16)
        caches = [SequenceKV(), SequenceKV()]
        layer(
            torch.randn(5, 256, generator=gen).to(torch.bfloat16),
            (torch.ones(5, 64), torch.zeros(5, 64)),
            BatchKVContext(caches, [3, 2]),
        )
        layer(
            torch.randn(2, 256, generator=gen).to(torch.bfloat16),
            (torch.ones(2, 64), torch.zeros(2, 64)),
            BatchKVContext(caches, [1, 1]),
        )
        # fp32 pools
        layer = attention_layer(torch.float32)
        cache = PagedKVCache(num_blocks=8, block_size=4)
        layer(
            torch.randn(2, 256, generator=gen),
            (torch.ones(2, 64), torch.zeros(2, 64)),
            PagedKVContext(cache, [[1], [4, 2]], [2, 5], [1, 1]),
        )
    assert spy.calls == []


@needs_kernels
@needs_kernels
@pytest.mark.parametrize("heads, kv_heads, d, dv", LAYOUTS)
def test_one_sequence_cut_by_kv_heads_over_threads_gives_the_same_bits(heads, kv_heads, d, dv):
    """A decode step of one sequence, fewer sequences than threads: its KV heads are shared out
    over the threads, and each head computed alone gives what one thread gives."""
    gen = torch.Generator().manual_seed(kv_heads * 100 + d)
    q, k_pool, v_pool, tables = paged_batch(heads, kv_heads, d, dv, 16, gen, lengths=[301])
    outs, before = [], torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            out = torch.zeros(len(q), heads, dv)  # [2, h, dv] fp32
            run_kernel(q, k_pool, v_pool, tables, [301], 16, d**-0.5, out)
            outs.append(out)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(outs[0], outs[1])
    want = reference(
        q[1], history(k_pool, tables[0], 301, 16), history(v_pool, tables[0], 301, 16), d**-0.5
    )
    assert (outs[1][1].double() - want).abs().max() < 1e-5
    assert torch.all(outs[1][0] == 0)  # the other row untouched


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])  # heads of 16 and 32, GQA
def test_engine_greedy_output_is_that_of_torchs_attention(arch, tmp_path, monkeypatch):
    generate = bf16_batch_greedy(arch, tmp_path)
    spy = Counting(monkeypatch)
    with_kernel = generate()
    assert spy.calls and max(spy.calls) > 1  # several decode sequences in one call
    monkeypatch.setattr(native, "attention_applies", lambda *a: False)
    assert generate() == with_kernel
