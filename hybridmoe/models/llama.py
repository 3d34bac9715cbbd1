"""Llama: the dense base (SmolLM2, Llama 2/3); tied embeddings when the config says so."""

from __future__ import annotations

from torch import nn

from hybridmoe.layers.mlp import GatedMLP
from hybridmoe.models.base import CausalLM


class LlamaForCausalLM(CausalLM):
    def ffn(self, i: int) -> nn.Module:
        return GatedMLP(self.cfg.get("hidden_size"), self.cfg.get("intermediate_size"))
