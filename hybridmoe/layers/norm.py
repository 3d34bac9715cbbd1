import torch
from torch import nn

from hybridmoe.native import rows


class RMSNorm(nn.Module):
    """RMS norm computed in fp32, as Hugging Face's Llama-family models do; bf16 rows outside
    training in one native call (native/rows.py) with the same roundings."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if rows.rmsnorm_applies(x, self.weight):
            return rows.rmsnorm(x, self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)
