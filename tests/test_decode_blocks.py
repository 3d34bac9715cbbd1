"""A decode step's blocks in one native call each against the layers' own paths, step by step inside
real engine runs: a layer's attention half (native.decoder_attention: the same output bits and KV
entries), a token's routed experts with their mix (native.moe_tokens in CPURuntime) and a Qwen2-MoE
layer's MoE half (SharedExpertMoE.decoder_half: the same output bits and the same observations)."""

from __future__ import annotations

import pytest
import torch

from hybridmoe import native
from hybridmoe.engine.generate import generate_ids
from hybridmoe.engine.paged_kv import PagedKVCache, PagedKVContext
from hybridmoe.engine.sampler import SamplingParams
from hybridmoe.layers.attention import Attention
from hybridmoe.layers.decoder import DecoderLayer
from hybridmoe.layers.moe import SparseMoE
from hybridmoe.loader import load_model
from hybridmoe.models.qwen2_moe import SharedExpertMoE
from hybridmoe.native import bf16 as native_bf16
from tests.halves import (
    attention_half_checked,
    decoder_halves_checked,
    layers_loop_off,
    moe_halves_checked,
    torch_threads,
)
from tests.tiny import bf16_batch_greedy, build_tiny

needs_kernels = pytest.mark.skipif(
    not native.cpu_runs_kernels(), reason="needs a CPU with AVX2 and FMA"
)


# q/k/v biases without o bias (Qwen2-MoE), per-head q/k norms (Qwen3-MoE), neither (Llama)
@needs_kernels
@pytest.mark.parametrize("arch", ["qwen2_moe", "qwen3_moe", "llama"])
@pytest.mark.parametrize("threads, least_bytes", [(1, None), (2, None), (2, 0)])
def test_a_layers_attention_half_in_one_call_gives_the_layers_bits(
    arch, threads, least_bytes, tmp_path, monkeypatch
):
    """The input norm, the attention block, the residual sum and the post-attention norm in one
    call (Attention.decoder_half) against the modules one by one, on every decode step's input:
    the same outputs and the same KV entries written; least_bytes 0: every product of the block
    shared out over the threads, however small (q, k and v in one region)."""
    if least_bytes is not None:
        monkeypatch.setattr(native_bf16, "THREADED_MIN_BYTES", least_bytes)
    generate = bf16_batch_greedy(arch, tmp_path / arch)
    forward, compared = DecoderLayer.forward, []

    def both(self, x, cos_sin, ctx):
        rows = attention_half_checked(self, x, cos_sin, ctx, monkeypatch, _modules_only)
        if rows is not None:
            compared.append(rows)
        return forward(self, x, cos_sin, ctx)

    monkeypatch.setattr(DecoderLayer, "forward", both)
    layers_loop_off(monkeypatch)  # every decode step through the layers' own calls
    with torch_threads(threads):
        generate()
    assert len(compared) > 20 and max(compared) > 1  # decode batches of several sequences too


@needs_kernels
def test_the_block_leaves_steps_with_a_prefill_chunk_to_the_layer(tmp_path, monkeypatch):
    """A step that also brings a prompt chunk attends through the layer's own path."""
    generate = bf16_batch_greedy("qwen2_moe", tmp_path / "m")
    taken = []
    table = Attention._block_table

    def spy(self, x, cos_sin, ctx):
        t = table(self, x, cos_sin, ctx)
        taken.append((t is not None, max(ctx.seq_lens)))
        return t

    monkeypatch.setattr(Attention, "_block_table", spy)
    with torch.inference_mode():
        generate()
    assert {longest for used, longest in taken if used} == {1}
    assert any(not used for used, _ in taken)


@needs_kernels
@pytest.mark.parametrize("arch", ["qwen2_moe", "qwen3_moe", "mixtral"])
def test_a_tokens_experts_in_one_call_give_the_runtimes_bits(arch, tmp_path, monkeypatch):
    """Every MoE layer of every decode token runs both ways on the same input: the one-call path
    (moe_tokens) and the runtime's experts_ffn + combine_token must give the same bits. (Qwen2-MoE's
    blocks through the runtime: their own two-call path is off here, tested below.)"""
    build_tiny(arch, tmp_path / arch, seed=3)
    model = load_model(tmp_path / arch, dtype=torch.bfloat16, progress=False)
    monkeypatch.setattr(SharedExpertMoE, "decoder_half", lambda *a: None)
    moe_halves_checked(model, monkeypatch, in_blocks=False)


@needs_kernels
def test_the_blocks_table_follows_pools_that_moved(tmp_path):
    """A new KV cache may put one layer pool where an old one was and the other elsewhere: the
    table must then point at the new pools, not at memory that was freed."""
    build_tiny("qwen2_moe", tmp_path / "m", seed=3)
    model = load_model(tmp_path / "m", dtype=torch.bfloat16, progress=False)
    attn = model.layers[0].self_attn
    cache = PagedKVCache(num_blocks=4, block_size=4)
    ctx = PagedKVContext(cache, [[0, 1]], [5], [1])
    x = torch.randn(1, 64).to(torch.bfloat16)
    cos_sin = model.rotary.cos_sin(torch.tensor([5]))
    with torch.inference_mode():
        attn(x, cos_sin, ctx)  # the first write makes the pools
        k_pool, v_pool = cache.pools[0]
        table = attn._block_table(x, cos_sin, ctx).clone()
        assert table[10:12].tolist() == [k_pool.data_ptr(), v_pool.data_ptr()]
        cache.pools[0] = (k_pool, v_pool.clone())  # same K pool, the V pool elsewhere
        moved = attn._block_table(x, cos_sin, ctx)
    assert moved[10:12].tolist() == [k_pool.data_ptr(), cache.pools[0][1].data_ptr()]


@needs_kernels
@pytest.mark.parametrize("threads", [1, 2])
def test_a_qwen2_moe_layers_moe_half_in_two_calls_gives_the_layers_bits(
    threads, tmp_path, monkeypatch
):
    """The router, the routed and the shared experts, their sum and the residual sum of a decode
    token in two native calls (SharedExpertMoE.decoder_half) against the modules one by one, on
    every decode step's input of every layer; the runtime's observers see each layer once."""
    build_tiny("qwen2_moe", tmp_path / "m", seed=3)
    model = load_model(tmp_path / "m", dtype=torch.bfloat16, progress=False)
    decoder_halves_checked(model, SharedExpertMoE, monkeypatch, threads)


@needs_kernels
@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "olmoe"])
@pytest.mark.parametrize("threads", [1, 2])
def test_a_sparse_moe_layers_moe_half_gives_the_layers_bits(arch, threads, tmp_path, monkeypatch):
    """A block without shared experts: the router's choice, the routed experts and their mix
    in one native call (native.moe_tokens) and the residual sum (SparseMoE.decoder_half) against
    the modules through the runtime, on every decode step's input of every layer."""
    build_tiny(arch, tmp_path / arch, seed=4)
    model = load_model(tmp_path / arch, dtype=torch.bfloat16, progress=False)
    decoder_halves_checked(model, SparseMoE, monkeypatch, threads, fused_first=arch != "olmoe")


@needs_kernels
def test_the_moe_half_runs_the_steps_the_modules_run(tmp_path):
    """With the MoE half in native calls, the same greedy tokens and the same runtime statistics
    as with the modules alone."""
    build_tiny("qwen2_moe", tmp_path / "m", seed=5)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    runs = []
    for fused in (True, False):
        model = _qwen2_moe(tmp_path / "m", fused)
        with torch.inference_mode():
            tokens = list(generate_ids(model, [3, 1, 4, 1, 5, 9, 2, 6], params))
        stats = model.runtime.stats.total
        runs.append((tokens, {k: v for k, v in stats.items() if not k.endswith("_s")}))
    assert runs[0] == runs[1]


@needs_kernels
def test_the_moe_half_hands_the_observers_the_same_look_ahead_hint(tmp_path):
    """The observers (a trace recorder among them) get the next layer's router on this layer's
    input from the native MoE half as from the modules: the same probabilities, step by step."""
    build_tiny("qwen2_moe", tmp_path / "m", seed=7)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    runs = []
    for fused in (True, False):
        model = _qwen2_moe(tmp_path / "m", fused)
        hints = []

        def on_layer(step, o, ids, weights, report, hint=None, hints=hints):
            hints.append(None if hint is None else hint(1))

        model.runtime.stats.on_layer = on_layer
        with torch.inference_mode():
            list(generate_ids(model, [3, 1, 4, 1, 5, 9], params))
        runs.append(hints)
    fused, modules = runs
    assert len(fused) == len(modules) and any(h is not None for h in fused)
    for a, b in zip(fused, modules):
        assert (a is None and b is None) or torch.equal(a, b)


def _qwen2_moe(path, fused: bool):
    """The tiny Qwen2-MoE at `path`, its MoE half in native calls or (fused False) in modules."""
    model = load_model(path, dtype=torch.bfloat16, progress=False)
    if not fused:
        model.runtime.token_experts = lambda layer: None
    return model


def _modules_only(m) -> None:
    """Under monkeypatch context m, no attention block takes the native call."""
    m.setattr(Attention, "_block_table", lambda *a: None)
