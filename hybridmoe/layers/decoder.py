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
                ffn = getattr(self, self.ffn_name)
                ffn_half = getattr(ffn, "decoder_half", None)  # SharedExpertMoE's
                out = None if ffn_half is None else ffn_half(x, h)  # the second half likewise
                return x + ffn(h) if out is None else out
        # a training step keeps the attention block's input alone and runs it again in the
        # backward (layers/recompute.py): keeping its activations too (q, k, v and its output,
        # about 3 MB a layer on the demo) gave no step time measurably shorter and took the
        # demo's peak to its bound (docs/notes/2026-11-25-finetune-attention-kept.md). The
        # post-attention norm's rows are made again from x where the backward needs them
        # (layers/norm.py through_norm); the feed-forward says what it keeps (layers/mlp.py).
        attn = recompute(
            self.training, lambda h: self.self_attn(self.input_layernorm(h), cos_sin, ctx), x
        )
        x = x + attn
        return x + through_norm(self.post_attention_layernorm, x, getattr(self, self.ffn_name))
