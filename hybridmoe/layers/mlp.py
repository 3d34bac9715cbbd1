import torch
import torch.nn.functional as F
from torch import nn

from hybridmoe.layers.linear import Linear
from hybridmoe.layers.recompute import recompute


class GatedMLP(nn.Module):
    """Dense SwiGLU feed-forward: down(silu(gate x) * up x). Dense layers and shared experts."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = Linear(hidden, intermediate, bias=False)
        self.up_proj = Linear(hidden, intermediate, bias=False)
        self.down_proj = Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return recompute(self.training, self._forward, x)  # a training step keeps x alone

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
