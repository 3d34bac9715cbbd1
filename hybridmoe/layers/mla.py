"""Multi-head Latent Attention (DeepSeek-V2/V3): keys and values come from one small latent per
token.

Per token the cache holds only the latent c_kv [kv_lora_rank] (after kv_a_layernorm) and the rotated
rope key k_pe [qk_rope_head_dim], shared by all heads: for DeepSeek-V3 that is 512 + 64 values
instead of 2 * 128 heads * 128. At attention time kv_b_proj expands the history into per-head keys
(no-rope part) and values.
"""

from __future__ import annotations

import torch
from torch import nn

from hybridmoe.layers import lora
from hybridmoe.layers.attention import KVContext, causal_attention
from hybridmoe.layers.linear import Linear
from hybridmoe.layers.norm import RMSNorm
from hybridmoe.layers.rotary import Rotary, apply_rotary, yarn_mscale


def softmax_scale(qk_head_dim: int, rope: dict) -> float:
    """1/sqrt(d), times YaRN's mscale(factor, mscale_all_dim) squared when the rope is scaled
    (DeepSeek)."""
    scale = qk_head_dim**-0.5
    mscale_all = rope.get("mscale_all_dim")
    if rope["rope_type"] != "default" and mscale_all:
        scale *= yarn_mscale(float(rope["factor"]), float(mscale_all)) ** 2
    return scale


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """[..., d] with rope pairs (x0, x1), (x2, x3), ... -> [..., d] as (x0, x2, ..., x1, x3, ...).

    DeepSeek's weights rotate adjacent pairs; after this permutation the rotate-half RoPE does the
    same rotation. Queries and keys are permuted alike, so their dot products do not change.
    """
    return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)


class MLAttention(nn.Module):
    """MLA with an optional low-rank query (q_lora_rank None: a plain q_proj, as
    DeepSeek-V2-Lite)."""

    def __init__(self, cfg, layer: int, rotary: Rotary, interleaved: bool):
        super().__init__()
        self.layer, self.rotary, self.interleaved = layer, rotary, interleaved
        hidden = cfg.get("hidden_size")
        self.heads = cfg.get("num_attention_heads")
        self.nope, self.rope = cfg.get("qk_nope_head_dim"), cfg.get("qk_rope_head_dim")
        self.v_dim, self.rank = cfg.get("v_head_dim"), cfg.get("kv_lora_rank")
        bias = bool(cfg.get("attention_bias", default=False))
        q_rank = cfg.get("q_lora_rank", default=None)
        q_out = self.heads * (self.nope + self.rope)
        self.low_rank_q = bool(q_rank)
        if self.low_rank_q:
            self.q_a_proj = Linear(hidden, q_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(
                q_rank
            )  # DeepSeek's latent norms keep the default eps 1e-6
            self.q_b_proj = Linear(q_rank, q_out, bias=False)
        else:
            self.q_proj = Linear(hidden, q_out, bias=False)
        self.kv_a_proj_with_mqa = Linear(hidden, self.rank + self.rope, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.rank)
        self.kv_b_proj = Linear(self.rank, self.heads * (self.nope + self.v_dim), bias=False)
        self.kv_b_proj.quantizable = False  # absorbed into the attention below: its values are read
        self.o_proj = Linear(self.heads * self.v_dim, hidden, bias=bias)
        self.scale = softmax_scale(self.nope + self.rope, rotary.params)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return apply_rotary(deinterleave(x) if self.interleaved else x, cos, sin)

    def _queries(self, x: torch.Tensor) -> torch.Tensor:
        q = (
            self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
            if self.low_rank_q
            else self.q_proj(x)
        )
        return q.view(x.shape[0], self.heads, self.nope + self.rope)  # [T, h, nope+rope]

    def _expand(self, c_kv: torch.Tensor, k_pe: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Cached latents c_kv [L, rank], k_pe [L, rope] -> keys [L, h, nope+rope],
        values [L, h, v]."""
        L = c_kv.shape[0]
        kv = self.kv_b_proj(c_kv).view(L, self.heads, self.nope + self.v_dim)  # [L, h, nope+v]
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_pe[:, None, :].expand(L, self.heads, self.rope)], dim=-1)
        return k, v

    def _attend_absorbed(self, q_nope, q_pe, c_kv, k_pe) -> torch.Tensor:
        """The same attention without expanding the history: kv_b_proj's key half is folded into the
        queries and its value half applied after, so the n queries attend to the L latents directly
        (DeepSeek-V2 paper, section 2.1.3). q_nope [n, h, nope], q_pe [n, h, rope] -> [n, h, v]."""
        n, L = q_nope.shape[0], c_kv.shape[0]
        w = self.kv_b_proj.weight.view(self.heads, self.nope + self.v_dim, self.rank)
        w_k, w_v = w[:, : self.nope], w[:, self.nope :]  # [h, nope, rank], [h, v, rank]
        q_lat = torch.einsum("nhd,hdr->nhr", q_nope, w_k)  # [n, h, rank]
        scores = (
            torch.einsum("nhr,lr->nhl", q_lat, c_kv) + torch.einsum("nhd,ld->nhl", q_pe, k_pe)
        ) * self.scale
        if n > 1:  # query i sits at position L - n + i
            visible = torch.arange(L, device=scores.device)[None, :] <= torch.arange(
                n, device=scores.device
            )[:, None] + (L - n)  # [n, L]
            scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
        probs = torch.softmax(scores.float(), dim=-1).to(c_kv.dtype)  # [n, h, L]
        return torch.einsum(
            "nhr,hvr->nhv", torch.einsum("nhl,lr->nhr", probs, c_kv), w_v
        )  # [n, h, v]

    def _attend(self, q_nope, q_pe, c_kv, k_pe) -> torch.Tensor:
        # Expanding costs L * rank * h * (nope + v); absorbing costs about
        # n * L * h * (2 * rank + rope) more than plain attention: absorb for decode and small
        # chunks, expand for prefill. The absorbed form reads kv_b_proj's weight, without its LoRA
        # adapters: a sequence with an adapter on kv_b_proj expands.
        small = q_nope.shape[0] * (2 * self.rank + self.rope) < self.rank * (self.nope + self.v_dim)
        if small and not lora.active(self.kv_b_proj.adapters):
            return self._attend_absorbed(q_nope, q_pe, c_kv, k_pe)
        k, v = self._expand(c_kv, k_pe)
        return causal_attention(torch.cat([q_nope, q_pe], dim=-1), k, v, self.scale)

    def forward(self, x: torch.Tensor, cos_sin, ctx: KVContext) -> torch.Tensor:
        T = x.shape[0]
        cos, sin = cos_sin
        q_nope, q_pe = self._queries(x).split(
            [self.nope, self.rope], dim=-1
        )  # [T, h, nope], [T, h, rope]
        q_pe = self._rope(q_pe, cos, sin)
        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split(
            [self.rank, self.rope], dim=-1
        )  # [T, rank], [T, rope]
        c_kv = self.kv_a_layernorm(c_kv)
        k_pe = self._rope(k_pe[:, None, :], cos, sin)[:, 0]  # [T, rope]
        history = ctx.update(self.layer, c_kv, k_pe)
        outs, start, rows = [], 0, lora.current()
        for i, (n, (c_all, k_pe_all)) in enumerate(zip(ctx.seq_lens, history)):
            # kv_b_proj runs on the sequence's history, not on the pass's rows: its adapter is the
            # sequence's
            seq_rows = rows.sequence(i, len(c_all)) if rows and self.kv_b_proj.adapters else rows
            with lora.using(seq_rows):
                outs.append(
                    self._attend(
                        q_nope[start : start + n], q_pe[start : start + n], c_all, k_pe_all
                    )
                )
            start += n
        return self.o_proj(torch.cat(outs, dim=0).reshape(T, self.heads * self.v_dim))  # [T, H]
