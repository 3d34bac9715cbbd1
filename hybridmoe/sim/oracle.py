"""The offline yardsticks: policies that know the future. Simulation only.

- `oracle`: obeys the same copy stream as everyone (it can only move experts in the stream's idle
  time); it evicts the resident used farthest in the future and fills in the missing one used
  soonest. This is what is possible on the modelled hardware.
- `belady_min_hit_rate`: Belady's MIN with free, instant copies: the upper bound on the hit rate
  of demand fetching. A policy that prefetches can pass it slightly (a key copied in before its
  first use is a hit there, a compulsory miss for MIN).
"""

from __future__ import annotations

import bisect
import math

from hybridmoe import tuning
from hybridmoe.experts.plan.policies import BeladyPolicy, Policy
from hybridmoe.experts.plan.shape import Key
from hybridmoe.sim.shapes import ModelShape

NEVER = 10**12


class Future:
    """When each (layer, expert) is used, as positions step * L + layer ordinal."""

    def __init__(self, steps_ids: list[list[list[int]]], layers: list[int]):
        self.layers = layers
        self.L = len(layers)
        self.uses: dict[Key, list[int]] = {}
        self.sequence: list[tuple[int, Key]] = []
        for s, step in enumerate(steps_ids):
            for o, ids in enumerate(step):
                pos = s * self.L + o
                for e in ids:
                    key = (layers[o], e)
                    self.uses.setdefault(key, []).append(pos)
                    self.sequence.append((pos, key))
        self._positions = [p for p, _ in self.sequence]

    def next_use(self, key: Key, position: int) -> int:
        """The first use strictly after `position`, or NEVER."""
        uses = self.uses.get(key)
        if not uses:
            return NEVER
        i = bisect.bisect_right(uses, position)
        return uses[i] if i < len(uses) else NEVER

    def upcoming(self, position: int):
        """Keys in order of their next use after `position` (each once)."""
        seen = set()
        for i in range(bisect.bisect_right(self._positions, position), len(self.sequence)):
            key = self.sequence[i][1]
            if key not in seen:
                seen.add(key)
                yield key


class OraclePolicy(BeladyPolicy):
    """Belady's keep/evict rule, plus background copies of the missing experts used soonest."""

    name = "oracle"
    background_slack = 0.0  # its best setting: the yardstick should be as strong as it can be

    def background(self, layer, now, plan):
        count = 0
        for key in self.future.upcoming(self.planner.position):
            if key not in self.cache:
                yield key
                count += 1
                if count >= tuning.ORACLE_LOOKAHEAD:
                    return


def future_of(lines, shape: ModelShape, batch: int) -> Future:
    """When each key is used, with the steps grouped as the simulator groups them."""
    from hybridmoe.sim.simulator import step_lines

    steps = [
        [sorted({e for line in group for e in line.layers[o]}) for o in range(len(group[0].layers))]
        for group in step_lines(lines, batch)
    ]
    return Future(steps, list(shape.experts.moe_layers))


def future_policy(name: str, lines, shape: ModelShape, batch: int) -> Policy:
    future = future_of(lines, shape, batch)
    return OraclePolicy(future) if name == "oracle" else BeladyPolicy(future)


def belady_min_hit_rate(future: Future, slots: int, start_step: int, initial: list[Key]) -> float:
    """Hit rate of Belady's MIN (with bypass) over steps >= start_step, copies free and instant."""
    resident = set(initial[:slots])
    hits = total = 0
    start = start_step * future.L
    for pos, key in future.sequence:
        if pos < start:
            continue
        total += 1
        if key in resident:
            hits += 1
            continue
        if len(resident) < slots:
            resident.add(key)
            continue
        if slots == 0:
            continue
        victim = max(resident, key=lambda k: future.next_use(k, pos))
        if future.next_use(victim, pos) > future.next_use(key, pos):
            resident.discard(victim)
            resident.add(key)
    return hits / total if total else math.nan
