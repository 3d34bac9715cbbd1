"""OLMoE: q/k RMSNorms over all heads at once (before the head split), optional clip_qkv, and a softmax
top-k MoE block in every layer (not renormalised unless norm_topk_prob)."""

from __future__ import annotations

from torch import nn

from hybridmoe.experts.store import ExpertShape
from hybridmoe.layers.moe import SparseMoE
from hybridmoe.layers.rotary import Rotary, rope_parameters
from hybridmoe.models.base import CausalLM
from hybridmoe.models.llama import DecoderLayer


class OlmoeForCausalLM(CausalLM):
    def __init__(self, cfg, runtime):
        super().__init__(cfg, runtime)
        self.rotary = Rotary(cfg.head_dim(), rope_parameters(cfg))
        shape = self.expert_shape(cfg)
        renormalize = bool(cfg.get("norm_topk_prob", default=False))
        self.layers = nn.ModuleList(
            DecoderLayer(
                cfg, i, self.rotary,
                SparseMoE(shape.hidden, shape.num_experts, shape.top_k, renormalize, i, runtime),
                qk_norm="full",  # clip_qkv, when set, is read from cfg by Attention
            )
            for i in range(cfg.get("num_hidden_layers"))
        )

    @staticmethod
    def expert_shape(cfg):
        return ExpertShape(
            hidden=cfg.get("hidden_size"),
            intermediate=cfg.get("intermediate_size"),  # OLMoE's experts are its only MLPs
            num_experts=cfg.get("num_experts", "num_local_experts"),
            top_k=cfg.get("num_experts_per_tok"),
            moe_layers=tuple(range(cfg.get("num_hidden_layers"))),
        )
