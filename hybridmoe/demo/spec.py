"""How the demo MoE splits each FFN (MoESpec) and what one layer's MoE is (LayerMoE)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from hybridmoe.errors import UserError


@dataclass(frozen=True)
class MoESpec:
    """How each FFN is split: `experts` routed experts, `top_k` of them per token, and a shared
    expert holding the fraction `shared` of the neurons (0: none)."""

    experts: int = 16
    top_k: int = 8
    shared: float = 0.5
    ffn: int = 1536

    def shared_size(self) -> int:
        return int(round(self.shared * self.ffn))

    def expert_size(self) -> int:
        return (self.ffn - self.shared_size()) // self.experts

    def active_fraction(self) -> float:
        """Fraction of each FFN's neurons that a token uses (the shared part counts)."""
        return (self.shared_size() + self.top_k * self.expert_size()) / self.ffn

    def tag(self) -> str:
        return f"e{self.experts}k{self.top_k}s{self.shared_size()}"

    def as_dict(self) -> dict:
        return asdict(self)

    def validate(self) -> MoESpec:
        if not 0.0 <= self.shared < 1.0:
            raise UserError(f"--shared must be in [0, 1), got {self.shared}.")
        if self.experts < 2:
            raise UserError(f"--experts must be at least 2, got {self.experts}.")
        if not 1 <= self.top_k <= self.experts:
            raise UserError(
                f"--top-k must be between 1 and --experts ({self.experts}), got {self.top_k}."
            )
        rest = self.ffn - self.shared_size()
        if rest % self.experts:
            raise UserError(
                f"the {rest} routed neurons per layer do not split into "
                f"{self.experts} equal experts; pick --experts dividing {rest}."
            )
        return self


DEFAULT_SPEC = MoESpec()


@dataclass
class LayerMoE:
    """One layer's MoE, in the dense FFN's neuron numbering."""

    shared: torch.Tensor  # [S] neuron ids of the shared expert (empty when none)
    experts: torch.Tensor  # [E, n] neuron ids of each routed expert
    router: torch.Tensor  # [E, H] router weight (logits = x @ router.T)
    down: torch.Tensor  # [H, F] down projection; routed columns expect weights summing to 1
