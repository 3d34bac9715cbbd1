import torch
import torch.nn.functional as F
from torch import nn

from hybridmoe.layers.linear import Linear
from hybridmoe.layers.recompute import recompute
from hybridmoe.layers.remade import Remade, saved_as


class GatedMLP(nn.Module):
    """Dense SwiGLU feed-forward: down(silu(gate x) * up x). Dense layers and shared experts.

    In a training step a dense layer's MLP keeps only its input and runs again in the backward
    (layers/recompute.py); with `keep` (shared experts, which are narrow) it keeps its gate and up
    products instead, [T, 2I] in the activations' dtype, and is not run again:
    the memory that recomputing would save is bought back elsewhere (docs/finetune.md, "Memory")."""

    def __init__(self, hidden: int, intermediate: int, keep: bool = False):
        super().__init__()
        self.gate_proj = Linear(hidden, intermediate, bias=False)
        self.up_proj = Linear(hidden, intermediate, bias=False)
        self.down_proj = Linear(intermediate, hidden, bias=False)
        self.keep = keep

    def forward(self, x: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, H] -> [T, H], times `scale` [T, 1] where given (Qwen2-MoE's shared-expert gate)."""
        if self.keep:
            return self._kept(x, scale)
        y = recompute(self.training, self._forward, x)  # a training step keeps x alone
        return y if scale is None else scale * y

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_mul(self.gate_proj(x), self.up_proj(x)))

    def _kept(self, x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
        """forward, the backward keeping gate and up [T, I] each and making the down input
        silu(gate) * up again from them (an elementwise op) rather than keeping it too. A row
        scale is taken into the down input, down(scale h) = scale down(h), so that the scale's
        gradient <g, down(h)> = <down^T g, h> needs h, made again, not the output [T, H]."""
        gate, up = self.gate_proj(x), self.up_proj(x)  # [T, I] each
        h = silu_mul(gate, up)  # [T, I]
        if not h.requires_grad:
            y = self.down_proj(h)
            return y if scale is None else scale * y
        scaled = None  # h * scale [T, I], made below

        def pick(t: torch.Tensor) -> Remade | None:
            if t is h:
                return Remade(lambda: F.silu(gate) * up)
            if t is scaled:
                return Remade(lambda: F.silu(gate) * up * scale)
            return None

        with saved_as(pick):
            scaled = h if scale is None else h * scale
            return self.down_proj(scaled)  # [T, H]


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, elementwise; while gradients are recorded, as `_SiluMul`."""
    if torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad):
        return _SiluMul.apply(gate, up)
    return F.silu(gate) * up


class _SiluMul(torch.autograd.Function):
    """silu(gate) * up keeping gate and up alone (autograd over the two ops also kept silu(gate)),
    its backward from the formula in their dtype: silu'(z) = sig(z) (1 + z (1 - sig(z)))."""

    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, dh):
        gate, up = ctx.saved_tensors
        sig = torch.sigmoid(gate)
        dgate = dh * up * sig * (1 + gate * (1 - sig))
        dup = dh * gate * sig
        return dgate, dup
