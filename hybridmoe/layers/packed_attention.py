"""Causal attention over whole packed sequences with gradients: a training step's attention.

A training pass packs several sequences one after another into [T] rows, each attending only to
itself (train/forward.py). Each sequence goes through torch's CPU flash kernel (its own causal
mask, grouped heads without repeating K and V); the outputs are written into one [T, h, dv]
tensor, which is both what the backward keeps and the o_proj input, so the attention's output is
kept once (autograd over the per-sequence kernel calls kept each kernel's output and the o_proj
input, a copy). The backward runs the flash kernel's backward per sequence on views of what was
kept. Sequences of one length that lie one after another go through the kernel as one batch
(the flash backward spreads a batch's heads over the threads: 4 x 256 tokens of the demo's 9 heads
took 11.5 ms in one call against 15 ms in four, docs/notes/2026-11-25-finetune-dense-experts.md).
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


def _heads_first(t: torch.Tensor, count: int) -> torch.Tensor:
    """`count` sequences' rows [count n, heads, d] -> the kernel's [count, heads, n, d] (a view)."""
    return t.view(count, -1, *t.shape[1:]).transpose(1, 2)


def _runs(seq_lens: list[int]) -> list[tuple[slice, int]]:
    """(rows, how many sequences) of each run of consecutive sequences of one length."""
    runs, start, i = [], 0, 0
    while i < len(seq_lens):
        j = i
        while j < len(seq_lens) and seq_lens[j] == seq_lens[i]:
            j += 1
        end = start + (j - i) * seq_lens[i]
        runs.append((slice(start, end), j - i))
        start, i = end, j
    return runs


class _Packed(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, seq_lens, scale):
        out = q.new_empty(q.shape[:2] + v.shape[2:])  # [T, h, dv]
        lses = []
        for s, m in _runs(seq_lens):
            o, lse = _flash(
                *(_heads_first(t[s], m) for t in (q, k, v)), 0.0, True, scale=scale
            )  # [m, h, n, dv], [m, h, n] fp32
            out[s] = o.transpose(1, 2).reshape(out[s].shape)
            lses.append(lse)
        ctx.save_for_backward(q, k, v, out, *lses)
        ctx.seq_lens, ctx.scale = seq_lens, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, *lses = ctx.saved_tensors
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        for (s, m), lse in zip(_runs(ctx.seq_lens), lses):
            grads = _flash_backward(
                *(_heads_first(t[s], m) for t in (grad_out, q, k, v, out)),
                lse,
                0.0,
                True,
                scale=ctx.scale,
            )  # [m, heads, n, d] each
            for full, g in zip((dq, dk, dv), grads):
                full[s] = g.transpose(1, 2).reshape(full[s].shape)
        return dq, dk, dv, None, None
