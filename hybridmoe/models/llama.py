"""Llama: the dense base (SmolLM2, Llama 2/3); tied embeddings when the config says so."""

from __future__ import annotations

from torch import nn

from hybridmoe.layers.attention import Attention
from hybridmoe.layers.mlp import GatedMLP
from hybridmoe.layers.norm import RMSNorm
from hybridmoe.layers.rotary import Rotary, rope_parameters
from hybridmoe.models.base import CausalLM


class DecoderLayer(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + ffn(norm(x)). `ffn` is set by the model;
    so is `attn` where it is not the standard Attention (Qwen2-MoE biases, DeepSeek's MLA)."""

    def __init__(self, cfg, layer: int, rotary: Rotary, ffn: nn.Module, ffn_name: str = "mlp", qk_norm=None,
                 attn: nn.Module | None = None):
        super().__init__()
        eps = cfg.get("rms_norm_eps", default=1e-6)
        hidden = cfg.get("hidden_size")
        self.input_layernorm = RMSNorm(hidden, eps)
        self.self_attn = attn if attn is not None else Attention(cfg, layer, rotary, qk_norm=qk_norm)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.ffn_name = ffn_name
        setattr(self, ffn_name, ffn)

    def forward(self, x, cos_sin, ctx):
        x = x + self.self_attn(self.input_layernorm(x), cos_sin, ctx)
        return x + getattr(self, self.ffn_name)(self.post_attention_layernorm(x))


class LlamaForCausalLM(CausalLM):
    def __init__(self, cfg, runtime=None):
        super().__init__(cfg, runtime)
        self.rotary = Rotary(cfg.head_dim(), rope_parameters(cfg))
        hidden, inter = cfg.get("hidden_size"), cfg.get("intermediate_size")
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, self.rotary, GatedMLP(hidden, inter)) for i in range(cfg.get("num_hidden_layers"))
        )
