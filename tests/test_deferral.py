"""Expert deferral in the engine (--defer-experts N): in decode, each token's N lowest-weight
experts join the next MoE layer's output. Checked against a decoder loop written here from the
definition, and for N = 0 against the engine without it, bit for bit."""

from __future__ import annotations

import pytest
import torch

from hybridmoe.experts.plan.profiles import PROFILES
from hybridmoe.experts.run.ffn import expert_ffn
from hybridmoe.experts.run.hybrid_runtime import HybridConfig, make_runtime
from hybridmoe.loader import load_model
from tests.contiguous_kv import BatchKVContext, SequenceKV, forward_step
from tests.tiny import build_tiny

PROMPT = [3, 17, 5, 42, 8, 11]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def model_with(path, defer: int | None, device: str = "cpu"):
    """defer None: the runtime as built without the option."""
    gpu = dict(policy="value", budget="0.5") if device != "cpu" else {}
    config = HybridConfig(device=device, cpu_clock="model", **gpu)
    if defer is not None:
        config.defer_experts = defer
    return load_model(
        path,
        runtime_factory=lambda shape, dtype: make_runtime(
            shape, dtype, config, PROFILES["this-machine-2core"]
        ),
        progress=False,
    )


@torch.inference_mode()
def reference_decode(model, cache: SequenceKV, token: int, pos: int, defer: int) -> torch.Tensor:
    """One decode step through the decoder layers by hand: every MoE block computes its experts
    one by one from the store; the `defer` of lowest router weight are summed aside and added to
    the next MoE block's output (none deferred at the last). Logits [V]."""
    x = model.embed_tokens(torch.tensor([token]))  # [1, H]
    cos_sin = model.rotary.cos_sin(torch.tensor([pos]))
    ctx = BatchKVContext([cache], [1])
    moe = [
        i
        for i, layer in enumerate(model.layers)
        if hasattr(getattr(layer, layer.ffn_name), "route")
    ]
    carried = None
    for i, layer in enumerate(model.layers):
        x = x + layer.self_attn(layer.input_layernorm(x), cos_sin, ctx)
        h = layer.post_attention_layernorm(x)
        ffn = getattr(layer, layer.ffn_name)
        if i not in moe:
            x = x + ffn(h)
            continue
        ids, weights = ffn.route(h)  # [1, K]
        n = defer if i != moe[-1] else 0
        order = sorted(range(ids.shape[1]), key=lambda k: weights[0, k].item())
        later = set(order[:n])
        out, aside = torch.zeros_like(h), torch.zeros_like(h)
        for k in range(ids.shape[1]):
            y = weights[0, k] * expert_ffn(h, model.runtime.store.get(ffn.layer, int(ids[0, k])))
            if k in later:
                aside = aside + y
            else:
                out = out + y
        if carried is not None:
            out = out + carried
        if getattr(ffn, "shared_experts", None) is not None:  # DeepSeek's, always on
            out = out + ffn.shared_experts(h)
        carried = aside if n else None
        x = x + out
    return model.logits(model.norm(x))[0]


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_deferred_decode_matches_the_definition(arch, tmp_path):
    build_tiny(arch, tmp_path)
    engine, plain = model_with(tmp_path, 1), model_with(tmp_path, 0)
    ref_cache, cache = SequenceKV(), SequenceKV()
    forward_step(plain, ref_cache, PROMPT, 0)
    forward_step(engine, cache, PROMPT, 0)
    token = PROMPT[-1]
    for step in range(4):
        pos = len(PROMPT) + step
        got = forward_step(engine, cache, [token], pos, decode=True)
        want = reference_decode(plain, ref_cache, token, pos, defer=1)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        token = int(want.argmax())


def test_no_deferral_is_the_engine_bit_for_bit_and_prefill_is_never_deferred(tmp_path):
    build_tiny("qwen3_moe", tmp_path)
    plain, none, some = (model_with(tmp_path, n) for n in (None, 0, 2))
    caches = [SequenceKV() for _ in range(3)]
    outs = [forward_step(m, c, PROMPT, 0) for m, c in zip((plain, none, some), caches)]
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])  # a prefill
    decoded = [
        forward_step(m, c, [7], len(PROMPT), decode=True)
        for m, c in zip((plain, none, some), caches)
    ]
    assert torch.equal(decoded[0], decoded[1])
    assert not torch.equal(decoded[0], decoded[2])  # deferral is an approximation


def test_deferral_on_the_emulated_gpu_gives_the_cpu_runtimes_result(tmp_path):
    build_tiny("qwen3_moe", tmp_path)
    cpu, gpu = model_with(tmp_path, 1), model_with(tmp_path, 1, device="emulated")
    a, b = SequenceKV(), SequenceKV()
    forward_step(cpu, a, PROMPT, 0)
    forward_step(gpu, b, PROMPT, 0)
    for pos in range(len(PROMPT), len(PROMPT) + 3):
        assert torch.equal(
            forward_step(cpu, a, [5], pos, decode=True), forward_step(gpu, b, [5], pos, decode=True)
        )
