"""The backward pass of a layer's routed experts, on the CPU, through the frozen store records.

`expert_layer` is the training form of a layer's expert computation: the same weighted sum as the
runtime's (experts/run/ffn.py), as a `torch.autograd.Function` whose backward gives the gradients of
the layer input, of the routing weights (the router learns nothing unless asked, but the loss still
reaches earlier layers through them) and of the experts' LoRA factors (experts/run/lora.py). The
frozen weights stay the store's records, in their dtype: autograd never sees them, so it never keeps
or upcasts a copy, and nothing of size [2I, H] is made per expert.

Memory: the forward keeps only its inputs (x [T, H], the routing); the backward recomputes each
expert's [n, 2I] pre-activations rather than keeping them for every layer of the step. Per expert
with n rows, the backward costs the forward's two matmuls once more (the recomputed gate_up and the
input gradient through gate_up), plus the one through down.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hybridmoe.experts.run.ffn import group_by_expert
from hybridmoe.experts.run.lora import ExpertLoRA, expert_ffn_lora, gate_up
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
        out = torch.zeros(x.shape, dtype=torch.float32)  # [T, H]
        for e, rows, cols in groups:
            y = expert_ffn_lora(x[rows], store.get(layer, e), lora, e)  # [n, H]
            out.index_add_(0, rows, y.float() * topk_weights[rows, cols, None].float())
        ctx.save_for_backward(x, topk_weights, topk_ids)
        ctx.store, ctx.layer, ctx.lora, ctx.groups = store, layer, lora, groups
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        x, topk_weights, _ = ctx.saved_tensors
        lora = ctx.lora
        dx = torch.zeros(x.shape, dtype=torch.float32)  # [T, H]
        dw = torch.zeros(topk_weights.shape, dtype=torch.float32)  # [T, K]
        grads = {
            m: [torch.zeros_like(p) for p in f] for m in lora.matrices if (f := lora.factors(m))
        }
        for e, rows, cols in ctx.groups:
            w = ctx.store.get(ctx.layer, e)
            g = grad_out[rows].float()  # [n, H]
            wk = topk_weights[rows, cols, None].float()  # [n, 1]
            dx_e, dw_e = _expert_backward(x[rows], g, wk, w, lora, e, grads)
            dx.index_add_(0, rows, dx_e)
            dw[rows, cols] = dw_e
        flat = [t for m in ("gate_up", "down") for t in grads.get(m, (None, None))]
        return (dx.to(x.dtype), dw.to(topk_weights.dtype), *flat, None, None, None, None)


def _through(g: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """g [n, out] back through a frozen weight [out, in] -> [n, in] fp32, in the weight's dtype."""
    return (g.to(weight.dtype) @ weight).float()


def _expert_backward(x, g, wk, w: ExpertWeights, lora: ExpertLoRA, e: int, grads: dict):
    """One expert's rows: x [n, H], g = dLoss/d(layer output) [n, H], wk their routing weights
    [n, 1]. Returns dx [n, H] and d(routing weight) [n]; adds the LoRA gradients into `grads`."""
    s = lora.scaling
    gate, up = gate_up(x, w, lora, e).float().chunk(2, dim=-1)  # [n, I] each, recomputed
    sg = F.silu(gate)
    h = sg * up  # [n, I]
    # y = down(h); dLoss/dy = wk * g. The routing weight's gradient is <g, y> = <g down, h>.
    dh = _through(g, w.down)  # [n, I]
    f = lora.factors("down")
    if f is not None:
        a, b = f[0][e].float(), f[1][e].float()  # [r, I], [H, r]
        gb = g @ b  # [n, r]
        dh = dh + s * gb @ a
        da, db = grads["down"]
        da[e] += (s * (wk * gb).T @ h).to(da.dtype)  # [r, I]
        db[e] += (s * (wk * g).T @ (h @ a.T)).to(db.dtype)  # [H, r]
    dw = (dh * h).sum(dim=-1)  # [n]
    dh = dh * wk
    sig = torch.sigmoid(gate)
    dgate = dh * up * sig * (1 + gate * (1 - sig))  # silu'(z) = sig(z) (1 + z (1 - sig(z)))
    dgu = torch.cat([dgate, dh * sg], dim=-1)  # [n, 2I]
    dx = _through(dgu, w.gate_up)  # [n, H]
    f = lora.factors("gate_up")
    if f is not None:
        a, b = f[0][e].float(), f[1][e].float()  # [r, H], [2I, r]
        gb = dgu @ b  # [n, r]
        dx = dx + s * gb @ a
        da, db = grads["gate_up"]
        xf = x.float()
        da[e] += (s * gb.T @ xf).to(da.dtype)  # [r, H]
        db[e] += (s * dgu.T @ (xf @ a.T)).to(db.dtype)  # [2I, r]
    return dx, dw
