"""Attention over a KV cache, for a batch of sequences given as one flat token dimension.

The engine builds a `KVContext` for each step: how many new tokens each sequence brings (their rows
lie one after another in the flat [T, ...] tensors) and where their cache lives. A layer appends its
new cache entries and gets back, per sequence, the whole history. Entries are whatever the layer
caches: (k, v) for standard attention, (compressed kv, rope key) for MLA.

The engine's paged context also offers its pools and block tables (engine/paged_kv.py,
PagedKVContext.write/decode/histories): standard attention then hands the sequences that bring one
token to the native bf16 decode kernel, which reads their history in place (no gather).
"""

from __future__ import annotations

import threading
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from hybridmoe import native
from hybridmoe.layers.held import held
from hybridmoe.layers.linear import Linear, native_rows
from hybridmoe.layers.norm import RMSNorm
from hybridmoe.layers.packed_attention import packed_attention
from hybridmoe.layers.remade import parts, saved_as
from hybridmoe.layers.rotary import Rotary, apply_rotary, tables
from hybridmoe.native import quant as quant_kernels
from hybridmoe.native import rows as row_ops
from hybridmoe.quant.tensor import QTensor
from hybridmoe.quant.tensor import linears as qlinears


class KVContext(Protocol):
    seq_lens: list[int]  # new tokens of each sequence in this step, in row order (sum = T)

    def update(self, layer: int, *entries: torch.Tensor) -> list[tuple[torch.Tensor, ...]]:
        """Append this step's entries ([T, ...] each) to `layer`'s cache;
        return each sequence's history."""
        ...


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """q: [n, h, d], k: [L, kvh, d], v: [L, kvh, dv] -> [n, h, dv]; the n queries are the last n
    positions.

    The query heads that share a KV head are stacked as rows of one [g*n, d] matrix per KV head, so
    K and V are never repeated (repeating them copied the whole history every layer and step). The
    leading batch dimension matters: torch's CPU flash kernel takes only 4-D inputs, and 3-D ones
    fall back to the unfused math path. Chunks of more than one bf16 query on the CPU take the
    native kernel instead when it is available, several times faster
    (docs/notes/2026-11-24-measurements-in-code.md, "causal_attention"), unless gradients are being
    recorded (a training step): the kernel has no backward.
    """
    n, heads, d = q.shape
    if n > 1 and not torch.is_grad_enabled() and native.prefill_applies(q, k, v):
        return native.prefill_attention(q, k, v, scale)
    length, kv_heads = k.shape[0], k.shape[1]
    if torch.is_grad_enabled() and n == length:
        return _whole_sequence(q, k, v, scale)
    groups = heads // kv_heads
    # query head h uses KV head h // groups (as transformers' repeat_kv);
    # row order is (group, position)
    qg = (
        q.view(n, kv_heads, groups, d).permute(1, 2, 0, 3).reshape(1, kv_heads, groups * n, d)
    )  # [1, kvh, g*n, d]
    mask = None
    if n > 1:
        rows = torch.arange(n, device=q.device)[:, None] + (length - n)
        mask = (torch.arange(length, device=q.device)[None, :] <= rows).repeat(
            groups, 1
        )  # [g*n, L]
    out = F.scaled_dot_product_attention(
        qg, k.transpose(0, 1)[None], v.transpose(0, 1)[None], attn_mask=mask, scale=scale
    )  # [1, kvh, g*n, dv]
    return out.view(kv_heads, groups, n, -1).permute(2, 0, 1, 3).reshape(n, heads, -1)


# How many attention tables (Attention._block_table) were made: a decode plan that points to one
# is kept under this count (models/base.py CausalLM._plan), and a table made anywhere may have freed
# the one it pointed to.
_TABLES_MADE = [0]
_TABLES_LOCK = threading.Lock()


def tables_made() -> int:
    return _TABLES_MADE[0]


def _rows_of_cos(cos_sin, T: int, d: int) -> bool:
    """Whether cos and sin are what the native rotary reads: [T, d] fp32 on the CPU, unit stride
    along d, the same row stride, and the row library is there."""
    cos, sin = cos_sin
    return (
        cos.shape == (T, d)
        and cos.dtype == sin.dtype == torch.float32
        and cos.device.type == "cpu"
        and cos.stride() == sin.stride()
        and cos.stride(-1) == 1
        and row_ops.library() is not None
    )


def _weight_fields(w) -> tuple[int, int, int] | None:
    """A projection weight as bf16.c's attn_block holds it: (address, ggml type, bytes per row) of
    a matrix in blocks the integer kernels take (one part, on the CPU), (address, 0, 0) of a plain
    bf16 one (checked with the block's other tensors), None for neither."""
    if not isinstance(w, QTensor):
        return (w.data_ptr(), 0, 0) if isinstance(w, torch.Tensor) else None
    run = w.row_run(0, w.shape[0])
    if run is None or not w.parts[0].is_cpu or not quant_kernels.available():
        return None
    return run[0], w.fmt.ggml, run[1]


def _address(t) -> int:
    """Where a plain tensor's data lies (a parameter's .data may be swapped under it), 0 else."""
    return t.data_ptr() if isinstance(t, torch.Tensor) else 0


def _whole_sequence(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
    """causal_attention of a whole sequence (a training step: no cache, n == L) with the
    differentiable flash kernel's own causal mask and grouped heads: no [g*n, L] mask or stacked
    copy of q for the backward to keep, and the blocks above the diagonal skipped."""
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        is_causal=True,
        scale=scale,
        enable_gqa=True,
    )  # [1, h, n, dv]
    return out[0].transpose(0, 1)  # [n, h, dv]


class Attention(nn.Module):
    """Multi-head attention with grouped KV heads and RoPE (Llama, Mixtral, Qwen3-MoE, OLMoE).

    qk_norm: None, "head" (an RMSNorm over each head, Qwen3) or "full" (over all heads, OLMoE).
    bias: of q/k/v (default config's attention_bias); o_bias: of o_proj (default: as q/k/v, which is
    what Llama, Qwen3-MoE and OLMoE do; Qwen2-MoE has q/k/v biases and none on o_proj).
    """

    def __init__(
        self,
        cfg,
        layer: int,
        rotary: Rotary,
        qk_norm: str | None = None,
        bias: bool | None = None,
        o_bias: bool | None = None,
    ):
        super().__init__()
        self.layer = layer
        self.rotary = rotary
        hidden = cfg.get("hidden_size")
        self.heads = cfg.get("num_attention_heads")
        self.kv_heads = cfg.get("num_key_value_heads", default=self.heads)
        self.head_dim = cfg.head_dim()
        bias = cfg.get("attention_bias", default=False) if bias is None else bias
        self.q_proj = Linear(hidden, self.heads * self.head_dim, bias=bias)
        self.k_proj = Linear(hidden, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = Linear(hidden, self.kv_heads * self.head_dim, bias=bias)
        o_bias = bias if o_bias is None else o_bias
        self.o_proj = Linear(self.heads * self.head_dim, hidden, bias=o_bias)
        self.clip_qkv = cfg.get(
            "clip_qkv", default=None
        )  # OLMoE: clamp q, k, v after the q/k norms
        eps = cfg.get("rms_norm_eps", default=1e-6)
        self.qk_norm = qk_norm
        if qk_norm == "head":
            self.q_norm, self.k_norm = RMSNorm(self.head_dim, eps), RMSNorm(self.head_dim, eps)
        elif qk_norm == "full":
            self.q_norm = RMSNorm(self.heads * self.head_dim, eps)
            self.k_norm = RMSNorm(self.kv_heads * self.head_dim, eps)

    def forward(self, x: torch.Tensor, cos_sin, ctx: KVContext, remake=None) -> torch.Tensor:
        """x [T, H] -> [T, H]. `remake`: in a training step, what makes (q, k, v) again in the
        backward (layers/decoder.py), so that the attention's backward keeps its output alone and
        not them."""
        T = x.shape[0]
        q, k, v = self.qkv(x, cos_sin)  # [T, h, d], [T, kvh, d], [T, kvh, d]
        if remake is None:
            out = self.attend(q, k, v, ctx)  # [T, h, d]
        else:
            with saved_as(parts((q, k, v), remake)):
                out = self.attend(q, k, v, ctx)
        return self.o_proj(out.reshape(T, self.heads * self.head_dim))

    def qkv(self, x: torch.Tensor, cos_sin) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, H] -> q [T, h, d], k, v [T, kvh, d]: projected, normed, clipped, rotated."""
        T = x.shape[0]
        projections = (self.q_proj, self.k_proj, self.v_proj)
        if all(isinstance(p.weight, QTensor) and not p.adapters for p in projections):
            q, k, v = qlinears(x, [p.weight for p in projections], [p.bias for p in projections])
        else:
            q, k, v = (p(x) for p in projections)  # [T, h*d], [T, kvh*d], [T, kvh*d]
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip_qkv is not None:
            c = self.clip_qkv
            q, k, v = q.clamp(-c, c), k.clamp(-c, c), v.clamp(-c, c)
        q = q.view(T, self.heads, self.head_dim)
        k = k.view(T, self.kv_heads, self.head_dim)
        v = v.view(T, self.kv_heads, self.head_dim)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        # a training step's rotary runs in q's dtype: the tables cast once for every layer
        cos, sin = tables(cos_sin, q.dtype) if torch.is_grad_enabled() else cos_sin
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v

    def decoder_half(self, x: torch.Tensor, norms, cos_sin, ctx, next_w=None) -> tuple | None:
        """A decoder layer's attention half in one native call where the block takes this step
        (_block_table) and norms = (input norm, post-attention norm) are bf16 RMSNorms of one eps:
        (x + self(input_norm(x)), post_norm of that) [T, H] each, the bits of
        layers/decoder.py's steps, and the feed-forward's first product on the second, `linear` of
        it and next_w [N, H] (a plain bf16 weight the native kernels take, or None: no product)
        [T, N]; else None."""
        taken = self._half_args(x, norms, cos_sin, ctx)
        if taken is None:
            return None
        table, in_w, post_w, norm_eps, scale, eps = taken
        cos, sin = cos_sin
        return native.decoder_attention(
            table, (in_w, post_w, norm_eps), x, cos, sin, ctx.slots, ctx.decode, scale, eps, next_w
        )

    def decode_fields(self, x: torch.Tensor, norms, cos_sin, ctx) -> list[int] | None:
        """decoder_half's arguments as native.decode_layers' first fields (bf16.c's DL_ATTN to
        DL_QK_EPS: the block table, the norms' weights and eps, the scale, the q/k norms' eps),
        where decoder_half applies; else None. The tensors pointed to are held by the modules."""
        taken = self._half_args(x, norms, cos_sin, ctx)
        if taken is None:
            return None
        table, in_w, post_w, norm_eps, scale, eps = taken
        pointers = [table.data_ptr(), in_w.data_ptr(), post_w.data_ptr()]
        return pointers + [native.f32_bits(v) for v in (norm_eps, scale, eps)]

    def _half_args(self, x: torch.Tensor, norms, cos_sin, ctx) -> tuple | None:
        """(block table, input norm's weight, post norm's weight, their eps, scale, q/k norms' eps)
        where decoder_half applies; else None."""
        table = self._block_table(x, cos_sin, ctx)
        first, post = norms
        if table is None or first.eps != post.eps:
            return None
        in_w, post_w = held(first, "weight"), held(post, "weight")
        if not native.weights_apply(in_w, post_w):
            return None
        scale, eps = self.head_dim**-0.5, self.q_norm.eps if self.qk_norm else 0.0
        return table, in_w, post_w, first.eps, scale, eps

    def _block_table(self, x: torch.Tensor, cos_sin, ctx) -> torch.Tensor | None:
        """native.decoder_attention's table [25] for this step, or None where the block does not
        take it: a step whose rows all attend in the decode kernel (ctx.decode covers every
        sequence) on bf16 rows the native linear takes, weights plain bf16 or in blocks the integer
        kernels take (_weight_fields), no adapters, Llama or Qwen3 heads (no OLMoE norm over all
        heads, no clipping), pools made and on the CPU."""
        decode = getattr(ctx, "decode", None)
        if (
            decode is None
            or len(decode.seqs) != len(ctx.seq_lens)
            or self.qk_norm == "full"
            or self.clip_qkv is not None
            or torch.is_grad_enabled()
            or x.dim() != 2
            or x.stride(-1) != 1
            or not _rows_of_cos(cos_sin, x.shape[0], self.head_dim)
        ):
            return None
        pools = ctx.pools_of(self.layer)
        mods = self._modules  # dict reads: each nn.Module attribute lookup is a Python call
        projections = (mods["q_proj"], mods["k_proj"], mods["v_proj"], mods["o_proj"])
        if pools is None or any(p.adapters for p in projections):
            return None
        # A decode step meets the same tensors as the step before: the table stands while they do
        # (checking them all again took ~100 us a layer, on caches a layer's weights had emptied)
        norms = (
            (held(mods["q_norm"], "weight"), held(mods["k_norm"], "weight")) if self.qk_norm else ()
        )
        tensors = (
            *(held(p, "weight") for p in projections),
            *(p._parameters.get("bias") for p in projections),
            *norms,
            *pools,
        )
        key = (*map(id, tensors), *(_address(t) for t in tensors), quant_kernels.isa())
        if key == getattr(self, "_table_key", None) and native.applies(x, max_rows=native_rows(x)):
            return self._table
        weights, biases = tensors[:4], tensors[4:8]
        fields = [_weight_fields(w) for w in weights]
        plain = [w for w, f in zip(weights, fields) if f is not None and not f[1]]
        plain += [t for t in (*biases, *norms) if t is not None]
        if None in fields or not native.applies(x, *plain, *pools, max_rows=native_rows(x)):
            return None
        ptr = [f[0] for f in fields] + [0 if t is None else t.data_ptr() for t in biases]
        ptr += [t.data_ptr() for t in norms] or [0, 0]
        ptr += [pools[0].data_ptr(), pools[1].data_ptr()]
        ptr += [x.shape[1], self.heads, self.kv_heads, self.head_dim]
        ptr += [f[1] for f in fields] + [f[2] for f in fields] + [quant_kernels.isa()]
        # the table is remade whenever a tensor it points to is not where it was (a new KV cache
        # may reuse one pool's address and not the other's), or the integer kernels' path changed
        if getattr(self, "_table_ptr", None) != ptr:
            self._table = torch.tensor(ptr, dtype=torch.int64)  # [25]: bf16.c attn_block
            self._table_ptr = ptr
            with _TABLES_LOCK:  # two passes at once (overlap_prefill) may both make one
                _TABLES_MADE[0] += 1
        self._table_key = key
        return self._table

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: KVContext
    ) -> torch.Tensor:
        """q: [T, h, d], k, v: [T, kvh, d] -> [T, h, d]: every sequence's queries over its history.

        Sequences that bring one token take the native kernel, reading K and V from the paged pools
        through their block tables, when the context offers that view (`decode`) and the kernel
        takes these tensors (bf16 on the CPU, native.available()); the others, and every sequence of
        any other context, causal_attention over their history; a training pass's whole sequences
        (a context with `whole_sequences`, gradients on) go to packed_attention in one Function.
        The kernel needs no gather of a
        history whose blocks are not consecutive (docs/notes/2026-11-24-measurements-in-code.md,
        "Attention.attend")."""
        scale = self.head_dim**-0.5
        if torch.is_grad_enabled() and getattr(ctx, "whole_sequences", False):
            return packed_attention(q, k, v, ctx.seq_lens, scale)  # a training step
        out = q.new_empty(q.shape)  # [T, h, d]
        seqs = range(len(ctx.seq_lens))
        decode = getattr(
            ctx, "decode", None
        )  # the paged view (PagedKVContext), not every context has it
        if decode is None or not decode.seqs:
            history = ctx.update(self.layer, k, v)
        else:
            pools = ctx.write(self.layer, k, v)  # [slots, kvh, d] each
            if native.attention_applies(q, *pools):
                native.decode_attention(
                    q,
                    *pools,
                    decode.tables,
                    decode.table_starts,
                    decode.lengths,
                    decode.rows,
                    decode.block_size,
                    scale,
                    out,
                )
                done = set(decode.seqs)
                seqs = [i for i in seqs if i not in done]
            history = ctx.histories(pools, seqs)
        rows = [0]
        for n in ctx.seq_lens:
            rows.append(rows[-1] + n)
        for i, (k_all, v_all) in zip(seqs, history):
            start, end = rows[i], rows[i + 1]
            out[start:end] = causal_attention(q[start:end], k_all, v_all, scale)
        return out
