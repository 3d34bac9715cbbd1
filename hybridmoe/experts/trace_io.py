"""Routing traces on the tensor side: replay a trace's expert choices, record the model's own.

- `RoutingReplay` (--routing-trace FILE): the model takes its top-k ids from the trace instead of
  its router, so that a random-weight model with real shapes sees real routing. Every token row
  of every step (prefill included) consumes the next trace line, cycling at the end; MoE layer i
  takes the trace's layer i mod (trace layers), so a short trace can drive a deeper model.
- `TraceRecorder` (--record-trace FILE): one line per decode token, in the format of
  experts/trace_format.py (its writer): {"tok": n, "layers": [[ids], ...], "probs": [[w], ...],
  "req": id}. "probs" are the routing weights the model used for those ids.

Which rows of a step are decode tokens, and of which request, is the engine's knowledge: it says
so with `rows`; without it, a one-token step is a decode step of request 0 and a longer one
(a prompt) is not recorded.
"""

from __future__ import annotations

from pathlib import Path

import torch

from hybridmoe.errors import UserError
from hybridmoe.experts.trace_format import TraceLine, TraceWriter, read_trace


class RoutingReplay:
    def __init__(self, lines: list[TraceLine], num_moe_layers: int, num_experts: int, top_k: int, where: str = "the trace"):
        _check(lines, num_experts, top_k, where)
        self.lines, self.num_moe_layers = lines, num_moe_layers
        self.cursor = 0  # the trace line of the next token row
        self._rows: list[TraceLine] = []

    @classmethod
    def from_file(cls, path: str | Path, num_moe_layers: int, num_experts: int, top_k: int) -> "RoutingReplay":
        return cls(read_trace(path), num_moe_layers, num_experts, top_k, str(path))

    def begin_step(self, n_rows: int) -> None:
        n = len(self.lines)
        self._rows = [self.lines[(self.cursor + t) % n] for t in range(n_rows)]
        self.cursor = (self.cursor + n_rows) % n

    def ids(self, ordinal: int) -> torch.Tensor:
        """Top-k ids [T, K] of this step's rows at MoE layer `ordinal`."""
        return torch.tensor([line.layers[ordinal % len(line.layers)] for line in self._rows], dtype=torch.long)


def _check(lines: list[TraceLine], num_experts: int, top_k: int, where: str) -> None:
    for number, line in enumerate(lines, 1):
        for ids in line.layers:
            if len(ids) != top_k:
                raise UserError(f"line {number} of {where} chooses {len(ids)} experts per layer but the model "
                                f"routes to {top_k}; record the trace with a model of the same top-k")
            if ids and (max(ids) >= num_experts or min(ids) < 0):
                raise UserError(f"line {number} of {where} uses expert {max(ids)} but the model has "
                                f"{num_experts} experts per layer; use a trace of a matching model")
            if len(set(ids)) != len(ids):
                raise UserError(f"line {number} of {where} repeats an expert in one layer; a token routes "
                                "to distinct experts, so the trace is damaged")


class TraceRecorder:
    """Collects each step's routing per MoE layer, writes the decode rows once the last layer is in."""

    def __init__(self, path: str | Path, num_moe_layers: int):
        try:
            self.writer = TraceWriter(path)
        except OSError as e:
            raise UserError(f"cannot write the routing trace {path} ({e.strerror}); pass a writable --record-trace path")
        self.num_moe_layers = num_moe_layers
        self.tokens = 0
        self._rows: list[tuple[int, object]] = []
        self._ids: list[list[list[int]] | None] = []
        self._weights: list[list[list[float]] | None] = []

    def begin_step(self, n_rows: int, rows: list[tuple[int, object]] | None = None) -> None:
        """rows: (row index, request id) of the decode tokens in this step; None: see the module doc."""
        self.end_step()
        self._rows = rows if rows is not None else ([(0, 0)] if n_rows == 1 else [])
        self._ids = [None] * self.num_moe_layers
        self._weights = [None] * self.num_moe_layers

    def add(self, ordinal: int, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> None:
        """topk_ids, topk_weights: [T, K] of MoE layer `ordinal`."""
        if self._rows:
            self._ids[ordinal] = topk_ids.tolist()
            self._weights[ordinal] = topk_weights.float().tolist()
            if ordinal == self.num_moe_layers - 1:
                self.end_step()  # written now, not at the next step: a server may idle, or be killed

    def end_step(self) -> None:
        if not self._rows or any(ids is None for ids in self._ids):
            self._rows = []
            return
        for row, req in self._rows:
            layers = [ids[row] for ids in self._ids]
            probs = [[round(w, 6) for w in ws[row]] for ws in self._weights]
            self.tokens += 1
            self.writer.write(self.tokens, layers, probs, req)
        self._rows = []

    def close(self) -> None:
        self.end_step()
        self.writer.close()
