"""The routing-trace file format: JSONL, one token of one sequence per line.

    {"tok": n, "layers": [[expert ids of MoE layer 0], [... layer 1], ...]}

optionally with "probs" (the router weights of those ids, the same nesting), "req" (the request
id) and "ahead": per MoE layer i, the routers of layers i+1, i+2, ... (up to `AHEAD_HORIZONS`, fewer
near the last layer) applied to layer i's input, each a list of every expert's probability in units
of 1e-4 (rounded; integers keep the file small). That is the look-ahead hint an engine can compute
for nearly nothing (Pre-gated MoE, HOBBIT, ProMoE): the residual stream changes little between
adjacent layers. Without these fields it is the plain format of public traces such as OLMoE-1B-7B's,
read the same way; the hint exists only in traces recorded with it.

It lives in plan/ because both drivers of the planner use it: the engine's runtime writes traces
(--record-trace) and its routers replay them (--routing-trace); the simulator reads them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from hybridmoe.errors import UserError

AHEAD_HORIZONS = 3  # the layers ahead whose routers a recorded trace carries
AHEAD_SCALE = 10_000  # "ahead" probabilities are stored as integers: round(p * AHEAD_SCALE)


@dataclass
class TraceLine:
    tok: int
    layers: list[list[int]]
    probs: list[list[float]] | None = None
    req: str | int | None = None
    # [layer][h - 1] -> [E] probabilities of layer + h's router on this layer's input
    ahead: list[list[list[float]]] | None = None

    def to_json(self) -> dict:
        out = {"tok": self.tok, "layers": self.layers}
        if self.probs is not None:
            out["probs"] = self.probs
        if self.req is not None:
            out["req"] = self.req
        if self.ahead is not None:
            out["ahead"] = [
                [[round(p * AHEAD_SCALE) for p in probs] for probs in hs] for hs in self.ahead
            ]
        return out


def read_trace(path: str | Path) -> list[TraceLine]:
    try:
        text = Path(path).read_text()
    except (FileNotFoundError, IsADirectoryError):
        raise UserError(
            f"trace {path} does not exist; record one with --record-trace FILE"
        ) from None
    lines = []
    for number, raw in enumerate(text.splitlines(), 1):
        if raw.strip():
            lines.append(_parse(raw, path, number))
    if not lines:
        raise UserError(f"trace {path} is empty; record one with --record-trace FILE")
    n_layers = len(lines[0].layers)
    for number, line in enumerate(lines, 1):
        if len(line.layers) != n_layers:
            raise UserError(
                f"line {number} of trace {path} has {len(line.layers)} layers, line 1 has "
                f"{n_layers}; fix or re-record it"
            )
    return lines


def _parse(raw: str, path, number: int) -> TraceLine:
    try:
        row = json.loads(raw)
        layers = [[int(e) for e in ids] for ids in row["layers"]]
        probs = row.get("probs")
        if probs is not None:
            probs = [[float(p) for p in ps] for ps in probs]
            if [len(p) for p in probs] != [len(ids) for ids in layers]:
                raise ValueError("probs do not match layers")
        ahead = _ahead(row.get("ahead"), len(layers))
        return TraceLine(int(row.get("tok", number)), layers, probs, row.get("req"), ahead)
    except (ValueError, KeyError, TypeError) as e:
        raise UserError(
            f"line {number} of trace {path} is not a routing record ({e}); each line needs "
            '"layers": [[ids], ...]'
        ) from None


def _ahead(raw, n_layers: int) -> list[list[list[float]]] | None:
    """The "ahead" field as probabilities, or None where the line has none."""
    if raw is None:
        return None
    if len(raw) != n_layers:
        raise ValueError(f'"ahead" has {len(raw)} layers, "layers" {n_layers}')
    return [[[int(p) / AHEAD_SCALE for p in probs] for probs in hs] for hs in raw]


class TraceWriter:
    """Appends one line per token; use as a context manager or call close().

    Each line goes out in one write and is flushed at once, so that a server killed mid-run leaves
    the lines of the steps it finished, complete, rather than a buffer's worth lost or cut."""

    def __init__(self, path: str | Path):
        self._file = open(path, "w")

    def write(self, tok: int, layers: list[list[int]], probs=None, req=None, ahead=None) -> None:
        line = TraceLine(tok, [list(map(int, ids)) for ids in layers], probs, req, ahead)
        # compact separators: a line with its look-ahead hint holds ~2,000 numbers
        self._file.write(json.dumps(line.to_json(), separators=(",", ":")) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def write_trace(path: str | Path, lines: list[TraceLine]) -> None:
    with TraceWriter(path) as w:
        for line in lines:
            w.write(line.tok, line.layers, line.probs, line.req, line.ahead)
