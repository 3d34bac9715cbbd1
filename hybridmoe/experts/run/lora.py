"""LoRA on routed experts: one adapter's low-rank terms for every expert of one MoE layer, and the
expert op with them.

In PEFT's terms this is a LoRA on the layer's fused expert parameters (transformers >= 5 keeps
gate_up_proj [E, 2I, H] and down_proj [E, H, I]; peft's `target_parameters`): each expert e has its
own pair per matrix, gate_up adding scaling * B_e A_e to [gate; up] (A_e [r, H], B_e [2I, r]) and
down adding scaling * B_e A_e to down (A_e [r, I], B_e [H, r]). The frozen weights are the store's
records, used in place: never copied, never upcast.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from hybridmoe import native
from hybridmoe.experts.run.ffn import expert_ffn
from hybridmoe.experts.run.store import ExpertWeights, Matrix
from hybridmoe.quant.tensor import QTensor
from hybridmoe.quant.tensor import matmul as qmatmul

MATRICES = ("gate_up", "down")


def cast_factors(owner, slot: str, factors, dtype: torch.dtype, scaling: float = 1.0):
    """(A, scaling * B) in `dtype`, kept on `owner` under `slot` until a factor changes (its
    version counter moves when the optimizer updates it): serving converts them once, not at every
    projection and step."""
    key = (dtype, scaling, *(f._version for f in factors), *(id(f) for f in factors))
    cache = owner.__dict__.setdefault("_cast", {})
    if slot not in cache or cache[slot][0] != key:
        a, b = factors
        with torch.no_grad():
            cache[slot] = (key, a.to(dtype), (b * scaling).to(dtype))
    return cache[slot][1], cache[slot][2]


class ExpertLoRA(nn.Module):
    """One adapter on the routed experts of one layer; a matrix not targeted has no factors."""

    def __init__(
        self,
        num_experts: int,
        hidden: int,
        intermediate: int,
        rank: int,
        alpha: float,
        matrices: tuple[str, ...] = MATRICES,
    ):
        super().__init__()
        E, H, II, r = num_experts, hidden, intermediate, rank
        self.scaling = alpha / rank
        self.matrices = tuple(m for m in MATRICES if m in matrices)
        shapes = {"gate_up": ((E, r, H), (E, 2 * II, r)), "down": ((E, r, II), (E, H, r))}
        for m in MATRICES:
            a, b = shapes[m] if m in self.matrices else (None, None)
            setattr(self, f"{m}_A", nn.Parameter(torch.zeros(a)) if a else None)
            setattr(self, f"{m}_B", nn.Parameter(torch.zeros(b)) if b else None)

    def factors(self, matrix: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(A [E, r, in], B [E, out, r]) of `matrix`, or None when it is not targeted."""
        a = getattr(self, f"{matrix}_A")
        return None if a is None else (a, getattr(self, f"{matrix}_B"))

    def reset(self, generator: torch.Generator | None = None) -> None:
        """PEFT's initialisation of each expert's pair: A uniform in +-1/sqrt(in) (Kaiming with
        a = sqrt 5), B zero."""
        with torch.no_grad():
            for m in self.matrices:
                a, b = self.factors(m)
                bound = 1 / math.sqrt(a.shape[2])
                a.uniform_(-bound, bound, generator=generator)
                b.zero_()

    def delta_weight(self, matrix: str, expert: int) -> torch.Tensor:
        """scaling * B_e A_e: [2I, H] (gate_up) or [H, I] (down), what merging adds."""
        a, b = self.factors(matrix)
        return self.scaling * b[expert] @ a[expert]

    def cast(self, matrix: str, dtype: torch.dtype) -> Factors:
        """`matrix`'s factors of every expert in `dtype` (None when it is not targeted), converted
        once until the optimizer changes them."""
        f = self.factors(matrix)
        return None if f is None else cast_factors(self, matrix, f, dtype)


# (A [E, r, in], B [E, out, r]) of one matrix, in the dtype the expert computes in; or None
Factors = tuple[torch.Tensor, torch.Tensor] | None


def frozen(x: torch.Tensor, weight: Matrix) -> torch.Tensor:
    """x [n, in] through a store weight [out, in] -> [n, out]: blocks on the integer kernels, in x's
    dtype, as expert_ffn runs them; a dense weight in its dtype, on the native kernel for a few
    bf16 rows, as expert_ffn, else F.linear."""
    if isinstance(weight, QTensor):
        return qmatmul(x, weight)  # [n, out]
    x = x.to(weight.dtype)
    if native.applies(x, weight):
        return native.gemm(x, weight).to(weight.dtype)  # accumulated in fp32, rounded as F.linear
    return F.linear(x, weight)


def gate_up(
    x: torch.Tensor, w: ExpertWeights, f: Factors, e: int, scaling: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Expert e's [gate; up] pre-activations [n, 2I] for x [n, H] with its gate_up LoRA `f`, and
    the LoRA's x A^T [n, r] (None without one); in the store's dtype, as under autocast."""
    gu = frozen(x, w.gate_up)  # [n, 2I]
    if f is None:
        return gu, None
    xa = F.linear(x.to(gu.dtype), f[0][e])  # [n, r]
    return gu.add_(F.linear(xa, f[1][e]), alpha=scaling), xa


def down(
    h: torch.Tensor, w: ExpertWeights, f: Factors, e: int, scaling: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Expert e's down projection of h [n, I] with its LoRA `f` -> [n, H], and the LoRA's h A^T
    [n, r] (None without one)."""
    y = frozen(h, w.down)  # [n, H]
    if f is None:
        return y, None
    ha = F.linear(h.to(y.dtype), f[0][e])  # [n, r]
    return y.add_(F.linear(ha, f[1][e]), alpha=scaling), ha


def expert_ffn_lora(x: torch.Tensor, w: ExpertWeights, lora: ExpertLoRA, e: int) -> torch.Tensor:
    """expert_ffn (experts/run/ffn.py) of expert e with `lora`'s terms: x [n, H] -> [n, H]."""
    dtype, s = compute_dtype(w, x), lora.scaling
    gate, up = gate_up(x, w, _one(lora, "gate_up", e, dtype), 0, s)[0].chunk(2, dim=-1)
    return down(F.silu(gate) * up, w, _one(lora, "down", e, dtype), 0, s)[0].to(x.dtype)


def compute_dtype(w: ExpertWeights, x: torch.Tensor) -> torch.dtype:
    """The dtype an expert's products come out in: its dense weights', or for blocks x's."""
    return x.dtype if isinstance(w.gate_up, QTensor) else w.gate_up.dtype


def _one(lora: ExpertLoRA, matrix: str, e: int, dtype: torch.dtype) -> Factors:
    """Expert e's factors alone (as a stack of one) in `dtype`."""
    f = lora.cast(matrix, dtype)
    return None if f is None else (f[0][e : e + 1], f[1][e : e + 1])


@dataclass
class RowLoRA:
    """Which rows of a layer's input [T, H] use which adapter's expert LoRA (serving several
    adapters in one batch)."""

    adapter: torch.Tensor  # [T] int64: an index into `loras`, or -1 for the base model
    loras: list[ExpertLoRA]

    def rows(self, rows: torch.Tensor) -> torch.Tensor | None:
        """The adapter index of each of `rows` [n], or None when none of them has one."""
        which = self.adapter[rows]  # [n]
        return which if bool((which >= 0).any()) else None


def expert_rows(
    x: torch.Tensor, w: ExpertWeights, e: int, which: torch.Tensor, loras: list[ExpertLoRA]
) -> torch.Tensor:
    """Expert e on rows x [n, H] of several adapters (`which` [n]: index into `loras`, -1 none):
    each row as its own adapter, or the base model, computes it -> [n, H]."""
    first = int(which[0])
    if bool((which == first).all()):  # one adapter (or none) for all rows: the usual case
        return expert_ffn(x, w) if first < 0 else expert_ffn_lora(x, w, loras[first], e)
    out = torch.empty_like(x)  # [n, H]
    for a in which.unique().tolist():
        sel = (which == a).nonzero()[:, 0]  # [m]
        out[sel] = expert_ffn(x[sel], w) if a < 0 else expert_ffn_lora(x[sel], w, loras[a], e)
    return out
