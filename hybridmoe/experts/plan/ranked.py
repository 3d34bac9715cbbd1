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

HEAD = 16  # keys ranked at first; a plan rarely reads further


def rank(flat: np.ndarray, scores: np.ndarray, native=None) -> np.ndarray:
    """Positions of `flat` [n] by ascending (scores, flat): predictor.c's `hm_rank` through a
    predictor's bound kernels (`native`), else numpy."""
    if native is None:
        return np.lexsort((flat, scores))
    flat_at, scores_at = _arguments(native, flat, scores)
    native.lib.hm_rank(scores_at, flat_at, len(flat), native.rank_at, native.tmp_at)
    return native.rank_idx[: len(flat)].copy()


def rank_head(flat: np.ndarray, scores: np.ndarray, first: int, native=None) -> np.ndarray:
    """`rank(flat, scores)[:first]`, without sorting the rest (`hm_rank_head`)."""
    if native is None:
        return np.lexsort((flat, scores))[:first]
    flat_at, scores_at = _arguments(native, flat, scores)
    m = native.lib.hm_rank_head(scores_at, flat_at, len(flat), first, native.rank_at)
    return native.rank_idx[:m].copy()


def _arguments(native, flat, scores) -> tuple[int, int]:
    """flat and scores copied into the bound kernels' argument arrays: their addresses."""
    native.flat[: len(flat)] = flat
    native.neg[: len(scores)] = scores
    return native.flat_at, native.neg_at


class Ranked:
    """Flat keys [n] by ascending (scores, flat), as an iterator of (layer id, expert): the HEAD
    lowest ranked at once, the others only if read that far (or narrowed). `native`: a
    predictor's bound kernels (predictor_kernels.Bound), or None for numpy; `head`: the positions
    of the HEAD lowest, in order, where a kernel has ranked them already."""

    def __init__(self, flat, scores, layer_ids, E: int, native=None, head=None):
        self._flat = np.array(flat, dtype=np.int64)  # [n]; owned: the rest is ranked later
        self._scores = np.array(scores, dtype=float)  # [n]
        self._ids, self._E, self._native = _layer_ids(layer_ids), E, native
        if head is None:
            self._head = rank_head(self._flat, self._scores, HEAD, native)
        else:
            self._head = np.array(head[:HEAD], dtype=np.int64)
        self._rest_left = len(self._flat) > len(self._head)
        self._start(self._flat[self._head])

    @classmethod
    def ordered(cls, flat, layer_ids, E: int) -> Ranked:
        """Flat keys [n] in their order already (a kernel has ranked them all)."""
        self = cls.__new__(cls)
        self._ids, self._E, self._native, self._rest_left = _layer_ids(layer_ids), E, None, False
        self._start(np.array(flat, dtype=np.int64))
        return self

    def __iter__(self):
        return self

    def __next__(self) -> tuple[int, int]:
        if self._i == len(self._list):
            if not self._rest_left:
                raise StopIteration
            self._start(self._rest(None))
            if not self._list:
                raise StopIteration
        f = self._list[self._i]
        self._i += 1
        return self._ids[f // self._E], f % self._E

    def narrow(self, wanted) -> Ranked:
        """From here on only the keys for which `wanted(flat)` [n] -> bool [n] holds, in the
        order they would have come."""
        left = self._seq[self._i :]
        left = left[wanted(left)]
        if self._rest_left:
            left = np.concatenate((left, self._rest(wanted)))
        self._start(left)
        return self

    def _rest(self, wanted) -> np.ndarray:
        """The keys past the head (only those `wanted` keeps) in order, as flat keys."""
        self._rest_left = False
        out = np.ones(len(self._flat), dtype=bool)  # [n]
        out[self._head] = False
        idx = np.flatnonzero(out)
        if wanted is not None:
            idx = idx[wanted(self._flat[idx])]
        flat, scores = self._flat[idx], self._scores[idx]
        return flat[rank(flat, scores, self._native)]

    def _start(self, seq: np.ndarray) -> None:
        """Read `seq` (flat keys) from its start; each key becomes (layer id, expert) as read."""
        self._seq, self._list, self._i = seq, seq.tolist(), 0


def _layer_ids(ids) -> tuple[int, ...]:
    """The layer ids by ordinal, as a tuple of Python ints (keys are made of them)."""
    return ids if type(ids) is tuple else tuple(np.asarray(ids).tolist())
