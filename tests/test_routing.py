"""DeepSeek's routers: experts come only from the kept groups, bias chooses but does not weigh."""

import torch

from hybridmoe.layers.moe import sigmoid_group_topk, softmax_group_topk


def _reference_groups(
    choice: torch.Tensor, n_group: int, topk_group: int, top2: bool
) -> list[set[int]]:
    """Per token, the kept groups, computed one token at a time."""
    kept = []
    for row in choice:
        groups = row.view(n_group, -1)
        score = groups.topk(2).values.sum(-1) if top2 else groups.max(-1).values
        kept.append(set(score.argsort(descending=True)[:topk_group].tolist()))
    return kept


def test_v3_router_picks_within_kept_groups_and_weighs_by_unbiased_scores():
    torch.manual_seed(1)
    logits, bias = torch.randn(50, 16), torch.randn(16) * 0.3
    ids, w = sigmoid_group_topk(
        logits, bias, k=3, n_group=4, topk_group=2, renormalize=False, scale=2.0
    )
    kept = _reference_groups(logits.sigmoid() + bias, 4, 2, top2=True)
    for t in range(50):
        assert {e // 4 for e in ids[t].tolist()} <= kept[t]
    torch.testing.assert_close(w, logits.sigmoid().gather(1, ids) * 2.0)


def test_v2_router_picks_within_kept_groups_and_renormalises():
    torch.manual_seed(2)
    logits = torch.randn(50, 16)
    ids, w = softmax_group_topk(logits, k=2, n_group=4, topk_group=1, renormalize=True, scale=1.0)
    kept = _reference_groups(logits.softmax(-1), 4, 1, top2=False)
    for t in range(50):
        assert {e // 4 for e in ids[t].tolist()} <= kept[t]
    torch.testing.assert_close(w.sum(-1), torch.ones(50))
