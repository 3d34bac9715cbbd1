"""The backward pass of a layer's routed experts, on the CPU, through the frozen store records.

`expert_layer` is the training form of a layer's expert computation: the same weighted sum as the
runtime's (experts/run/ffn.py), as a `torch.autograd.Function` whose backward gives the gradients of
the layer input, of the routing weights (the router learns nothing unless asked, but the loss still
reaches earlier layers through them) and of the experts' LoRA factors (experts/run/lora.py). The
frozen weights stay the store's records, in their dtype: autograd never sees them, so it never keeps
or upcasts a copy, and nothing of the size of an expert's weights is made.

What the forward keeps for the backward, per expert with n rows: its [gate; up] pre-activations
[n, 2I] and the LoRA's rank-r projections x A^T and h A^T [n, r]. The backward then costs two frozen
matmuls per expert (the input gradient through down and through gate_up), as many as the forward.
Everything computes in the store's dtype, the LoRA terms too (as under autocast: bf16 for a bf16
model); the outputs and the gradients are summed in fp32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hybridmoe.experts.run.ffn import group_by_expert
from hybridmoe.experts.run.lora import ExpertLoRA, down, gate_up
from hybridmoe.experts.run.store import ExpertStore, ExpertWeights


@dataclass
class TrainLoRA:
    """A training step's expert LoRA for one layer (None: no expert is adapted; the gradient still
    flows through the experts to their input)."""

    lora: ExpertLoRA | None


class _NoLoRA(ExpertLoRA):
    """An ExpertLoRA without factors, so that the code has one path."""

    def __init__(self):
        super().__init__(1, 1, 1, 1, 1.0, matrices=())


_NONE = _NoLoRA()


def expert_layer(
    store: ExpertStore,
    layer: int,
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    lora: ExpertLoRA | None,
) -> torch.Tensor:
    """x [T, H], topk_ids, topk_weights [T, K] -> [T, H]: the weighted sum of the chosen experts'
    outputs, differentiable in x, topk_weights and lora's factors."""
    lora = lora or _NONE
    params = [p for m in ("gate_up", "down") for p in (lora.factors(m) or (None, None))]
    return _ExpertLayer.apply(x, topk_weights, *params, topk_ids, store, layer, lora)


class _ExpertLayer(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, topk_weights, gu_a, gu_b, d_a, d_b, topk_ids, store, layer, lora):
        groups = group_by_expert(topk_ids)
        dtype, s = store.dtype, lora.scaling  # the experts compute in the store's dtype
        f_gu, f_d = lora.cast("gate_up", dtype), lora.cast("down", dtype)
        out = torch.zeros(x.shape, dtype=torch.float32)  # [T, H]
        kept = []
        for e, rows, cols in groups:
            w = store.get(layer, e)
            gu, xa = gate_up(x[rows], w, f_gu, e, s)  # [n, 2I]
            gate, up = gu.chunk(2, dim=-1)
            y, ha = down(F.silu(gate) * up, w, f_d, e, s)  # [n, H]
            out.index_add_(0, rows, y.float().mul_(topk_weights[rows, cols, None]))
            kept.append((gu, xa, ha))
        ctx.save_for_backward(x, topk_weights)
        ctx.store, ctx.layer, ctx.lora, ctx.groups, ctx.kept = store, layer, lora, groups, kept
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        x, topk_weights = ctx.saved_tensors
        lora, dtype = ctx.lora, ctx.store.dtype
        f_gu, f_d = lora.cast("gate_up", dtype), lora.cast("down", dtype)
        grad_out = grad_out.to(dtype)
        dx = torch.zeros(x.shape, dtype=torch.float32)  # [T, H]
        dw = torch.zeros(topk_weights.shape, dtype=torch.float32)  # [T, K]
        grads = {
            m: [torch.zeros_like(p) for p in f] for m in lora.matrices if (f := lora.factors(m))
        }
        for (e, rows, cols), kept in zip(ctx.groups, ctx.kept):
            w = ctx.store.get(ctx.layer, e)
            wk = topk_weights[rows, cols, None].to(dtype)  # [n, 1]
            f = (f_gu, f_d)
            dx_e, dw_e = _expert_backward(grad_out[rows], wk, kept, x, rows, w, f, e, lora, grads)
            dx.index_add_(0, rows, dx_e.float())
            dw[rows, cols] = dw_e.float()
        ctx.kept = None
        flat = [t for m in ("gate_up", "down") for t in grads.get(m, (None, None))]
        return (dx.to(x.dtype), dw.to(topk_weights.dtype), *flat, None, None, None, None)


def _expert_backward(g, wk, kept, x, rows, w: ExpertWeights, f, e, lora: ExpertLoRA, grads):
    """One expert's rows, in the store's dtype: g = dLoss/d(layer output) [n, H], wk their routing
    weights [n, 1], what the forward kept, f the LoRA factors (gate_up, down). Returns dx [n, H]
    and d(routing weight) [n]; adds the LoRA gradients into `grads` (fp32)."""
    s, (f_gu, f_d) = lora.scaling, f
    gu, xa, ha = kept
    gate, up = gu.chunk(2, dim=-1)  # [n, I] each
    sig = torch.sigmoid(gate)
    sg = gate * sig  # silu(gate)
    h = sg * up  # [n, I]
    # y = down(h); dLoss/dy = wk * g. The routing weight's gradient is <g, y> = <g down, h>.
    dh = g @ w.down  # [n, I]
    if f_d is not None:
        a, b = f_d[0][e], f_d[1][e]  # [r, I], [H, r]
        gb = g @ b  # [n, r]
        dh.addmm_(gb, a, alpha=s)
        da, db = grads["down"]
        da[e] += (s * (wk * gb).T @ h).float()  # [r, I]
        db[e] += (s * g.T @ (wk * ha)).float()  # [H, r]
    dw = (dh * h).sum(dim=-1)  # [n]
    dh = dh * wk
    dgate = dh * up * sig * (1 + gate * (1 - sig))  # silu'(z) = sig(z) (1 + z (1 - sig(z)))
    dgu = torch.cat([dgate, dh * sg], dim=-1)  # [n, 2I]
    dx = dgu @ w.gate_up  # [n, H]
    if f_gu is not None:
        a, b = f_gu[0][e], f_gu[1][e]  # [r, H], [2I, r]
        gb = dgu @ b  # [n, r]
        dx.addmm_(gb, a, alpha=s)
        da, db = grads["gate_up"]
        da[e] += (s * gb.T @ x[rows].to(gb.dtype)).float()  # [r, H]
        db[e] += (s * dgu.T @ xa).float()  # [2I, r]
    return dx, dw
