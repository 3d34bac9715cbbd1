"""The decoder layer every architecture stacks: pre-norm attention, then a pre-norm feed-forward."""

from __future__ import annotations

from torch import nn

from hybridmoe.layers.norm import RMSNorm, through_norm
from hybridmoe.layers.recompute import recompute


class DecoderLayer(nn.Module):
    """x + attn(norm(x)), then x + ffn(norm(x)). The model chooses the attention (standard, with
    biases, MLA) and the feed-forward (a dense MLP or an MoE block), and the feed-forward's name in
    checkpoints (`mlp`, Mixtral's `block_sparse_moe`)."""

    def __init__(
        self, hidden: int, eps: float, attn: nn.Module, ffn: nn.Module, ffn_name: str = "mlp"
    ):
        super().__init__()
        self.input_layernorm = RMSNorm(hidden, eps)
        self.self_attn = attn
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.ffn_name = ffn_name
        setattr(self, ffn_name, ffn)

    def forward(self, x, cos_sin, ctx):
        half = getattr(self.self_attn, "decoder_half", None)  # Attention's, not MLA's
        if half is not None and not self.training:
            norms = (self.input_layernorm, self.post_attention_layernorm)
            both = half(x, norms, cos_sin, ctx)  # a decode step's first half in one native call
            if both is not None:
                x, h = both
                return x + getattr(self, self.ffn_name)(h)
        # in a training step the standard attention keeps its activations (q, k, v, its output
        # once: layers/packed_attention.py) and the normed rows are made again from x where the
        # backward needs them (layers/norm.py through_norm); MLA, not measured so, keeps its input
        # alone and runs again in the backward (layers/recompute.py). The feed-forward says what
        # it keeps (layers/mlp.py). docs/notes/2026-11-25-finetune-attention-kept.md
        x = x + self._attention(x, cos_sin, ctx)
        return x + through_norm(self.post_attention_layernorm, x, getattr(self, self.ffn_name))

    def _attention(self, x, cos_sin, ctx):
        def attend(h):
            return self.self_attn(h, cos_sin, ctx)

        if getattr(self.self_attn, "keeps_activations", False):
            return through_norm(self.input_layernorm, x, attend)
        return recompute(self.training, lambda y: attend(self.input_layernorm(y)), x)
