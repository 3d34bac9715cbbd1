"""A training step's routed experts computed for every token and every expert: the form for a layer
whose tokens choose a large share of its experts (the demo: 8 of 16).

The grouped form (expert_grad.py) runs each expert on its own rows: per expert and tile, a gather,
small products and Python, which on the demo's narrow experts (I = 48) cost more than the products.
Here the layer is four large products, each over all E experts at once: x [T, H] @ gate_up
[H, E 2I], h [T, E I] @ down [E I, H] and their two transposes in the backward. A token's weight
for an expert it did not choose is 0, so those experts add nothing to the output or to any
gradient; the products do E / K times the multiply-adds of the chosen experts' (2x on the demo), at
the speed of a large product rather than of many small ones
(docs/notes/2026-11-25-finetune-dense-experts.md).

The frozen weights are the store's records: each product's matrix is the layer's records joined
([E 2I, H], [H, E I]; one layer's, in the store's dtype, for the length of the product), never
upcast or kept. The LoRA terms, the activations between the products and every sum run in fp32, as
in the grouped form; the forward keeps, as it does, only the chosen experts' [gate; up] [T, K, 2I]
in the store's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybridmoe import tuning
from hybridmoe.experts.run.store import ExpertStore
from hybridmoe.quant.tensor import QTensor


def dense_applies(store: ExpertStore, layer: int, chosen: int) -> bool:
    """Whether a layer's experts run in this form: dense records (not blocks) and tokens that each
    choose at least TRAIN_DENSE_EXPERT_SHARE of the layer's experts."""
    experts = store.shape.num_experts
    if chosen < tuning.TRAIN_DENSE_EXPERT_SHARE * experts:
        return False
    records = [store.get(layer, e) for e in range(experts)]
    return not any(isinstance(m, QTensor) for w in records for m in (w.gate_up, w.down))


def dense_experts(store, layer, x, topk_ids, topk_weights, gu_a, gu_b, d_a, d_b, scaling):
    """x [T, H], topk_ids, topk_weights [T, K], the LoRA factors (A [E, r, in], B [E, out, r], None
    where not adapted) -> [T, H], differentiable in x, topk_weights and the factors."""
    return _Dense.apply(x, topk_weights, gu_a, gu_b, d_a, d_b, topk_ids, store, layer, scaling)


def _joined(store: ExpertStore, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's gate_up records as one [E 2I, H] and its down records as one [H, E I]."""
    records = [store.get(layer, e) for e in range(store.shape.num_experts)]
    gate_up = torch.cat([w.gate_up for w in records])  # [E 2I, H]
    down = torch.cat([w.down for w in records], dim=1)  # [H, E I]
    return gate_up, down


def _dense_weights(ids: torch.Tensor, weights: torch.Tensor, experts: int) -> torch.Tensor:
    """Each token's routing weight of every expert, 0 where not chosen: [T, E] fp32."""
    dense = torch.zeros(len(ids), experts)  # [T, E]
    return dense.scatter_add_(1, ids, weights.float())


class _Dense(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, topk_weights, gu_a, gu_b, d_a, d_b, topk_ids, store, layer, s):
        T, E, dtype = len(x), store.shape.num_experts, store.dtype
        gate_up, down = _joined(store, layer)
        wd = _dense_weights(topk_ids, topk_weights, E)[..., None]  # [T, E, 1]
        gu = F.linear(x.to(dtype), gate_up).float()  # [T, E 2I]
        if gu_a is not None:  # one product with the B's as a block diagonal [E r, E 2I]
            gu.addmm_(_x_a(x.float(), gu_a).view(T, -1), torch.block_diag(*gu_b.mT), alpha=s)
        gu = gu.view(T, E, -1)  # [T, E, 2I]
        gate, up = gu.chunk(2, dim=-1)  # [T, E, I] each
        h = F.silu(gate).mul_(up)  # [T, E, I]
        y = F.linear((h * wd).to(dtype).view(T, -1), down).float()  # [T, H]
        if d_a is not None:
            ha = torch.einsum("tei,eri->ter", h, d_a)  # [T, E, r]
            y.addmm_((ha * wd).reshape(T, -1), _b_rows(d_b), alpha=s)
        chosen = topk_ids[..., None].expand(-1, -1, gu.shape[-1])  # [T, K, 2I]
        ctx.save_for_backward(x, topk_weights, topk_ids, gu.gather(1, chosen).to(dtype))
        ctx.factors, ctx.store, ctx.layer, ctx.s = (gu_a, gu_b, d_a, d_b), store, layer, s
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, g):
        x, topk_weights, ids, kept = ctx.saved_tensors
        gu_a, gu_b, d_a, d_b = ctx.factors
        s, store, T = ctx.s, ctx.store, len(x)
        gate_up, down = _joined(store, ctx.layer)
        E, dtype = store.shape.num_experts, store.dtype
        wd = _dense_weights(ids, topk_weights, E)[..., None]  # [T, E, 1]
        gu = torch.zeros(T, E, kept.shape[-1])  # [T, E, 2I]: 0 where not chosen
        gu.scatter_(1, ids[..., None].expand_as(kept), kept.float())
        gate, up = gu.chunk(2, dim=-1)  # [T, E, I] each
        sig = torch.sigmoid(gate)
        sg = gate * sig  # silu(gate)
        h = sg * up  # [T, E, I]
        dh = (g.to(dtype) @ down).float().view(T, E, -1)  # [T, E, I]: dLoss/dh, unweighted
        grads = [None] * 4
        if d_a is not None:
            grads[2:], gdb = _down_lora_grads(g.float(), h, wd, d_a, d_b, s)
            dh += torch.einsum("ter,eri->tei", gdb.mul_(s), d_a)
        dw = (dh * h).sum(dim=-1).gather(1, ids)  # [T, K]: <g, expert output>
        dh *= wd
        dgu = torch.empty(gu.shape)  # [T, E, 2I]
        dgate, dup = dgu.chunk(2, dim=-1)
        torch.mul(dh, sg, out=dup)
        # silu'(z) = sig(z) (1 + z (1 - sig(z))) = sig (1 + z - silu(z))
        torch.sub(gate, sg, out=dgate).add_(1).mul_(sig).mul_(up).mul_(dh)
        dx = (dgu.to(dtype).view(T, -1) @ gate_up).float()  # [T, H]
        if gu_a is not None:
            grads[:2] = _gate_up_lora_grads(x.float(), dgu, dx, gu_a, gu_b, s)
        return (dx.to(x.dtype), dw.to(topk_weights.dtype), *grads, None, None, None, None)


def _x_a(xf: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """x A_e^T for every token and expert: xf [T, H], a [E, r, H] -> [T, E, r]."""
    e, r, h = a.shape
    return (xf @ a.reshape(e * r, h).T).view(len(xf), e, r)


def _b_rows(b: torch.Tensor) -> torch.Tensor:
    """B [E, out, r] as [E r, out]: the rows that the weighted [T, E r] rank terms multiply."""
    return b.transpose(1, 2).reshape(-1, b.shape[1])


def _down_lora_grads(gf, h, wd, a, b, s):
    """The down LoRA's A [E, r, I] and B [E, H, r] gradients, and dLoss/d(h A^T) B^T's rank term
    g B_e [T, E, r] (unweighted), for gf = dLoss/dy [T, H] fp32."""
    T, E, r = len(gf), a.shape[0], a.shape[1]
    gdb = (gf @ _b_rows(b).T).view(T, E, r)  # [T, E, r]
    grad_a = s * torch.einsum("ter,tei->eri", gdb * wd, h)  # [E, r, I]
    ha = torch.einsum("tei,eri->ter", h, a) * wd  # [T, E, r], weighted
    grad_b = s * (ha.reshape(T, -1).T @ gf).view(E, r, -1).transpose(1, 2)  # [E, H, r]
    return [grad_a, grad_b], gdb


def _gate_up_lora_grads(xf, dgu, dx, a, b, s):
    """The gate_up LoRA's A [E, r, H] and B [E, 2I, r] gradients for dgu = dLoss/d(gate_up)
    [T, E, 2I]; adds its part of the input gradient to dx [T, H]."""
    T, (E, r, H) = len(xf), a.shape
    gb = torch.einsum("teo,eor->ter", dgu, b).reshape(T, E * r)  # [T, E r]
    dx.addmm_(gb, a.reshape(E * r, H), alpha=s)
    grad_a = s * (gb.T @ xf).view(E, r, H)
    grad_b = s * torch.einsum("teo,ter->eor", dgu, _x_a(xf, a))  # [E, 2I, r]
    return [grad_a, grad_b]
