"""What routing replay and the predictor ask of a MoE block: `weights_at(x, ids)` gives the weights
the block's own router would give those experts, `router_probs(x)` ranks experts as the router does.
References are computed by hand from the gate's weight matrix."""

from __future__ import annotations

import pytest
import torch

from hybridmoe.layers.moe import SparseMoE
from hybridmoe.loader import load_model
from tests.tiny import build_tiny

ARCHS = ("mixtral", "qwen3_moe", "deepseek_v2", "deepseek_v3")


@pytest.fixture(scope="module")
def blocks(tmp_path_factory):
    """arch -> (its MoE blocks, its config)."""
    out = {}
    for arch in ARCHS:
        path = tmp_path_factory.mktemp(arch) / "model"
        build_tiny(arch, path)
        model = load_model(path, progress=False)
        out[arch] = ([m for m in model.modules() if isinstance(m, SparseMoE)], model.cfg)
    return out


def random_ids(tokens: int, experts: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)])  # [T, K]


def hand_weights(block, x: torch.Tensor, ids: torch.Tensor, arch: str, cfg) -> torch.Tensor:
    """The router's weights for `ids`, written out per architecture."""
    logits = x.float() @ block.gate.weight.float().T  # [T, E]
    if arch == "deepseek_v3":  # sigmoid scores, bias left out, normalised, scaled
        w = logits.sigmoid().gather(1, ids)
        w = w / w.sum(-1, keepdim=True) if cfg.get("norm_topk_prob") else w
        return w * cfg.get("routed_scaling_factor")
    w = logits.softmax(-1).gather(1, ids)
    if arch == "deepseek_v2":  # softmax scores, no normalisation in this config, scaled
        assert not cfg.get("norm_topk_prob")
        return w * cfg.get("routed_scaling_factor")
    return (
        w / w.sum(-1, keepdim=True) if cfg.get("norm_topk_prob", default=arch == "mixtral") else w
    )


@pytest.mark.parametrize("arch", ARCHS)
def test_weights_at_any_ids_equal_a_hand_computed_router(arch, blocks):
    moes, cfg = blocks[arch]
    torch.manual_seed(7)
    for i, block in enumerate(moes):
        if arch == "deepseek_v3":  # a bias that changes choices must not change weights
            block.gate.e_score_correction_bias.data = (
                torch.randn_like(block.gate.e_score_correction_bias) * 0.5
            )
        x = torch.randn(9, block.gate.in_features)  # [T, H]
        ids = random_ids(
            9, block.gate.out_features, block.top_k, seed=i
        )  # [T, K], not the router's choice
        torch.testing.assert_close(block.weights_at(x, ids), hand_weights(block, x, ids, arch, cfg))


@pytest.mark.parametrize("arch", ARCHS)
def test_at_its_own_choice_weights_at_is_the_router(arch, blocks):
    moes, _ = blocks[arch]
    torch.manual_seed(8)
    for block in moes:
        x = torch.randn(9, block.gate.in_features)
        ids, weights = block.route(x)
        torch.testing.assert_close(block.weights_at(x, ids), weights.float())


@pytest.mark.parametrize("arch", ARCHS)
def test_router_probs_rank_the_chosen_experts_first(arch, blocks):
    moes, _ = blocks[arch]
    torch.manual_seed(9)
    for block in moes:
        if arch == "deepseek_v3":  # positive, so that no kept expert scores 0 like a dropped group
            block.gate.e_score_correction_bias.data = (
                torch.rand_like(block.gate.e_score_correction_bias) * 0.5
            )
        x = torch.randn(9, block.gate.in_features)
        ids, _ = block.route(x)
        probs = block.router_probs(x)  # [T, E]
        assert probs.shape == (9, block.gate.out_features) and bool((probs >= 0).all())
        top = probs.topk(block.top_k, dim=-1).indices
        assert [set(r) for r in top.tolist()] == [set(r) for r in ids.tolist()]
