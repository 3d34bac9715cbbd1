"""Routers: from router logits to (expert ids, weights) per token, and the MoE block around them."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def softmax_topk(logits: torch.Tensor, k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: [T, E] -> ids [T, k], weights [T, k] (fp32). Mixtral, Qwen-MoE, OLMoE."""
    probs = F.softmax(logits, dim=-1, dtype=torch.float32)  # [T, E]
    weights, ids = torch.topk(probs, k, dim=-1)  # [T, k]
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids, weights


class SparseMoE(nn.Module):
    """Router -> top-k per token -> the expert runtime -> weighted sum.

    The routed experts' weights are not parameters of this module: the runtime holds them, so that
    it alone decides where each expert runs (CPU, GPU cache, GPU after a copy).
    """

    def __init__(self, hidden: int, num_experts: int, top_k: int, renormalize: bool, layer: int, runtime):
        super().__init__()
        self.layer, self.top_k, self.renormalize = layer, top_k, renormalize
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        self.runtime = runtime

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return softmax_topk(self.gate(x), self.top_k, self.renormalize)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.route(x)  # [T, k], [T, k]
        return self.runtime.forward(self.layer, x, ids, weights)
