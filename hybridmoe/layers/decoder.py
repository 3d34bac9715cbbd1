"""The decoder layer every architecture stacks: pre-norm attention, then a pre-norm feed-forward."""

from __future__ import annotations

import torch
from torch import nn

from hybridmoe.layers import lora
from hybridmoe.layers.attention import Attention
from hybridmoe.layers.norm import RMSNorm, rms_norm, through_norm
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
        mods = self._modules  # dict reads, not nn.Module's __getattr__ (layers/held.py)
        ffn = mods[self.ffn_name]
        ffn_half = getattr(ffn, "decoder_half", None)  # SparseMoE's: a decode token's in one call
        half = getattr(mods["self_attn"], "decoder_half", None)  # Attention's, not MLA's
        both = None
        if half is not None and not self.training:
            norms = (mods["input_layernorm"], mods["post_attention_layernorm"])
            # a decode token's feed-forward half's first product (an MoE router's) in that call too
            first = ffn.first_weight() if ffn_half is not None and x.shape[0] == 1 else None
            both = half(x, norms, cos_sin, ctx, first)  # a decode step's first half in one call
        if both is None:
            x = x + self._attention(x, cos_sin, ctx)
            if ffn_half is None or self.training or torch.is_grad_enabled():
                return x + through_norm(self.post_attention_layernorm, x, ffn)
            both = (x, self.post_attention_layernorm(x), None)
        x, h, row = both
        out = None if ffn_half is None else ffn_half(x, h, row)
        return x + ffn(h) if out is None else out

    def decode_fields(self, x, cos_sin, ctx) -> tuple[list[int], int, nn.Module] | None:
        """This layer's fields of native.decode_layers for a decode step's tokens x [T, H], one
        per sequence (the attention half's, then the feed-forward's: Attention.decode_fields,
        SparseMoE.decode_fields), the experts' threads and the block, where both halves would run
        the tokens in the same native calls; else None."""
        mods = self._modules
        ffn, attn = mods[self.ffn_name], mods["self_attn"]
        if (
            self.training
            or getattr(ffn, "decoder_half", None) is None
            or getattr(attn, "decode_fields", None) is None
        ):
            return None
        moe = ffn.decode_fields(x)
        if moe is None:
            return None
        norms = (mods["input_layernorm"], mods["post_attention_layernorm"])
        fields = attn.decode_fields(x, norms, cos_sin, ctx)
        return None if fields is None else (fields + moe[0], moe[1], ffn)

    def _attention(self, x, cos_sin, ctx):
        """The attention block's output [T, H]. A training step keeps, of its activations, the
        attention's output (o_proj's input, which the flash backward needs too), and makes q, k
        and v again in the backward from x, which the layer keeps anyway, one layer at a time;
        keeping q, k and v too took the demo's peak to its bound, and running the whole block
        again (layers/recompute.py), as where dropout is drawn or the attention is not
        `Attention`, costs its flash forward and o_proj twice
        (docs/notes/2026-11-25-finetune-dense-experts.md)."""
        attn, norm = self.self_attn, self.input_layernorm
        if not _remakes_qkv(attn, ctx, self.training):
            return recompute(self.training, lambda h: attn(norm(h), cos_sin, ctx), x)
        rows = lora.current()

        def again():  # what the forward made, the same way (with gradients recorded)
            h = rms_norm(x, norm.weight, norm.eps)  # [T, H], as _RMSNorm.forward makes it
            with lora.using(rows), torch.enable_grad():
                return tuple(t.detach() for t in attn.qkv(h, cos_sin))

        return through_norm(norm, x, lambda h: attn(h, cos_sin, ctx, remake=again))


def _remakes_qkv(attn, ctx, training: bool) -> bool:
    """Whether a training step's attention keeps its output and makes q, k, v again: standard
    attention over whole sequences, no dropout on its q/k/v adapters (which would draw again)."""
    if not (training and torch.is_grad_enabled() and getattr(ctx, "whole_sequences", False)):
        return False
    if not isinstance(attn, Attention):
        return False
    projections = (attn.q_proj, attn.k_proj, attn.v_proj)
    return not any(a.dropout for p in projections for a in p.adapters.values())
