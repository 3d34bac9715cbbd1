"""The routing-trace file format: JSONL, one token of one sequence per line.

    {"tok": n, "layers": [[expert ids of MoE layer 0], [... layer 1], ...]}

optionally with "probs" (the router weights of those ids, the same nesting) and "req" (the request
id). Without them it is the plain format of public traces such as OLMoE-1B-7B's, read the same way.

It lives in plan/ because both drivers of the planner use it: the engine's runtime writes traces
(--record-trace) and its routers replay them (--routing-trace); the simulator reads them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from hybridmoe.errors import UserError


@dataclass
class TraceLine:
    tok: int
    layers: list[list[int]]
    probs: list[list[float]] | None = None
    req: str | int | None = None

    def to_json(self) -> dict:
        out = {"tok": self.tok, "layers": self.layers}
        if self.probs is not None:
            out["probs"] = self.probs
        if self.req is not None:
            out["req"] = self.req
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
        return TraceLine(int(row.get("tok", number)), layers, probs, row.get("req"))
    except (ValueError, KeyError, TypeError) as e:
        raise UserError(
            f"line {number} of trace {path} is not a routing record ({e}); each line needs "
            '"layers": [[ids], ...]'
        ) from None


class TraceWriter:
    """Appends one line per token; use as a context manager or call close().

    Each line goes out in one write and is flushed at once, so that a server killed mid-run leaves
    the lines of the steps it finished, complete, rather than a buffer's worth lost or cut."""

    def __init__(self, path: str | Path):
        self._file = open(path, "w")

    def write(self, tok: int, layers: list[list[int]], probs=None, req=None) -> None:
        line = TraceLine(tok, [list(map(int, ids)) for ids in layers], probs, req)
        self._file.write(json.dumps(line.to_json()) + "\n")
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
            w.write(line.tok, line.layers, line.probs, line.req)
