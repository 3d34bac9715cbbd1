"""Qwen3-MoE: Llama attention with an RMSNorm on each query/key head, and a softmax top-k MoE block.

Which layers are sparse follows `decoder_sparse_step` and `mlp_only_layers` (as Qwen2-MoE); the
others are dense SwiGLU MLPs of `intermediate_size`, the routed experts `moe_intermediate_size`.
"""

from __future__ import annotations

from torch import nn

from hybridmoe.experts.store import ExpertShape
from hybridmoe.layers.mlp import GatedMLP
from hybridmoe.layers.moe import SparseMoE
from hybridmoe.layers.rotary import Rotary, rope_parameters
from hybridmoe.models.base import CausalLM
from hybridmoe.models.llama import DecoderLayer


def sparse_layers(cfg) -> tuple[int, ...]:
    """Indices of the MoE layers of a Qwen-MoE config: every `decoder_sparse_step`-th, minus `mlp_only_layers`."""
    step = cfg.get("decoder_sparse_step", default=1)
    dense = set(cfg.get("mlp_only_layers", default=[]))
    if cfg.get("num_experts", "num_local_experts", default=0) <= 0:
        return ()
    return tuple(i for i in range(cfg.get("num_hidden_layers")) if i not in dense and (i + 1) % step == 0)


def qwen_moe_shape(cfg) -> ExpertShape:
    return ExpertShape(
        hidden=cfg.get("hidden_size"),
        intermediate=cfg.get("moe_intermediate_size"),
        num_experts=cfg.get("num_experts", "num_local_experts"),
        top_k=cfg.get("num_experts_per_tok"),
        moe_layers=sparse_layers(cfg),
    )


class Qwen3MoeForCausalLM(CausalLM):
    def __init__(self, cfg, runtime):
        super().__init__(cfg, runtime)
        self.rotary = Rotary(cfg.head_dim(), rope_parameters(cfg))
        shape = self.expert_shape(cfg)
        renormalize = bool(cfg.get("norm_topk_prob", default=False))
        dense_inter = cfg.get("intermediate_size")

        def ffn(i: int) -> nn.Module:
            if i in shape.moe_layers:
                return SparseMoE(shape.hidden, shape.num_experts, shape.top_k, renormalize, i, runtime)
            return GatedMLP(shape.hidden, dense_inter)

        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, self.rotary, ffn(i), qk_norm="head") for i in range(cfg.get("num_hidden_layers"))
        )

    @staticmethod
    def expert_shape(cfg):
        return qwen_moe_shape(cfg)
