"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Llama attention with q/k/v biases, and an MoE block of
softmax top-k routed experts plus one shared expert scaled per token by
sigmoid(shared_expert_gate x)."""

from __future__ import annotations

import torch
from torch import nn

from hybridmoe.layers.attention import Attention
from hybridmoe.layers.linear import linear
from hybridmoe.layers.mlp import GatedMLP
from hybridmoe.layers.moe import SparseMoE
from hybridmoe.models.base import CausalLM


class SharedExpertMoE(SparseMoE):
    """Routed experts (through the runtime) + a gated dense shared expert,
    which stays with the model."""

    def __init__(self, shape, renormalize, layer, runtime, shared_intermediate: int):
        super().__init__(shape, renormalize, layer, runtime)
        self.shared_expert = GatedMLP(shape.hidden, shared_intermediate, keep=True)
        self.shared_expert_gate = nn.Linear(shape.hidden, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        routed = super().forward(x)  # [T, H]
        gate = linear(x, self.shared_expert_gate.weight)  # [T, 1]
        shared = self.shared_expert(x, scale=torch.sigmoid(gate))  # [T, H] times [T, 1]
        return routed + shared


class Qwen2MoeForCausalLM(CausalLM):
    def attention(self, i: int) -> nn.Module:
        qkv_bias = bool(
            self.cfg.get("qkv_bias", default=True)
        )  # older configs lack the key: biases always
        return Attention(self.cfg, i, self.rotary, bias=qkv_bias, o_bias=False)

    def ffn(self, i: int) -> nn.Module:
        cfg = self.cfg
        if not self.is_moe(i):
            return GatedMLP(cfg.get("hidden_size"), cfg.get("intermediate_size"))
        renormalize = bool(cfg.get("norm_topk_prob", default=False))
        shared = cfg.get("shared_expert_intermediate_size", default=0)
        if shared:
            return SharedExpertMoE(self.shape, renormalize, i, self.runtime, shared)
        return SparseMoE(self.shape, renormalize, i, self.runtime)
