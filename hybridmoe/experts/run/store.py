"""All routed-expert weights in host RAM, one record per (layer, expert).

An expert is its gate and up projections fused into one matrix [2I, H] (so that it is two matrix
products) and its down projection [H, I], each either a dense tensor in the store's dtype or a
QTensor of blocks (hybridmoe/quant): as the GGUF file stores them, or quantised at load (`quant`).
Blocks from a GGUF file stay views of its memory map: an expert's gate and up rows are two places
of the file (its slices of the gate and up stacks), joined as the parts of one QTensor, not copied.
Experts may differ in format (llama.cpp gives some layers' down projections more bits), so sizes are
counted from the records themselves."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch

from hybridmoe.experts.plan.shape import ExpertShape, Key
from hybridmoe.native.huge_pages import arena
from hybridmoe.quant.formats import FORMATS, suits
from hybridmoe.quant.tensor import QTensor, dense, for_kernels

Matrix = torch.Tensor | QTensor
# Dense experts' format names (experts/plan/cost_model.py FLOAT_BYTES)
DTYPE_FORMAT = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}


@dataclass
class ExpertWeights:
    gate_up: Matrix  # [2I, H]: rows 0..I-1 are the gate projection, I..2I-1 the up projection
    down: Matrix  # [H, I]

    def nbytes(self) -> int:
        return _nbytes(self.gate_up) + _nbytes(self.down)


def _nbytes(m: Matrix) -> int:
    return m.nbytes() if isinstance(m, QTensor) else m.numel() * m.element_size()


def format_of(m: Matrix) -> str:
    """A matrix's format name: its blocks' (q4_k, ...), or its dtype's (bf16, f32, f16)."""
    return m.fmt.blocks_of if isinstance(m, QTensor) else DTYPE_FORMAT.get(m.dtype, str(m.dtype))


class ExpertStore:
    """Host-RAM home of every routed expert, in ordinary (pageable, mmap-able) memory: experts
    reach the GPU through a few pinned staging buffers (experts/run/host_staging.py), so nothing
    here is page-locked."""

    def __init__(
        self,
        shape: ExpertShape,
        dtype: torch.dtype = torch.float32,
        quant: str | None = None,
    ):
        self.shape = shape
        self.dtype = dtype
        self.quant = (
            quant  # a format name of hybridmoe.quant.formats: dense experts are quantised to it
        )
        self.records: dict[Key, ExpertWeights] = {}
        self._bytes = 0
        self.version = 0  # counts puts: what was read of the records before a put may be stale

    def put(self, layer: int, expert: int, w_gate: Matrix, w_up: Matrix, w_down: Matrix) -> None:
        """Store one expert given its gate [I, H], up [I, H] and down [H, I] weights (blocks in
        the layout the CPU kernels read fastest: quant/tensor.py for_kernels)."""
        w = ExpertWeights(self._fused(w_gate, w_up), self._kept(w_down))
        self.records[(layer, expert)] = w
        self._bytes += w.nbytes()
        self.version += 1

    def _fused(self, gate: Matrix, up: Matrix) -> Matrix:
        if isinstance(gate, QTensor) and isinstance(up, QTensor) and gate.fmt == up.fmt:
            if gate.keep_layout or up.keep_layout:  # one read in place: both in one layout
                return QTensor.cat([gate, up])
            return QTensor.cat([for_kernels(gate), for_kernels(up)])
        if self.quant:
            return self._kept(torch.cat([dense(gate, self.dtype), dense(up, self.dtype)]))
        return arena().cat([dense(gate, self.dtype), dense(up, self.dtype)])  # [2I, H]

    def _kept(self, m: Matrix) -> Matrix:
        """As the store keeps it: blocks stay blocks (the loader put them); dense matrices in the
        store's dtype, or quantised to `quant` where their rows split into its blocks, copied into
        the arena (native/huge_pages.py): the kernels stream them from 2 MB pages."""
        if isinstance(m, QTensor):
            return for_kernels(m)
        if self.quant and suits(FORMATS[self.quant], m.shape[1]):
            q = QTensor.quantize(m, self.quant)
            return for_kernels(QTensor(arena().copy(q.data), q.fmt, q.cols))
        return arena().copy(m.to(self.dtype))

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
        """Bytes of one expert as stored (the mean, where formats differ)."""
        if self.records:
            return self._bytes // len(self.records)
        return self.shape.params_per_expert() * self.dtype.itemsize

    def format(self) -> str:
        """The experts' format: the one that holds most of their bytes (a Q4_K_M file keeps gate
        and up in q4_k and some layers' down in q6_k: q4_k); before loading, what they will be
        quantised to or the dtype's."""
        held = Counter()
        for w in self.records.values():
            held[format_of(w.gate_up)] += _nbytes(w.gate_up)
            held[format_of(w.down)] += _nbytes(w.down)
        if held:
            return held.most_common(1)[0][0]
        return kept_format(self.shape.hidden, self.shape.intermediate, self.dtype, self.quant)

    def total_nbytes(self) -> int:
        return self.expert_nbytes() * len(self.shape.moe_layers) * self.shape.num_experts


def kept_format(hidden: int, inter: int, dtype: torch.dtype, quant: str | None) -> str:
    """ExpertStore.format of experts stored from dense weights: each matrix is quantised to
    `quant` where its rows fill the blocks, else kept in `dtype`."""
    held, dense = Counter(), DTYPE_FORMAT.get(dtype, "bf16")
    for rows, cols in ((2 * inter, hidden), (hidden, inter)):  # gate_up, down
        fmt = FORMATS[quant] if quant and suits(FORMATS[quant], cols) else None
        nbytes = rows * (fmt.row_bytes(cols) if fmt else cols * dtype.itemsize)
        held[fmt.name if fmt else dense] += nbytes
    return held.most_common(1)[0][0]
