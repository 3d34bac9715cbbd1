"""Keys in order of a score, drawn as far as they are read, and narrowed without reading the rest.

The value policy ranks a few hundred keys (its background candidates, its evictable residents)
and the planner usually reads one or two. Past the usual background deadline only the keys the
look-ahead hint names may still be copied; `narrow` keeps just those, in the order they would have
come, instead of the planner reading and skipping every other key one by one.

The order is total: by score, ties by flat key (layer ordinal * E + expert), so that the C kernel
(predictor.c, `hm_rank`) and numpy (`np.lexsort`) give the same one.
"""

from __future__ import annotations

import numpy as np

HEAD = 16  # keys made into tuples at first; a plan rarely reads further


def rank(flat: np.ndarray, scores: np.ndarray, native=None) -> np.ndarray:
    """Positions of `flat` [n] by ascending (scores, flat): predictor.c's `hm_rank` through a
    predictor's bound kernels (`native`), else numpy."""
    if native is None:
        return np.lexsort((flat, scores))
    n = len(flat)
    flat = np.ascontiguousarray(flat, dtype=np.int64)
    scores = np.ascontiguousarray(scores, dtype=float)
    idx = native.rank_idx  # [2 * L * E]: the positions, then the sort's scratch
    native.lib.hm_rank(scores.ctypes.data, flat.ctypes.data, n, native.rank_at, native.tmp_at)
    return idx[:n].copy()


class Ranked:
    """Flat keys already in order [n], as an iterator of (layer id, expert)."""

    def __init__(self, flat: np.ndarray, layer_ids: np.ndarray, E: int):
        self._flat, self._ids, self._E = flat, layer_ids, E
        self._at = 0  # keys of _flat already made into _keys
        self._keys: list[tuple[int, int]] = []
        self._i = 0  # keys read

    def __iter__(self):
        return self

    def __next__(self) -> tuple[int, int]:
        if self._i == len(self._keys):
            if self._at == len(self._flat):
                raise StopIteration
            self._grow(len(self._flat) if self._at else HEAD)
        self._i += 1
        return self._keys[self._i - 1]

    def narrow(self, wanted) -> Ranked:
        """From here on only the keys for which `wanted(flat)` [n] -> bool [n] holds, in the
        order they would have come."""
        left = self._flat[self._at - (len(self._keys) - self._i) :]  # not read yet
        self._flat, self._at, self._keys, self._i = left[wanted(left)], 0, [], 0
        return self

    def _grow(self, upto: int) -> None:
        rows, cols = np.divmod(self._flat[self._at : upto], self._E)
        self._keys = self._keys[self._i :] + list(zip(self._ids[rows].tolist(), cols.tolist()))
        self._i, self._at = 0, min(upto, len(self._flat))
