"""Causal attention over whole packed sequences with gradients: a training step's attention.

A training pass packs several sequences one after another into [T] rows, each attending only to
itself (train/forward.py). Each sequence goes through torch's CPU flash kernel (its own causal
mask, grouped heads without repeating K and V); the outputs are written into one [T, h, dv]
tensor, which is both what the backward keeps and the o_proj input, so the attention's output is
kept once (autograd over the per-sequence kernel calls kept each kernel's output and the o_proj
input, a copy). The backward runs the flash kernel's backward per sequence on views of what was
kept.
"""

from __future__ import annotations

import torch

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def packed_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_lens: list[int], scale: float
) -> torch.Tensor:
    """q [T, h, d], k [T, kvh, d], v [T, kvh, dv] -> [T, h, dv]: each sequence of `seq_lens`
    (rows one after another) attends causally to its own rows."""
    return _Packed.apply(q, k, v, list(seq_lens), scale)


def _heads_first(t: torch.Tensor) -> torch.Tensor:
    """[n, heads, d] -> the kernel's [1, heads, n, d] (a view)."""
    return t.transpose(0, 1)[None]


def _spans(seq_lens: list[int]) -> list[slice]:
    spans, start = [], 0
    for n in seq_lens:
        spans.append(slice(start, start + n))
        start += n
    return spans


class _Packed(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, seq_lens, scale):
        out = q.new_empty(q.shape[:2] + v.shape[2:])  # [T, h, dv]
        lses = []
        for s in _spans(seq_lens):
            o, lse = _flash(
                _heads_first(q[s]), _heads_first(k[s]), _heads_first(v[s]), 0.0, True, scale=scale
            )  # [1, h, n, dv], [1, h, n] fp32
            out[s] = o[0].transpose(0, 1)
            lses.append(lse)
        ctx.save_for_backward(q, k, v, out, *lses)
        ctx.seq_lens, ctx.scale = seq_lens, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, *lses = ctx.saved_tensors
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        for s, lse in zip(_spans(ctx.seq_lens), lses):
            grads = _flash_backward(
                _heads_first(grad_out[s]),
                *(_heads_first(t[s]) for t in (q, k, v, out)),
                lse,
                0.0,
                True,
                scale=ctx.scale,
            )  # [1, heads, n, d] each
            for full, g in zip((dq, dk, dv), grads):
                full[s] = g[0].transpose(0, 1)
        return dq, dk, dv, None, None
