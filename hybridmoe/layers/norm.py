"""RMS norm, and its backward written out: a training step keeps only the norm's input."""

from collections.abc import Callable

import torch
from torch import nn

from hybridmoe.layers.remade import Remade, saved_as
from hybridmoe.native import rows


class RMSNorm(nn.Module):
    """RMS norm computed in fp32, as Hugging Face's Llama-family models do; bf16 rows outside
    training in one native call (native/rows.py) with the same roundings. While gradients are
    recorded it runs as `_RMSNorm`: autograd over the nine ops kept an fp32 copy of the input and
    two more [T, n] tensors per norm, and ran nine backward ops."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad):
            return _RMSNorm.apply(x, self.weight, self.eps)
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * (x * rsqrt(mean(x^2) + eps)), the product in fp32 and rounded to x's dtype before
    the weight (Hugging Face's order)."""
    if rows.rmsnorm_applies(x, weight):
        return rows.rmsnorm(x, weight, eps)
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


class _RMSNorm(torch.autograd.Function):
    """rms_norm with a backward from its formula: it keeps x alone (the residual stream, which the
    layer keeps anyway) and makes the scale again, one [T] reduction. The rounding of the normed
    rows to x's dtype is taken as the identity in the backward, as autograd takes it."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        return rms_norm(x, weight, eps)

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        xf = x.float()
        r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + ctx.eps)  # [..., 1]
        n = xf * r  # [..., n] the normed rows, fp32
        dx = dw = None
        if ctx.needs_input_grad[0]:
            gn = g.float() * weight.float()  # dLoss/d(normed rows) [..., n]
            # d(x r)/dx: r (gn - n mean(gn n)), since dr/dx = -r^3 x / n
            dx = gn.sub_(n * (gn * n).mean(-1, keepdim=True)).mul_(r).to(x.dtype)
        if ctx.needs_input_grad[1]:
            dw = (g.float() * n.to(x.dtype).float()).reshape(-1, n.shape[-1]).sum(0)
            dw = dw.to(weight.dtype)
        return dx, dw, None


def through_norm(norm: RMSNorm, x: torch.Tensor, fn: Callable) -> torch.Tensor:
    """fn(norm(x)), x [T, n]. While gradients are recorded, the normed rows [T, n] that fn's
    backward keeps (its LoRA factors' input, the routed experts' input) are not kept: they are
    made again from x, which the norm keeps anyway, when the backward first asks for them, once
    for all the ops that saved them."""
    h = norm(x)  # [T, n]
    if not h.requires_grad:
        return fn(h)
    key = _layout(h)
    remade = Remade(lambda: rms_norm(x, norm.weight, norm.eps))
    with saved_as(lambda t: remade if _layout(t) == key else None):
        return fn(h)


def _layout(t: torch.Tensor) -> tuple:
    """What tells the forward's normed rows from other saved tensors: memory, shape, layout."""
    return (t.data_ptr(), t.shape, t.stride(), t.dtype)
