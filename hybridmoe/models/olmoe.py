"""OLMoE: q/k RMSNorms over all heads at once (before the head split), optional clip_qkv (read from
cfg by Attention), and a softmax top-k MoE block in every layer (not renormalised unless
norm_topk_prob)."""

from __future__ import annotations

from torch import nn

from hybridmoe.layers.moe import SparseMoE
from hybridmoe.models.base import CausalLM


class OlmoeForCausalLM(CausalLM):
    qk_norm = "full"

    def ffn(self, i: int) -> nn.Module:
        return SparseMoE(
            self.shape, bool(self.cfg.get("norm_topk_prob", default=False)), i, self.runtime
        )
