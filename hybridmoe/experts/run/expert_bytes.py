"""An expert as one run of bytes: what crosses the bus and what a GPU cache slot holds.

An expert record (store.py `ExpertWeights`) is two matrices, each dense (bf16, fp32, ...) or in
blocks (a QTensor: uint8 rows of GGUF blocks). On its way to the GPU it is packed as its gate_up
bytes then its down bytes, exactly as they are stored (blocks stay blocks: a Q4_K expert moves and
sits in the cache at 4.5 bits a weight); a `Layout` says how to read those bytes back as the two
matrices, so a slot of the largest expert's size holds an expert of any format, and `view` gives
its weights without a copy."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridmoe.experts.run.store import ExpertWeights, Matrix
from hybridmoe.quant.formats import named
from hybridmoe.quant.tensor import QTensor


@dataclass(frozen=True)
class Part:
    """One matrix in the bytes: a block format's name, or a dense dtype; its [rows, cols]."""

    kind: str | torch.dtype
    rows: int
    cols: int
    nbytes: int


ALIGN = 16  # bytes: where the down matrix begins, so that a dense one can be viewed in its dtype


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass(frozen=True)
class Layout:
    gate_up: Part
    down: Part

    @property
    def down_at(self) -> int:
        return _aligned(self.gate_up.nbytes)

    @property
    def nbytes(self) -> int:
        """Bytes the packed expert spans, rounded up to ALIGN (so slots of it stay aligned)."""
        return _aligned(self.down_at + self.down.nbytes)


def _part(m: Matrix) -> Part:
    if isinstance(m, QTensor):
        return Part(m.fmt.name, m.shape[0], m.cols, m.nbytes())
    return Part(m.dtype, m.shape[0], m.shape[1], m.numel() * m.element_size())


def layout(w: ExpertWeights) -> Layout:
    return Layout(_part(w.gate_up), _part(w.down))


def as_bytes(m: Matrix) -> torch.Tensor:
    """A matrix's stored bytes, uint8 [nbytes], a view where it is contiguous."""
    if isinstance(m, QTensor):
        return m.data.reshape(-1)
    return m.contiguous().reshape(-1).view(torch.uint8)


def pack(w: ExpertWeights, out: torch.Tensor) -> Layout:
    """Copy expert `w`'s bytes into the front of `out` (uint8 [>= nbytes]); their layout."""
    lay = layout(w)
    out[: lay.gate_up.nbytes].copy_(as_bytes(w.gate_up))
    out[lay.down_at : lay.down_at + lay.down.nbytes].copy_(as_bytes(w.down))
    return lay


def _view(b: torch.Tensor, p: Part) -> Matrix:
    if isinstance(p.kind, str):
        fmt = named(p.kind)
        return QTensor(b.view(p.rows, fmt.row_bytes(p.cols)), fmt, p.cols)
    return b.view(p.kind).view(p.rows, p.cols)


def view(b: torch.Tensor, lay: Layout) -> ExpertWeights:
    """The expert whose bytes (packed by `pack`) begin `b` (uint8), as views of them."""
    at = lay.down_at
    return ExpertWeights(
        _view(b[: lay.gate_up.nbytes], lay.gate_up), _view(b[at : at + lay.down.nbytes], lay.down)
    )
