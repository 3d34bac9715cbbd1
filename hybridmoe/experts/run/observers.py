"""Observers any runtime calls (runtime.py): what watches the routing without changing what runs.

- `RoutingReplay` (--routing-trace FILE): the model's routers take their top-k ids from the trace
  instead of choosing them (layers/moe.py asks `ids`), so that a random-weight model with real
  shapes sees real routing. Every token row of every step (prefill included) consumes the next trace
  line, cycling at the end; MoE layer i takes the trace's layer i mod (trace layers), so a short
  trace can drive a deeper model. It observes the runtime to learn where each step begins.
- `TraceRecorder` (--record-trace FILE): one line per decode token, in the format of
  experts/plan/trace_format.py: {"tok": n, "layers": [[ids], ...], "probs": [[w], ...], "req": id,
  "ahead": ...}. "probs" are the routing weights the model used for those ids; "ahead" the
  look-ahead hint (the next layers' routers on each layer's input) where the model gives one. Which
  rows of a step are decode tokens, and of which request, is the engine's knowledge
  (`Step.decode_rows`).
- `ActivationCounter` (--expert-stats-out FILE): how often each expert was routed to, written as
  activation statistics (experts/plan/stats.py) when the runtime closes.

Two passes may run at once on two threads: the recorder keeps a step's state in that step
(`Step.notes`), the replay in a thread-local, the counter its totals under a lock, so they never
mix.
"""

from __future__ import annotations

import threading
from pathlib import Path

import torch

from hybridmoe.errors import UserError
from hybridmoe.experts.plan.stats import ExpertStats, write_stats
from hybridmoe.experts.plan.trace_format import (
    AHEAD_HORIZONS,
    TraceLine,
    TraceWriter,
    read_trace,
)


class _Observer:
    """Defaults: an observer overrides what it watches."""

    def begin_step(self, step) -> None:
        pass

    def on_layer(self, step, ordinal, topk_ids, topk_weights, report, hint=None) -> None:
        pass

    def end_step(self, step) -> None:
        pass

    def close(self) -> None:
        pass


class RoutingReplay(_Observer):
    def __init__(
        self,
        lines: list[TraceLine],
        layers: list[int],
        num_experts: int,
        top_k: int,
        where: str = "the trace",
    ):
        _check(lines, num_experts, top_k, where)
        self.lines = lines
        self.ordinal = {layer: i for i, layer in enumerate(layers)}
        self.cursor = 0  # the trace line of the next token row
        self._lock = threading.Lock()
        self._local = threading.local()  # .rows: this thread's step's trace lines

    @classmethod
    def from_file(
        cls, path: str | Path, layers: list[int], num_experts: int, top_k: int
    ) -> RoutingReplay:
        return cls(read_trace(path), layers, num_experts, top_k, str(path))

    def begin_step(self, step) -> None:
        n = len(self.lines)
        with self._lock:
            self._local.rows = [self.lines[(self.cursor + t) % n] for t in range(step.num_tokens)]
            self.cursor = (self.cursor + step.num_tokens) % n

    def ids(self, layer: int) -> torch.Tensor:
        """Top-k ids [T, K] of this thread's step at decoder layer `layer` (an MoE layer)."""
        o = self.ordinal[layer]
        return torch.tensor(
            [line.layers[o % len(line.layers)] for line in self._local.rows], dtype=torch.long
        )


def _check(lines: list[TraceLine], num_experts: int, top_k: int, where: str) -> None:
    for number, line in enumerate(lines, 1):
        for ids in line.layers:
            if len(ids) != top_k:
                raise UserError(
                    f"line {number} of {where} chooses {len(ids)} experts per layer but the model "
                    f"routes to {top_k}; record the trace with a model of the same top-k"
                )
            if ids and (max(ids) >= num_experts or min(ids) < 0):
                raise UserError(
                    f"line {number} of {where} uses expert {max(ids)} but the model has "
                    f"{num_experts} experts per layer; use a trace of a matching model"
                )
            if len(set(ids)) != len(ids):
                raise UserError(
                    f"line {number} of {where} repeats an expert in one layer; a token routes "
                    "to distinct experts, so the trace is damaged"
                )


class TraceRecorder(_Observer):
    """Collects each step's routing per MoE layer, writes its decode rows once the step ends."""

    def __init__(self, path: str | Path, num_moe_layers: int, horizons: int = AHEAD_HORIZONS):
        try:
            self.writer = TraceWriter(path)
        except OSError as e:
            raise UserError(
                f"cannot write the routing trace {path} ({e.strerror}); pass a writable "
                "--record-trace path"
            ) from None
        self.num_moe_layers, self.horizons = num_moe_layers, horizons
        self.tokens = 0
        self._lock = threading.Lock()

    def begin_step(self, step) -> None:
        if step.decode_rows:
            n = self.num_moe_layers
            step.notes[self] = ([None] * n, [None] * n, [None] * n)  # ids, weights, ahead

    def on_layer(self, step, ordinal, topk_ids, topk_weights, report, hint=None) -> None:
        """topk_ids, topk_weights: [T, K] of MoE layer `ordinal`."""
        if self in step.notes:
            ids, weights, ahead = step.notes[self]
            ids[ordinal], weights[ordinal] = topk_ids.tolist(), topk_weights.float().tolist()
            ahead[ordinal] = self._ahead(step, hint)

    def _ahead(self, step, hint) -> list[list[list[float]]]:
        """Per decode row, the next layers' router probabilities on this layer's input:
        [rows][h - 1][E]."""
        rows = torch.tensor([row for row, _ in step.decode_rows])  # [R]
        out = [[] for _ in step.decode_rows]
        for h in range(1, self.horizons + 1):
            probs = hint(h) if hint is not None else None  # [T, E]
            if probs is None:
                break
            for r, p in enumerate(probs[rows.to(probs.device)].float().tolist()):
                out[r].append(p)
        return out

    def end_step(self, step) -> None:
        """Written when the step ends, not later: a server may idle, or be killed."""
        got = step.notes.pop(self, None)
        if got is None or any(i is None for i in got[0]):
            return
        ids, weights, ahead = got
        hinted = any(layer[0] for layer in ahead)  # a model without look-ahead gives none
        with self._lock:
            for r, (row, req) in enumerate(step.decode_rows):
                self.tokens += 1
                self.writer.write(
                    self.tokens,
                    [layer[row] for layer in ids],
                    [[round(w, 6) for w in layer[row]] for layer in weights],
                    req,
                    [layer[r] for layer in ahead] if hinted else None,
                )

    def close(self) -> None:
        self.writer.close()


class ActivationCounter(_Observer):
    """Counts expert activations per MoE layer; writes them to `path` when closed."""

    def __init__(self, path: str | Path, layers: list[int], num_experts: int):
        self.path = path
        self.stats = ExpertStats(list(layers), num_experts)
        self._lock = threading.Lock()

    def begin_step(self, step) -> None:
        with self._lock:
            self.stats.tokens += step.num_tokens

    def on_layer(self, step, ordinal, topk_ids, topk_weights, report, hint=None) -> None:
        ids = topk_ids.reshape(-1).tolist()
        with self._lock:
            self.stats.record(ordinal, ids)

    def close(self) -> None:
        try:
            write_stats(self.path, self.stats)
        except OSError as e:
            raise UserError(
                f"could not write the expert statistics {self.path} ({e.strerror}); "
                "pass a writable --expert-stats-out path"
            ) from None
