"""All routed-expert weights in host RAM, one record per (layer, expert).

The format (dtype) is a property of the store, chosen at load; every record holds the gate and up
projections fused into one matrix so that an expert is two matmuls.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridmoe.experts.plan.shape import ExpertShape, Key


@dataclass
class ExpertWeights:
    gate_up: torch.Tensor  # [2I, H]: rows 0..I-1 are the gate projection, I..2I-1 the up projection
    down: torch.Tensor  # [H, I]

    def nbytes(self) -> int:
        return (
            self.gate_up.numel() * self.gate_up.element_size()
            + self.down.numel() * self.down.element_size()
        )


class ExpertStore:
    """Host-RAM home of every routed expert; pinned memory when CUDA is present."""

    def __init__(
        self, shape: ExpertShape, dtype: torch.dtype = torch.float32, pin: bool | None = None
    ):
        self.shape = shape
        self.dtype = dtype
        self.pin = torch.cuda.is_available() if pin is None else pin
        self.records: dict[Key, ExpertWeights] = {}

    def put(
        self,
        layer: int,
        expert: int,
        w_gate: torch.Tensor,
        w_up: torch.Tensor,
        w_down: torch.Tensor,
    ) -> None:
        """Store one expert given its gate [I, H], up [I, H] and down [H, I] weights."""
        gate_up = torch.cat([w_gate, w_up], dim=0).to(self.dtype).contiguous()  # [2I, H]
        down = w_down.to(self.dtype).contiguous()  # [H, I]
        if self.pin:
            gate_up, down = gate_up.pin_memory(), down.pin_memory()
        self.records[(layer, expert)] = ExpertWeights(gate_up, down)

    def get(self, layer: int, expert: int) -> ExpertWeights:
        return self.records[(layer, expert)]

    def missing(self) -> list[Key]:
        """The (layer, expert) pairs that no weight has been stored for."""
        return [
            (layer, e)
            for layer in self.shape.moe_layers
            for e in range(self.shape.num_experts)
            if (layer, e) not in self.records
        ]

    def expert_nbytes(self) -> int:
        """Bytes of one expert in this store's format."""
        return self.shape.params_per_expert() * self.dtype.itemsize

    def total_nbytes(self) -> int:
        return self.expert_nbytes() * len(self.shape.moe_layers) * self.shape.num_experts
