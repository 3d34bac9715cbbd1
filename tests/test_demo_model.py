"""The demo MoE built from SmolLM2-135M: a reduced build (first 2 layers, little calibration text)
must load in transformers with its own class and in hybridmoe at fp32 parity, and route for real:
exactly top-k experts per token, and not the same experts for every token."""

from __future__ import annotations

import json

import pytest
import torch

from hybridmoe.demo.build import build, is_complete
from hybridmoe.demo.spec import MoESpec
from hybridmoe.errors import UserError

SPECS = {
    "qwen2_moe": MoESpec(experts=8, top_k=2, shared=0.5),  # shared expert -> Qwen2-MoE
    "mixtral": MoESpec(experts=8, top_k=3, shared=0.0),  # none -> Mixtral
}
CLASSES = {"qwen2_moe": "Qwen2MoeForCausalLM", "mixtral": "MixtralForCausalLM"}


@pytest.fixture(scope="module", params=sorted(SPECS))
def built(request, tmp_path_factory):
    out = tmp_path_factory.mktemp("demo") / "model"
    torch.manual_seed(0)
    build(out, SPECS[request.param], progress=False, layers=2, tokens=1500)
    return request.param, out


@pytest.fixture(scope="module")
def reference(built):
    from transformers import AutoModelForCausalLM

    kind, out = built
    model, info = AutoModelForCausalLM.from_pretrained(
        str(out), dtype=torch.float32, output_loading_info=True
    )
    return kind, out, model.eval(), info


def prompt_ids(
    out, text: str = "The ocean covers most of the planet, and its deep currents"
) -> list[int]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(out))(text)["input_ids"]


def test_transformers_loads_it_with_its_own_class_and_every_weight(reference):
    kind, out, model, info = reference
    assert type(model).__name__ == CLASSES[kind]
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert is_complete(out)
    config = json.loads((out / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in config["chat_template"]


def test_routing_picks_exactly_top_k_distinct_experts_and_varies(reference):
    kind, out, model, _ = reference
    spec = SPECS[kind]
    picked = []
    hooks = [
        layer.mlp.experts.register_forward_pre_hook(lambda _m, args: picked.append(args[1]))
        for layer in model.model.layers
    ]
    with torch.no_grad():
        model(input_ids=torch.tensor([prompt_ids(out)]))
    for h in hooks:
        h.remove()
    assert len(picked) == 2
    for ids in picked:  # [T, k] expert ids per token
        assert ids.shape[1] == spec.top_k
        assert all(len(set(row)) == spec.top_k for row in ids.tolist())
        assert ((ids >= 0) & (ids < spec.experts)).all()
        assert len({tuple(sorted(row)) for row in ids.tolist()}) > 1, "same experts for every token"


def test_hybridmoe_loader_matches_transformers_at_fp32(reference):
    from hybridmoe.loader import load_model
    from tests.contiguous_kv import SequenceKV, forward_step

    _, out, model, _ = reference
    ids = prompt_ids(out)
    with torch.no_grad():
        expected = model(input_ids=torch.tensor([ids])).logits[0, -1]  # [V]
    ours = load_model(out, progress=False)
    got = forward_step(ours, SequenceKV(), ids, 0)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_bad_split_is_a_user_error():
    with pytest.raises(UserError, match="--experts"):
        MoESpec(experts=7, top_k=2, shared=0.5).validate()
    with pytest.raises(UserError, match="--top-k"):
        MoESpec(experts=8, top_k=9, shared=0.5).validate()


def test_a_build_that_fails_halfway_leaves_nothing_behind(tmp_path, monkeypatch):
    from hybridmoe.demo import build as build_module

    def broken(*args, **kwargs):
        raise KeyboardInterrupt  # as if the user pressed Ctrl-C while the experts were fitted

    monkeypatch.setattr(build_module, "fit_model", broken)
    out = tmp_path / "model"
    with pytest.raises(KeyboardInterrupt):
        build(out, SPECS["mixtral"], progress=False, layers=1)
    assert not out.exists() and not is_complete(out)
    assert list(tmp_path.iterdir()) == []  # the temporary directory went too


def test_fit_sees_the_residual_stream_that_transformers_llama_computes():
    """The fit's FFN inputs and post-attention residuals, from hybridmoe's Llama over flat
    unpadded sequences, equal transformers' (the reference) on a left-padded batch of 2."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from hybridmoe.demo import stream

    config = dict(
        vocab_size=97,
        hidden_size=48,
        intermediate_size=80,
        num_hidden_layers=3,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=8,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    torch.manual_seed(1)
    reference = LlamaForCausalLM(LlamaConfig(**config)).eval()
    for p in reference.parameters():  # norms start at 1: make them matter too
        p.data.add_(0.1 * torch.randn_like(p))
    lengths = [11, 6]
    ids = torch.randint(3, 97, (2, max(lengths)))
    mask = (
        torch.arange(max(lengths))[None, :]
        >= torch.tensor([max(lengths) - n for n in lengths])[:, None]
    )
    seen = []  # per layer: (residual after attention, FFN input), both [B, L, H]
    hooks = [
        layer.post_attention_layernorm.register_forward_hook(
            lambda _m, args, out: seen.append((args[0], out))
        )
        for layer in reference.model.layers
    ]
    with torch.no_grad():
        reference(input_ids=ids, attention_mask=mask.long())
    for h in hooks:
        h.remove()

    ours = stream.dense_model(reference.state_dict(), config)
    hidden, cos_sin, seq_lens = stream.embed(ours, stream.real_tokens(ids, mask))
    assert seq_lens == lengths
    for layer, (want_resid, want_x) in zip(ours.layers, seen):
        resid, x = stream.attention_half(layer, hidden, cos_sin, seq_lens)  # [T, H]
        for got, want in ((resid, want_resid[mask]), (x, want_x[mask])):
            err = float((got - want).norm() / want.norm())
            assert err <= 1e-5, err
        with torch.no_grad():
            hidden = resid + layer.mlp(x)
    assert len(seen) == 3


def test_fit_layer_returns_what_the_moe_it_builds_computes():
    """The output fit_layer hands to the next layer equals the MoE FFN written out the way
    Qwen2-MoE runs it: shared expert plus softmax-renormalised top-k experts, one by one."""
    from hybridmoe.demo.fit import fit_layer

    spec = MoESpec(experts=4, top_k=2, shared=0.5, ffn=64)
    torch.manual_seed(2)
    x, target = torch.randn(400, 16), torch.randn(400, 16)  # [T, H]
    gate, up, down = torch.randn(64, 16), torch.randn(64, 16), torch.randn(16, 64)
    plan, out = fit_layer(x, target, gate, up, down, spec, seed=0)

    def expert(ids):  # [T, H]
        return (torch.nn.functional.silu(x @ gate[ids].T) * (x @ up[ids].T)) @ plan.down[:, ids].T

    top, picked = (x @ plan.router.T).topk(spec.top_k, dim=1)  # [T, k]
    weights = torch.softmax(top, dim=1)
    want = expert(plan.shared) + torch.stack(
        [
            sum(w * expert(plan.experts[e])[t] for w, e in zip(weights[t], picked[t]))
            for t in range(x.shape[0])
        ]
    )
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)
    assert sorted(torch.cat([plan.shared, plan.experts.flatten()]).tolist()) == list(range(64))


def test_refine_split_moves_neurons_to_the_expert_whose_tokens_they_fire_on():
    """Tokens 0-19 go to expert 0 and 20-39 to expert 1; neurons that fire only on the first
    half start in expert 1 and the others in expert 0, so every neuron must change sides."""
    from hybridmoe.demo.split import refine_split

    torch.manual_seed(3)
    h = torch.zeros(40, 8)  # [T, F], 8 routed neurons
    first, second = [1, 4, 6, 7], [0, 2, 3, 5]
    h[:20, first] = torch.rand(20, 4) + 0.1
    h[20:, second] = torch.rand(20, 4) + 0.1
    down = torch.randn(5, 8)
    experts = torch.tensor([second, first])  # the wrong way round
    picked = torch.tensor([[0]] * 20 + [[1]] * 20)  # [T, k=1]
    got = refine_split(h, down, experts, picked)
    assert got.tolist() == [sorted(first), sorted(second)]
