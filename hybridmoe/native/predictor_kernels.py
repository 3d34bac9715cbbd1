"""The predictor's per-visit arithmetic of predictor.c, for hybridmoe/experts/plan/predictor.py: a
layer's visit counted, the next router's buckets, the cross-layer pairs and bands, stale rows
refreshed, the probabilities after a visit; a planner's whole visit as one call (`hm_pred_visit`);
and the value policy's rankings over state bound once (`BoundValue`: its background order and the
next plan's view, one call each). Each is one call where numpy takes dozens of small ones, and
gives the same bits (tests/test_predictor.py, tests/test_value_ranking.py).

Torch-free, so that the planner and the simulator may use it. Without a C compiler, or with
HYBRIDMOE_NATIVE=0, `library()` is None and the predictor keeps its numpy path.
"""

from __future__ import annotations

import ctypes
from functools import lru_cache
from pathlib import Path

import numpy as np

from hybridmoe.native.build import INT, N, P, load

SOURCE = Path(__file__).with_name("predictor.c")
# floats exactly as written (no contraction into FMAs), so that they round as numpy's do
FLAGS = ["-O3", "-shared", "-fPIC", "-ffp-contract=off"]

D = ctypes.c_double

# name -> (argument types, result type), each under a copy of its C prototype in predictor.c
SIGNATURES = {
    # void hm_pred_refresh(const pred_t *p, const long *rows, long nrows)
    "hm_pred_refresh": ([P, P, N], None),
    # void hm_pred_count_use(const pred_t *p, long i, const long *used, long n_used, int with_band)
    "hm_pred_count_use": ([P, N, P, N, INT], None),
    # void hm_pred_router(const pred_t *p, long i, const double *probs, long *order)
    "hm_pred_router": ([P, N, P, P], None),
    # void hm_pred_learn(const pred_t *p, long i, const long *used, long n_used)
    "hm_pred_learn": ([P, N, P, N], None),
    # void hm_pred_bands(const pred_t *p, long i, const long *used, long n_used, double *score)
    "hm_pred_bands": ([P, N, P, N, P], None),
    # void hm_pred_after_visit(const pred_t *p, long i, double *out)
    "hm_pred_after_visit": ([P, N, P], None),
    # long hm_pred_visit(const pred_t *p, long i, long n_used, int flags, long nstale)
    "hm_pred_visit": ([P, N, N, INT, N], N),
    # void hm_rank(const double *score, const long *flat, long n, long *idx, long *tmp)
    "hm_rank": ([P, P, N, P, P], None),
    # long hm_rank_head(const double *score, const long *flat, long n, long first, long *idx)
    "hm_rank_head": ([P, P, N, N, P], N),
    # long hm_value_background(const value_t *v, const long *rows, long nrows, int top_only,
    #                          long here, double now, double arrive, double period)
    "hm_value_background": ([P, P, N, INT, N, D, D, D], N),
    # long hm_value_view(const value_t *v, long here, int with_after, long first)
    "hm_value_view": ([P, N, INT, N], N),
}

# pred_t's fields in order: (name, ctypes type)
FIELDS = [(f, N) for f in ("L", "E", "K", "H", "NA", "NF", "NB", "n_age", "n_freq", "n_lift")]
FIELDS += [(f, P) for f in ("age_edges", "freq_edges", "lift_edges")]
FIELDS += [(f, D) for f in ("prior_w", "cross_prior", "keep", "cross_keep")]
FIELDS += [(f, P) for f in ("last_use", "visits", "count", "weight", "router", "band", "cell")]
FIELDS += [(f, P) for f in ("banded", "hits", "trials", "band_hits", "band_trials", "P", "Q")]
FIELDS += [(f, P) for f in ("co", "n", "scale", "free_hits", "free_trials", "row_version")]
FIELDS += [(f, P) for f in ("used", "n_set", "rows", "probs", "order", "score")]
# hm_pred_visit's flags
VISIT_REFRESH, VISIT_BAND, VISIT_ROUTER, VISIT_GUESSED = 1, 2, 4, 8


class PredT(ctypes.Structure):
    _fields_ = FIELDS


@lru_cache(maxsize=1)
def library():
    return load(SOURCE, FLAGS, SIGNATURES)


def address(a: np.ndarray) -> int:
    """The data pointer of a C-contiguous array the kernels may read and write."""
    assert a.flags.c_contiguous, "the predictor's arrays are C-contiguous"
    return a.ctypes.data


class Bound:
    """The kernels bound to one predictor's arrays (which it updates in place, never rebinds),
    with scratch space for their outputs."""

    def __init__(self, lib, pred, edges: dict, constants: dict):
        self.lib = lib
        L, E = len(pred.layers), pred.num_experts
        cross = pred.cross
        arrays = {
            "last_use": pred.last_use,
            "visits": pred.visits,
            "count": pred.count,
            "weight": pred.weight,
            "router": pred.router,
            "band": pred.band,
            "cell": pred.cell,
            "banded": pred.banded,
            "hits": pred.hits,
            "trials": pred.trials,
            "band_hits": pred.band_hits,
            "band_trials": pred.band_trials,
            "P": pred.P,
            "Q": pred.Q,
            "free_hits": pred.free_hits,
            "free_trials": pred.free_trials,
            "row_version": pred.row_version,
        }
        if cross is not None:
            arrays.update(co=cross._co, n=cross._n, scale=cross._scale)
        # The visit's arguments, copied into arrays whose addresses are taken once (`a.ctypes.data`
        # costs about a microsecond), and scratch.
        self.used = np.empty((L, E), dtype=np.int64)  # [L, E] row i: layer i's, first n_used
        self.n_set = np.zeros(L, dtype=np.int64)  # [L] how many, this step (0: not yet)
        self.rows = np.empty(L, dtype=np.int64)  # [L] rows to refresh
        self.probs = np.empty(E)  # [E] the next layer's router probabilities
        self.order = np.empty(2 * E, dtype=np.int64)  # [2E] scratch of the router's ranking
        self.score = np.empty(2 * E)  # [2E] scratch of the bands
        scratch = {"used": self.used, "n_set": self.n_set, "rows": self.rows}
        scratch.update(probs=self.probs, order=self.order, score=self.score)
        self._keep = [*arrays.values(), *edges.values(), *scratch.values()]  # alive with struct
        fields = {k: address(v) for k, v in {**arrays, **edges, **scratch}.items()}
        fields.update(L=L, E=E, K=pred.top_k, H=len(cross.horizons) if cross else 0)
        fields.update(n_age=len(edges["age_edges"]), n_freq=len(edges["freq_edges"]))
        fields.update(n_lift=len(edges["lift_edges"]), **constants)
        self.struct = PredT(**fields)
        self.p = ctypes.addressof(self.struct)
        self.after = np.empty((2, E))  # [2, E] after_visit's rows
        self.flat = np.empty(L * E, dtype=np.int64)  # [L*E] ranking keys: flat (ordinal, expert)
        self.neg = np.empty(L * E)  # [L*E] and minus their distance
        self.flat_at, self.neg_at = address(self.flat), address(self.neg)
        self.rank_idx = np.empty(2 * L * E, dtype=np.int64)  # [2*L*E] hm_rank's order, scratch
        self.rank_at, self.tmp_at = address(self.rank_idx), address(self.rank_idx[L * E :])
        self.used_at, self.rows_at = fields["used"], fields["rows"]
        self.order_at, self.score_at = fields["order"], fields["score"]
        self.after_at = address(self.after)

    def used_row(self, i: int, used: np.ndarray) -> int:
        """`used` copied into row i of `self.used`: its address."""
        self.used[i, : len(used)] = used
        return self.used_at + i * self.used.strides[0]


class ValueT(ctypes.Structure):
    """value_t: the value policy's state as predictor.c's hm_value_* read it."""

    _fields_ = [("p", P), ("mask", P), ("pinned", P), ("cache_version", P), ("seen", P)]
    _fields_ += [("cand", P), ("k", N), ("flat", P), ("score", P), ("idx", P), ("tmp", P)]
    _fields_ += [("out", P), ("D", P), ("after", P), ("slot_flat", P), ("n_slots", N)]


class BoundValue:
    """hm_value_background and hm_value_view bound to one value policy's arrays and its cache's
    (all updated in place, never rebound), with the arrays they write: `out`, `D` (the ranked
    background keys and their distances), `flat`, `score`, `idx` (a view's residents, minus their
    distances, the head's positions) and `after` (the view's layer after its visit)."""

    def __init__(self, native: Bound, cache, seen: np.ndarray, cand: np.ndarray):
        self.lib, self.native = native.lib, native
        L, E = native.used.shape
        self.out = np.empty(L * E, dtype=np.int64)  # [L*E]
        self.D = np.empty(L * E)  # [L*E]
        self._keep = (cache.mask, cache.pinned_mask, cache.row_version, seen, cand, cache.flat)
        assert all(a.flags.c_contiguous for a in self._keep)
        assert cache.mask.dtype == cache.pinned_mask.dtype == np.bool_
        self.flat, self.score, self.after = native.flat, native.neg, native.after
        self.idx = native.rank_idx
        self.struct = ValueT(
            p=native.p,
            mask=address(cache.mask),
            pinned=address(cache.pinned_mask),
            cache_version=address(cache.row_version),
            seen=address(seen),
            cand=address(cand),
            k=cand.shape[1],
            flat=native.flat_at,
            score=native.neg_at,
            idx=native.rank_at,
            tmp=native.tmp_at,
            out=address(self.out),
            D=address(self.D),
            after=native.after_at,
            slot_flat=address(cache.flat),
            n_slots=len(cache.flat),
        )
        self.v = ctypes.addressof(self.struct)
        self.rows, self.rows_at = native.rows, native.rows_at

    def bound_to(self, cache) -> bool:
        """Whether the cache's arrays are still the ones bound."""
        return self._keep[0] is cache.mask and self._keep[1] is cache.pinned_mask
