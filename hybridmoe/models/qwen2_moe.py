"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Llama attention with q/k/v biases, and an MoE block of
softmax top-k routed experts plus one shared expert scaled per token by sigmoid(shared_expert_gate x)."""

from __future__ import annotations

import torch
from torch import nn

from hybridmoe.layers.attention import Attention
from hybridmoe.layers.mlp import GatedMLP
from hybridmoe.layers.moe import SparseMoE
from hybridmoe.layers.rotary import Rotary, rope_parameters
from hybridmoe.models.base import CausalLM
from hybridmoe.models.llama import DecoderLayer
from hybridmoe.models.qwen3_moe import qwen_moe_shape


class SharedExpertMoE(SparseMoE):
    """Routed experts (through the runtime) + a gated dense shared expert, which stays with the model."""

    def __init__(self, hidden, num_experts, top_k, renormalize, layer, runtime, shared_intermediate: int):
        super().__init__(hidden, num_experts, top_k, renormalize, layer, runtime)
        self.shared_expert = GatedMLP(hidden, shared_intermediate)
        self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        routed = super().forward(x)  # [T, H]
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)  # [T, 1] * [T, H]
        return routed + shared


class Qwen2MoeForCausalLM(CausalLM):
    def __init__(self, cfg, runtime):
        super().__init__(cfg, runtime)
        self.rotary = Rotary(cfg.head_dim(), rope_parameters(cfg))
        shape = self.expert_shape(cfg)
        renormalize = bool(cfg.get("norm_topk_prob", default=False))
        shared = cfg.get("shared_expert_intermediate_size", default=0)
        dense_inter = cfg.get("intermediate_size")
        qkv_bias = bool(cfg.get("qkv_bias", default=True))  # older configs lack the key: biases always

        def ffn(i: int) -> nn.Module:
            if i not in shape.moe_layers:
                return GatedMLP(shape.hidden, dense_inter)
            if shared:
                return SharedExpertMoE(shape.hidden, shape.num_experts, shape.top_k, renormalize, i, runtime, shared)
            return SparseMoE(shape.hidden, shape.num_experts, shape.top_k, renormalize, i, runtime)

        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, self.rotary, ffn(i), attn=Attention(cfg, i, self.rotary, bias=qkv_bias, o_bias=False))
            for i in range(cfg.get("num_hidden_layers"))
        )

    @staticmethod
    def expert_shape(cfg):
        return qwen_moe_shape(cfg)
