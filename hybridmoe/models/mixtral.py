"""Mixtral: Llama attention, and a sparse MoE block (softmax over experts, top-k, renormalised)."""

from __future__ import annotations

from torch import nn

from hybridmoe.experts.store import ExpertShape
from hybridmoe.layers.moe import SparseMoE
from hybridmoe.layers.rotary import Rotary, rope_parameters
from hybridmoe.models.base import CausalLM
from hybridmoe.models.llama import DecoderLayer


class MixtralForCausalLM(CausalLM):
    def __init__(self, cfg, runtime):
        super().__init__(cfg, runtime)
        self.rotary = Rotary(cfg.head_dim(), rope_parameters(cfg))
        shape = self.expert_shape(cfg)
        self.layers = nn.ModuleList(
            DecoderLayer(
                cfg, i, self.rotary,
                SparseMoE(shape.hidden, shape.num_experts, shape.top_k, True, i, runtime),
                ffn_name="block_sparse_moe",
            )
            for i in range(cfg.get("num_hidden_layers"))
        )

    @staticmethod
    def expert_shape(cfg):
        return ExpertShape(
            hidden=cfg.get("hidden_size"),
            intermediate=cfg.get("intermediate_size"),
            num_experts=cfg.get("num_local_experts", "num_experts"),
            top_k=cfg.get("num_experts_per_tok"),
            moe_layers=tuple(range(cfg.get("num_hidden_layers"))),
        )
