"""What the decode-block tests share: a layer's attention half in one native call checked against
the modules one by one, a MoE layer's native token path checked against the runtime's, and runs
at a chosen torch thread count."""

from __future__ import annotations

from contextlib import contextmanager

import torch

from hybridmoe import native
from hybridmoe.engine.generate import generate_ids
from hybridmoe.engine.sampler import SamplingParams
from hybridmoe.experts.run.runtime import CPURuntime
from hybridmoe.layers.moe import SparseMoE
from hybridmoe.models.base import CausalLM


def attention_half_checked(layer, x, cos_sin, ctx, monkeypatch, switch_off) -> int | None:
    """Where `layer`'s attention half runs in one native call on this step, assert its outputs
    (x + attention, the post-attention norm of that) and the KV entries it wrote equal the modules'
    run one by one with `switch_off(m)` applied in a monkeypatch context m, and return the step's
    rows; else None."""
    attn = layer.self_attn
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    half = attn.decoder_half(x, norms, cos_sin, ctx)
    if half is None:
        return None
    k_pool, v_pool = (p.clone() for p in ctx.pools_of(attn.layer))
    with monkeypatch.context() as m:
        switch_off(m)
        x_ref = x + attn(layer.input_layernorm(x), cos_sin, ctx)
    assert torch.equal(half[0], x_ref)
    assert torch.equal(half[1], layer.post_attention_layernorm(x_ref))
    k_ref, v_ref = ctx.pools_of(attn.layer)
    assert torch.equal(k_pool, k_ref) and torch.equal(v_pool, v_ref)
    return x.shape[0]


def layers_loop_off(m) -> None:
    """Under monkeypatch (context) m, no decode step runs its layers in one native call
    (CausalLM._decode_layers): each layer calls its halves, which the tests below check."""
    m.setattr(CausalLM, "_decode_layers", lambda self, x, cos_sin, ctx, start=0: (0, x))


@contextmanager
def torch_threads(n: int):
    """torch on n threads inside the block, inference mode, the count restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        with torch.inference_mode():
            yield
    finally:
        torch.set_num_threads(before)


def moe_halves_checked(model, monkeypatch, in_blocks: bool) -> None:
    """Decode 16 tokens through the runtime (the blocks' decoder_half off) with every MoE layer's
    native token path (the runtime's `_mix_tokens`)
    checked against the runtime's experts_ffn + combine_token on the same input, bit for bit, and
    assert it ran on every decode token of every layer (its experts' table in blocks where
    `in_blocks`)."""
    layer_of, compared = CPURuntime._layer, []

    def both(self, layer, x, topk_ids, topk_weights, hint, lora=None):
        fast = self._mix_tokens(layer, x, topk_ids, topk_weights)
        out, report = layer_of(self, layer, x, topk_ids, topk_weights, hint, lora)
        if fast is None:
            return out, report
        assert not in_blocks or self._expert_table(layer)[1]  # the experts' table in blocks
        with monkeypatch.context() as m:
            m.setattr(CPURuntime, "_mix_tokens", lambda *a: None)
            ref, _ = layer_of(self, layer, x, topk_ids, topk_weights, hint, lora)
        assert torch.equal(out, ref) and torch.equal(fast[0], ref)
        compared.append(layer)
        return out, report

    monkeypatch.setattr(CPURuntime, "_layer", both)
    monkeypatch.setattr(SparseMoE, "decoder_half", lambda *a: None)  # every token through _layer
    layers_loop_off(monkeypatch)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    with torch.inference_mode():
        assert len(list(generate_ids(model, [5, 17, 3, 40, 9], params))) == 16
    assert len(compared) >= 15 * len(model.runtime.layers)  # every decode token, every layer


def decoder_halves_checked(
    model, block: type, monkeypatch, threads: int = 1, fused_first: bool = True
) -> None:
    """Decode 16 tokens with each MoE block of class `block` checked on every decode step: its
    decoder_half (the native token path) against the modules one by one (x + block(h), through the
    runtime), bit for bit; it must have run on every decode token of every layer, and the runtime's
    observers must see each layer of a token once, with the same choice. Where `fused_first` (a
    model whose attention halves are native), every token's first product on h (first_weight) was
    made by the attention half's call, with F.linear's bits."""
    half, compared, seen, ids, rows = block.decoder_half, [], [], [], []

    def both(self, x, h, row=None):
        if row is not None:  # made in the attention half's call: the product, as F.linear's
            assert torch.equal(row, native.linear(h, self.first_weight()))
            rows.append(row)
        with monkeypatch.context() as m:
            m.setattr(type(self.runtime), "ran_token", lambda *a: seen.append(a[2].tolist()))
            fast = half(self, x, h, row)
        ref = x + self(h)  # the runtime's forward observes the layer
        if fast is not None:
            assert torch.equal(fast, ref)
            compared.append(self.layer)
        return ref

    monkeypatch.setattr(block, "decoder_half", both)
    layers_loop_off(monkeypatch)
    monkeypatch.setattr(
        model.runtime.stats, "on_layer", lambda s, o, i, w, r, hint=None: ids.append(i.tolist())
    )
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    with torch_threads(threads):
        assert len(list(generate_ids(model, [5, 17, 3, 40, 9], params))) == 16
    assert len(compared) == 15 * len(model.runtime.layers)  # every decode token, every layer
    assert seen == [i for i in ids if len(i) == 1]  # the same choice, each decode layer once
    assert len(rows) == (len(compared) if fused_first else 0)  # routers made by attention halves
