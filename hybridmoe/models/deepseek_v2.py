"""DeepSeek-V2 (and V2-Lite): MLA attention with interleaved RoPE, dense MLPs in the first
`first_k_dense_replace` layers, then MoE blocks of routed experts (softmax scores, greedy or
group-limited top-k, times routed_scaling_factor) plus always-on shared experts."""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from hybridmoe.experts.store import ExpertShape
from hybridmoe.layers.mla import MLAttention
from hybridmoe.layers.mlp import GatedMLP
from hybridmoe.layers.moe import (SparseMoE, limit_to_groups, scale_weights, sigmoid_group_topk,
                                  softmax_group_topk)
from hybridmoe.layers.rotary import Rotary, rope_parameters
from hybridmoe.models.base import CausalLM
from hybridmoe.models.llama import DecoderLayer

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


class DeepseekMoE(SparseMoE):
    """Routed experts (through the runtime) chosen by DeepSeek's router, plus the shared experts as
    one dense SwiGLU of n_shared_experts * moe_intermediate_size, which stays with the model.

    scoring "softmax" (V2) or "sigmoid" (V3; the gate then holds e_score_correction_bias [E]).
    """

    def __init__(self, cfg, shape: ExpertShape, layer: int, runtime, scoring: str):
        super().__init__(shape.hidden, shape.num_experts, shape.top_k, False, layer, runtime)
        self.scoring = scoring
        self.n_group = cfg.get("n_group", default=1)
        self.topk_group = cfg.get("topk_group", default=self.n_group)
        # transformers' V2 ignores norm_topk_prob (False in every released V2); when set we renormalise
        # before scaling, as V3 does
        self.renormalize = bool(cfg.get("norm_topk_prob", default=False))
        self.scale = float(cfg.get("routed_scaling_factor", default=1.0))
        if scoring == "sigmoid":
            # A parameter of the gate, so that checkpoints' mlp.gate.e_score_correction_bias load into it.
            self.gate.e_score_correction_bias = nn.Parameter(torch.zeros(shape.num_experts))
        elif cfg.get("topk_method", default="greedy") == "greedy":
            self.n_group = self.topk_group = 1  # V2's plain greedy ignores any group settings
        shared = cfg.get("n_shared_experts", default=0)
        self.shared_experts = GatedMLP(shape.hidden, shared * shape.intermediate) if shared else None

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.gate.weight.float())  # [T, E], fp32 as DeepSeek's reference

    def _scores(self, logits: torch.Tensor) -> torch.Tensor:
        """Per-expert scores [T, E] that weigh the chosen experts (before renormalising and scaling)."""
        return torch.sigmoid(logits) if self.scoring == "sigmoid" else F.softmax(logits, dim=-1)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self._logits(x)
        if self.scoring == "sigmoid":
            return sigmoid_group_topk(logits, self.gate.e_score_correction_bias, self.top_k, self.n_group,
                                      self.topk_group, self.renormalize, self.scale)
        return softmax_group_topk(logits, self.top_k, self.n_group, self.topk_group, self.renormalize, self.scale)

    def router_probs(self, x: torch.Tensor) -> torch.Tensor:
        """[T, E]: what ranks experts for selection, the scores plus (V3) the correction bias, with the
        experts of groups the router would not keep at 0. For the predictor, which only ranks."""
        scores = self._scores(self._logits(x))  # [T, E]
        if self.scoring == "sigmoid":
            scores = scores + self.gate.e_score_correction_bias.float()
        group_score = "top2" if self.scoring == "sigmoid" else "max"
        kept = limit_to_groups(scores, self.n_group, self.topk_group, group_score)  # [T, E], -inf outside
        return kept.clamp(min=0.0)

    def weights_at(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The weights [T, K] DeepSeek's router gives experts `ids` [T, K]: their scores (sigmoid or
        softmax, never the correction bias, which only chooses), renormalised if norm_topk_prob, times
        routed_scaling_factor; exactly what `route` gives when ids are its own choice."""
        weights = self._scores(self._logits(x)).gather(1, ids)  # [T, K]
        return scale_weights(weights, self.renormalize, self.scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)  # [T, H]
        return out if self.shared_experts is None else out + self.shared_experts(x)


def deepseek_moe_layers(cfg) -> tuple[int, ...]:
    """MoE layers: from first_k_dense_replace on, every moe_layer_freq-th (1 in all released models)."""
    first = cfg.get("first_k_dense_replace", default=0)
    freq = cfg.get("moe_layer_freq", default=1)
    if not cfg.get("n_routed_experts", "num_experts", "num_local_experts", default=0):
        return ()
    return tuple(i for i in range(cfg.get("num_hidden_layers")) if i >= first and i % freq == 0)


class DeepseekV2ForCausalLM(CausalLM):
    scoring = "softmax"

    def __init__(self, cfg, runtime):
        super().__init__(cfg, runtime)
        self.rotary = Rotary(cfg.get("qk_rope_head_dim"), rope_parameters(cfg))
        shape = self.expert_shape(cfg)
        interleaved = self.rope_interleaved(cfg)

        def ffn(i: int) -> nn.Module:
            if i in shape.moe_layers:
                return DeepseekMoE(cfg, shape, i, runtime, self.scoring)
            return GatedMLP(shape.hidden, cfg.get("intermediate_size"))

        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, self.rotary, ffn(i), attn=MLAttention(cfg, i, self.rotary, interleaved))
            for i in range(cfg.get("num_hidden_layers"))
        )

    def load_weights(self, tensors) -> None:
        # The correction bias only ranks experts, by small margins: bf16 rounding would change choices, so
        # it stays fp32 whatever dtype the model is loaded in (transformers does the same).
        for layer in self.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None and hasattr(gate, "e_score_correction_bias"):
                gate.e_score_correction_bias.data = gate.e_score_correction_bias.data.float()
        super().load_weights(self._without_mtp(tensors))

    def _without_mtp(self, tensors):
        """Drop the multi-token-prediction layers (DeepSeek-V3's model.layers.61): generation does not use them."""
        n = len(self.layers)
        for name, tensor in tensors:
            m = _LAYER.match(name)
            if m is None or int(m[1]) < n:
                yield name, tensor

    @staticmethod
    def rope_interleaved(cfg) -> bool:
        return True  # V2's weights always rotate adjacent pairs

    @staticmethod
    def expert_shape(cfg):
        return ExpertShape(
            hidden=cfg.get("hidden_size"),
            intermediate=cfg.get("moe_intermediate_size"),
            num_experts=cfg.get("n_routed_experts", "num_experts", "num_local_experts"),
            top_k=cfg.get("num_experts_per_tok"),
            moe_layers=deepseek_moe_layers(cfg),
        )
