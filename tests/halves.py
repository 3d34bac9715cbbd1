"""What the decode-block tests share: a layer's attention half in one native call checked against
the modules one by one, and runs at a chosen torch thread count."""

from __future__ import annotations

from contextlib import contextmanager

import torch


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
