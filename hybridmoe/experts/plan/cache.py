"""The GPU expert cache: a fixed number of slots, a map (layer, expert) -> slot, pinned and dynamic.

Slots come from a byte budget (`parse_budget`). The pinned set is placed at start
(`placement`: uniform | frequency | front-loading) and never evicted; the dynamic set is managed
by the policy. A key whose copy is still in flight has a `ready_at` time in the future: it owns
its slot but may not be used on the GPU before then.

Frequency placement reads activation statistics (stats.py).
"""

from __future__ import annotations

import numpy as np

from hybridmoe.errors import UserError
from hybridmoe.experts.plan.shape import Key
from hybridmoe.experts.plan.stats import ExpertStats
from hybridmoe.sizes import SIZE, UNITS

PLACEMENTS = ("uniform", "frequency", "front-loading")


def parse_budget(text: str | float, total_expert_bytes: float, expert_bytes: float) -> int:
    """Slots for a budget given as bytes ("6GB", "512MiB") or a fraction of all expert bytes
    ("0.1")."""
    s = str(text).strip().upper()
    m = SIZE.fullmatch(s)
    if not m or expert_bytes <= 0:
        raise UserError(
            f"GPU expert budget {text!r} is not a size like 6GB or a fraction like 0.1; write it "
            "that way"
        )
    value, unit = float(m.group(1)), m.group(2) or ""
    if unit:
        nbytes = value * UNITS[unit]
    elif value <= 1.0:
        nbytes = value * total_expert_bytes
    else:
        raise UserError(
            f"GPU expert budget {text!r} has no unit; write a fraction (0.1) or bytes with a unit "
            "(6GB)"
        )
    total_slots = int(round(total_expert_bytes / expert_bytes))
    return min(int(nbytes // expert_bytes + 1e-9), total_slots)


def placement(
    kind: str, slots: int, layers: list[int], num_experts: int, stats: ExpertStats | None
) -> list[Key]:
    """The keys to place at start, `slots` of them (fewer only if there are fewer experts)."""
    if kind not in PLACEMENTS:
        raise UserError(f"unknown placement {kind!r}; use one of {', '.join(PLACEMENTS)}")
    order = stats.ranked() if stats else None
    if kind == "frequency":
        if order is None:
            raise UserError(
                "frequency placement needs activation statistics; pass --expert-stats FILE"
            )
        return order[:slots]
    if kind == "front-loading":  # whole layers first, as --n-cpu-moe style splits do
        within = _per_layer_order(layers, num_experts, order)
        return [k for layer in layers for k in within[layer]][:slots]
    # uniform: the same number per layer, each layer's most used first;
    # remainder to the first layers
    within = _per_layer_order(layers, num_experts, order)
    base, extra = divmod(min(slots, len(layers) * num_experts), len(layers))
    return [k for i, layer in enumerate(layers) for k in within[layer][: base + (i < extra)]]


def _per_layer_order(layers, num_experts, order) -> dict[int, list[Key]]:
    if order is None:
        return {layer: [(layer, e) for e in range(num_experts)] for layer in layers}
    within = {layer: [] for layer in layers}
    for k in order:
        within[k[0]].append(k)
    return within


# ---- the cache -------------------------------------------------------------------------------


class ExpertCache:
    """Slots and who holds them. Pure bookkeeping: which expert to evict is the policy's call.

    Once `track(layers, num_experts)` has been called (the planner does), the cache also keeps
    [L, E] masks of resident and pinned keys by layer ordinal, and a count of changes, so that
    policies can score whole layers at once."""

    def __init__(self, slots: int):
        self.slots = slots
        self.slot_of: dict[Key, int] = {}
        self.key_of: list[Key | None] = [None] * slots
        self.ready_at: dict[Key, float] = {}
        self.pinned: set[Key] = set()
        self._free = list(range(slots - 1, -1, -1))
        self._pending: dict[Key, float] = {}  # keys whose copy may still be in flight
        self.row: dict[int, int] = {}  # layer -> ordinal, once tracked
        self.mask = np.zeros((0, 0), dtype=bool)  # [L, E] resident
        self.pinned_mask = np.zeros((0, 0), dtype=bool)  # [L, E] pinned
        self.changes = 0
        self.row_version = np.zeros(0, dtype=np.int64)  # [L] bumped when a layer's keys change
        # [slots] each slot's key as ordinal * E + expert, once tracked (-1: free, or untracked)
        self.flat = np.full(slots, -1, dtype=np.int64)
        self._E = 0

    def track(self, layers: list[int], num_experts: int) -> None:
        """Keep [L, E] masks of what is resident and pinned, by layer ordinal."""
        self.row = {layer: i for i, layer in enumerate(layers)}
        self.mask = np.zeros((len(layers), num_experts), dtype=bool)
        self.pinned_mask = np.zeros_like(self.mask)
        self.row_version = np.zeros(len(layers), dtype=np.int64)
        self._E = num_experts
        for key, slot in self.slot_of.items():
            self._mark(key, True, slot)
        for key in self.pinned:
            self.pinned_mask[self.row[key[0]], key[1]] = True

    def _mark(self, key: Key, resident: bool, slot: int) -> None:
        self.changes += 1
        i = self.row.get(key[0])
        if i is not None:
            self.mask[i, key[1]] = resident
            self.row_version[i] += 1
            self.flat[slot] = i * self._E + key[1] if resident else -1

    def __contains__(self, key: Key) -> bool:
        return key in self.slot_of

    def __len__(self) -> int:
        return len(self.slot_of)

    def free_count(self) -> int:
        return len(self._free)

    def is_ready(self, key: Key, now: float) -> bool:
        return key in self.slot_of and self.ready_at[key] <= now

    def dynamic(self):
        """Resident keys the policy may evict (pinned ones excluded)."""
        return (k for k in self.slot_of if k not in self.pinned)

    def in_flight(self, now: float) -> set[Key]:
        """Resident keys whose copy is not done at `now` (which never goes back)."""
        done = [k for k, t in self._pending.items() if t <= now]
        for k in done:
            del self._pending[k]
        return set(self._pending)

    def place(self, keys: list[Key], pinned: bool) -> None:
        """Fill slots at start (ready at time 0)."""
        for key in keys:
            if key not in self.slot_of and self._free:
                self.insert(key, ready_at=0.0)
                if pinned:
                    self.pinned.add(key)
                    if key[0] in self.row:
                        self.pinned_mask[self.row[key[0]], key[1]] = True

    def insert(self, key: Key, ready_at: float, evict: Key | None = None) -> int:
        """Give `key` a slot (the evicted key's, or a free one); usable from `ready_at` on."""
        assert key not in self.slot_of, f"{key} is already resident"
        if evict is not None:
            self.remove(evict)
        assert self._free, "no free slot: choose a victim first"
        slot = self._free.pop()
        self.slot_of[key], self.key_of[slot], self.ready_at[key] = slot, key, ready_at
        if ready_at > 0:
            self._pending[key] = ready_at
        self._mark(key, True, slot)
        return slot

    def remove(self, key: Key) -> int:
        assert key not in self.pinned, f"pinned expert {key} may not be evicted"
        slot = self.slot_of.pop(key)
        del self.ready_at[key]
        self._pending.pop(key, None)
        self._mark(key, False, slot)
        self.key_of[slot] = None
        self._free.append(slot)
        return slot

    def check(self) -> None:
        """Invariants, for tests: the map and the slot table agree; slots are never exceeded."""
        assert len(self.slot_of) + len(self._free) == self.slots
        for key, slot in self.slot_of.items():
            assert self.key_of[slot] == key
        assert self.pinned <= set(self.slot_of)
        if self.row:
            tracked = {k for k in self.slot_of if k[0] in self.row}
            assert int(self.mask.sum()) == len(tracked)
            assert all(self.mask[self.row[k[0]], k[1]] for k in tracked)
            assert int(self.pinned_mask.sum()) == len({k for k in self.pinned if k[0] in self.row})
            flat = {
                self.row[k[0]] * self._E + k[1]: s for k, s in self.slot_of.items() if k in tracked
            }
            assert {int(x): s for s, x in enumerate(self.flat) if x >= 0} == flat
