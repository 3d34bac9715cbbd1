"""Activation statistics: how often each (layer, expert) was routed to, over how many tokens.

`--expert-stats-out FILE` writes them; frequency placement and the policies' warm start read them;
the simulator counts them over a trace's profile steps. File format (JSON):

    {"format": "hybridmoe-expert-stats", "version": 1,
     "layers": [decoder-layer index of each MoE layer, ...],   # length L
     "num_experts": E, "tokens": T,                            # tokens observed
     "counts": [[uses of expert e in MoE layer i, for e < E] for i < L]}
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from hybridmoe.errors import UserError
from hybridmoe.experts.plan.shape import Key
from hybridmoe.files import write_atomic


@dataclass
class ExpertStats:
    layers: list[int]
    num_experts: int
    tokens: int = 0
    counts: list[list[int]] = field(default_factory=list)

    def __post_init__(self):
        if not self.counts:
            self.counts = [[0] * self.num_experts for _ in self.layers]

    def record(self, ordinal: int, experts) -> None:
        row = self.counts[ordinal]
        for e in experts:
            row[e] += 1

    @classmethod
    def of_steps(cls, steps, layers: list[int], num_experts: int) -> ExpertStats:
        """Counts over routed steps (per step, per MoE layer,
        records with .expert and .n_tokens)."""
        stats = cls(list(layers), num_experts)
        for step in steps:
            stats.tokens += max(r.n_tokens for r in step[0]) if step[0] else 0
            for o, routed in enumerate(step):
                for r in routed:
                    stats.counts[o][r.expert] += r.n_tokens
        return stats

    def ranked(self) -> list[Key]:
        """All keys, most used first; ties in (layer, expert) order so the result is
        deterministic."""
        keys = [(layer, e) for i, layer in enumerate(self.layers) for e in range(self.num_experts)]
        flat = {
            (layer, e): self.counts[i][e]
            for i, layer in enumerate(self.layers)
            for e in range(self.num_experts)
        }
        return sorted(keys, key=lambda k: -flat[k])


def write_stats(path: str | Path, stats: ExpertStats) -> None:
    data = {
        "format": "hybridmoe-expert-stats",
        "version": 1,
        "layers": stats.layers,
        "num_experts": stats.num_experts,
        "tokens": stats.tokens,
        "counts": stats.counts,
    }
    write_atomic(path, json.dumps(data) + "\n")


def read_stats(path: str | Path) -> ExpertStats:
    try:
        data = json.loads(Path(path).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        raise UserError(
            f"expert statistics {path} are missing or not JSON; write them with --expert-stats-out "
            f"{path}"
        ) from None
    if data.get("format") != "hybridmoe-expert-stats":
        raise UserError(
            f"{path} is not a hybridmoe expert-statistics file; write one with --expert-stats-out"
        )
    stats = ExpertStats(
        list(data["layers"]), int(data["num_experts"]), int(data["tokens"]), data["counts"]
    )
    if len(stats.counts) != len(stats.layers) or any(
        len(r) != stats.num_experts for r in stats.counts
    ):
        raise UserError(
            f"{path} has counts that do not match its layers and experts; write it again"
        )
    return stats
