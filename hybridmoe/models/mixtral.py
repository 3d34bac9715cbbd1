"""Mixtral: Llama attention, and a sparse MoE block (softmax over experts, top-k, renormalised)."""

from __future__ import annotations

from torch import nn

from hybridmoe.layers.moe import SparseMoE
from hybridmoe.models.base import CausalLM


class MixtralForCausalLM(CausalLM):
    ffn_name = "block_sparse_moe"

    def ffn(self, i: int) -> nn.Module:
        return SparseMoE(self.shape, True, i, self.runtime)
