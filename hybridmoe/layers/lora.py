"""LoRA on a dense projection, and which adapter each row of a forward pass uses.

An adapter adds `scaling * B (A x)` to a projection's output (Hu et al. 2021; PEFT's lora.Linear):
A [r, in], B [out, r]. A projection may carry several adapters at once (a server with several
`--lora`), each applied only to the rows of the requests that asked for it. `RowAdapters` says which
rows those are for the pass in progress on this thread: the engine sets it around a pass, the
trainer around a training step. A projection without adapters, or a pass without `RowAdapters`, runs
exactly as before.

The adapters are not submodules of the projection (a plain dict), so that the model's parameters,
checkpoint names and loading stay those of the base model; models/lora.py finds them.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from hybridmoe.experts.run.lora import cast_factors


class LoRA(nn.Module):
    """One adapter on one projection: x [n, in] -> scaling * (dropout(x) A^T) B^T [n, out].

    The factors are kept in fp32 (they are what trains) and computed in x's dtype, as under
    torch.autocast: for a bf16 model the backward then keeps x itself (which q, k and v share)
    rather than an fp32 copy per projection. Dropout acts only while gradients are being recorded
    (training steps), never in evaluation or serving."""

    def __init__(
        self, in_features: int, out_features: int, rank: int, alpha: float, dropout: float = 0.0
    ):
        super().__init__()
        self.lora_A = nn.Parameter(torch.zeros(rank, in_features))  # [r, in]
        self.lora_B = nn.Parameter(torch.zeros(out_features, rank))  # [out, r]
        self.scaling = alpha / rank
        self.dropout = dropout

    def reset(self, generator: torch.Generator | None = None) -> None:
        """PEFT's default initialisation: A Kaiming-uniform (a = sqrt 5, as nn.Linear), B zero, so
        that a new adapter changes nothing."""
        bound = 1 / math.sqrt(self.lora_A.shape[1])  # kaiming_uniform_ with a = sqrt(5)
        with torch.no_grad():
            self.lora_A.uniform_(-bound, bound, generator=generator)
            self.lora_B.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():  # serving, evaluation: the factors as x's, cached
            a, b = cast_factors(self, "ab", (self.lora_A, self.lora_B), x.dtype, self.scaling)
            return F.linear(F.linear(x, a), b)  # [n, out]
        a, b = self.lora_A.to(x.dtype), (self.lora_B * self.scaling).to(x.dtype)  # [out, r]
        if self.dropout:
            x = F.dropout(x, self.dropout)
        return F.linear(F.linear(x, a), b)  # [n, out]; scaled in B, not over [n, out]

    def delta_weight(self) -> torch.Tensor:
        """scaling * B A [out, in]: what merging adds to the projection's weight."""
        return self.scaling * self.lora_B @ self.lora_A


@dataclass
class RowAdapters:
    """The adapter of each sequence of a pass (None: the base model), the sequences' rows lying one
    after another as `seq_lens` says (the layout of the model's flat [T] inputs)."""

    seq_lens: list[int]
    names: list[str | None]
    _groups: list | None = field(default=None, repr=False)

    @staticmethod
    def all(name: str, num_rows: int) -> RowAdapters:
        """Every row uses adapter `name` (a training step; generate --lora)."""
        return RowAdapters([num_rows], [name])

    def groups(self) -> list[tuple[str, torch.Tensor | None]]:
        """(adapter, rows [n] or None for all rows) for each adapter used in the pass; computed once
        per pass, not per layer."""
        if self._groups is None:
            rows: dict[str, list[int]] = {}
            start = 0
            for n, name in zip(self.seq_lens, self.names):
                if name is not None:
                    rows.setdefault(name, []).extend(range(start, start + n))
                start += n
            self._groups = [
                (name, None if len(r) == start else torch.tensor(r)) for name, r in rows.items()
            ]
        return self._groups

    def sequence(self, i: int, num_rows: int) -> RowAdapters:
        """Sequence i's adapter on `num_rows` rows: for a projection applied to one sequence's
        history rather than to the pass's rows (MLA's kv_b_proj). A pass with one adapter for all
        its rows (`all`) has it for every sequence."""
        return RowAdapters([num_rows], [self.names[0 if len(self.names) == 1 else i]])


class _Current(threading.local):
    rows: RowAdapters | None = None  # the pass in progress on this thread


_current = _Current()


def current() -> RowAdapters | None:
    return _current.rows


@contextmanager
def using(rows: RowAdapters | None) -> Iterator[None]:
    """Run the passes inside with `rows` as this thread's row adapters."""
    before, _current.rows = _current.rows, rows
    try:
        yield
    finally:
        _current.rows = before


def add_lora(y: torch.Tensor, x: torch.Tensor, adapters: dict[str, LoRA]) -> torch.Tensor:
    """y [n, out], a projection's output for x [n, in], plus each adapter's term on its rows."""
    rows = _current.rows
    if not adapters or rows is None:
        return y
    for name, index in rows.groups():
        lora = adapters.get(name)
        if lora is None:
            continue
        if index is None:
            y = y + lora(x).to(y.dtype)  # out of place: the trainer differentiates through it
        else:
            y = y.index_add(0, index, lora(x[index]).to(y.dtype))
    return y


def active(adapters: dict[str, LoRA]) -> bool:
    """Whether any of `adapters` applies to a row of the pass in progress."""
    rows = _current.rows
    return bool(adapters) and rows is not None and any(n in adapters for n, _ in rows.groups())
