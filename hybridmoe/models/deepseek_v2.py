"""DeepSeek-V2 (and V2-Lite): MLA attention with interleaved RoPE, dense MLPs in the first
`first_k_dense_replace` layers, then MoE blocks of routed experts (softmax scores, greedy or
group-limited top-k, times routed_scaling_factor) plus always-on shared experts."""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from hybridmoe.experts.plan.shape import ExpertShape
from hybridmoe.layers.lora import add_lora
from hybridmoe.layers.mla import MLAttention
from hybridmoe.layers.mlp import GatedMLP
from hybridmoe.layers.moe import (
    SparseMoE,
    limit_to_groups,
    scale_weights,
    sigmoid_group_topk,
    softmax_group_topk,
)
from hybridmoe.models.base import CausalLM

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


class DeepseekMoE(SparseMoE):
    """Routed experts (through the runtime) chosen by DeepSeek's router, plus the shared experts as
    one dense SwiGLU of n_shared_experts * moe_intermediate_size, which stays with the model.

    scoring "softmax" (V2) or "sigmoid" (V3; the gate then holds e_score_correction_bias [E]).
    """

    decoder_half = None  # SparseMoE's would leave out the shared experts: every step calls forward

    def __init__(self, cfg, shape: ExpertShape, layer: int, runtime, scoring: str):
        super().__init__(shape, False, layer, runtime)
        self.scoring = scoring
        self.n_group = cfg.get("n_group", default=1)
        self.topk_group = cfg.get("topk_group", default=self.n_group)
        # transformers' V2 ignores norm_topk_prob (False in every released V2); when set we
        # renormalise before scaling, as V3 does
        self.renormalize = bool(cfg.get("norm_topk_prob", default=False))
        self.scale = float(cfg.get("routed_scaling_factor", default=1.0))
        if scoring == "sigmoid":
            # A parameter of the gate, so that checkpoints' mlp.gate.e_score_correction_bias load
            # into it.
            self.gate.e_score_correction_bias = nn.Parameter(torch.zeros(shape.num_experts))
        elif cfg.get("topk_method", default="greedy") == "greedy":
            self.n_group = self.topk_group = 1  # V2's plain greedy ignores any group settings
        shared = cfg.get("n_shared_experts", default=0)
        self.shared_experts = (
            GatedMLP(shape.hidden, shared * shape.intermediate, keep=True) if shared else None
        )

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        logits = F.linear(x.float(), self.gate.weight.float())  # [T, E], fp32 as DeepSeek's
        return add_lora(logits, x, self.gate.adapters)

    def _scores(self, logits: torch.Tensor) -> torch.Tensor:
        """Per-expert scores [T, E] that weigh the chosen experts (before renormalising and
        scaling)."""
        return torch.sigmoid(logits) if self.scoring == "sigmoid" else F.softmax(logits, dim=-1)

    def choose(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self._logits(x)
        if self.scoring == "sigmoid":
            return sigmoid_group_topk(
                logits,
                self.gate.e_score_correction_bias,
                self.top_k,
                self.n_group,
                self.topk_group,
                self.renormalize,
                self.scale,
            )
        return softmax_group_topk(
            logits, self.top_k, self.n_group, self.topk_group, self.renormalize, self.scale
        )

    def router_probs(self, x: torch.Tensor) -> torch.Tensor:
        """[T, E]: what ranks experts for selection, the scores plus (V3) the correction bias, with
        the experts of groups the router would not keep at 0. For the predictor, which only
        ranks."""
        scores = self._scores(self._logits(x))  # [T, E]
        if self.scoring == "sigmoid":
            scores = scores + self.gate.e_score_correction_bias.float()
        group_score = "top2" if self.scoring == "sigmoid" else "max"
        kept = limit_to_groups(
            scores, self.n_group, self.topk_group, group_score
        )  # [T, E], -inf outside
        return kept.clamp(min=0.0)

    def weights_at(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The weights [T, K] DeepSeek's router gives experts `ids` [T, K]: their scores (sigmoid or
        softmax, never the correction bias, which only chooses), renormalised if norm_topk_prob,
        times routed_scaling_factor; exactly what `choose` gives when ids are its own choice."""
        weights = self._scores(self._logits(x)).gather(1, ids)  # [T, K]
        return scale_weights(weights, self.renormalize, self.scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)  # [T, H]
        return out if self.shared_experts is None else out + self.shared_experts(x)


class DeepseekV2ForCausalLM(CausalLM):
    scoring = "softmax"

    @staticmethod
    def rotary_dim(cfg) -> int:
        return cfg.get("qk_rope_head_dim")

    def attention(self, i: int) -> nn.Module:
        return MLAttention(self.cfg, i, self.rotary, self.rope_interleaved(self.cfg))

    def ffn(self, i: int) -> nn.Module:
        if self.is_moe(i):
            return DeepseekMoE(self.cfg, self.shape, i, self.runtime, self.scoring)
        return GatedMLP(self.cfg.get("hidden_size"), self.cfg.get("intermediate_size"))

    def load_weights(self, tensors) -> None:
        # The correction bias only ranks experts, by small margins: bf16 rounding would change
        # choices, so it stays fp32 whatever dtype the model is loaded in (transformers does the
        # same).
        for block in self.moe_blocks():
            if block.scoring == "sigmoid":
                block.gate.e_score_correction_bias.data = (
                    block.gate.e_score_correction_bias.data.float()
                )
        super().load_weights(self._without_mtp(tensors))

    def _without_mtp(self, tensors):
        """Drop the multi-token-prediction layers (DeepSeek-V3's model.layers.61): generation does
        not use them."""
        n = len(self.layers)
        for name, tensor in tensors:
            m = _LAYER.match(name)
            if m is None or int(m[1]) < n:
                yield name, tensor

    @staticmethod
    def rope_interleaved(cfg) -> bool:
        return True  # V2's weights always rotate adjacent pairs
