"""Qwen3-MoE: Llama attention with an RMSNorm on each query/key head, and a softmax top-k MoE block.

Which layers are sparse follows `decoder_sparse_step` and `mlp_only_layers` (experts/plan/shape.py);
the others are dense SwiGLU MLPs of `intermediate_size`, the routed experts `moe_intermediate_size`.
"""

from __future__ import annotations

from torch import nn

from hybridmoe.layers.mlp import GatedMLP
from hybridmoe.layers.moe import SparseMoE
from hybridmoe.models.base import CausalLM


class Qwen3MoeForCausalLM(CausalLM):
    qk_norm = "head"

    def ffn(self, i: int) -> nn.Module:
        if self.is_moe(i):
            return SparseMoE(
                self.shape, bool(self.cfg.get("norm_topk_prob", default=False)), i, self.runtime
            )
        return GatedMLP(self.cfg.get("hidden_size"), self.cfg.get("intermediate_size"))
