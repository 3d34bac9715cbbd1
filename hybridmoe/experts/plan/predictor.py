"""Which experts a layer will use at its next visit, as a probability per (layer, expert).

Four signals:

- router: the engine may apply the *next* layer's router to the current hidden state (the residual
  stream moves slowly) and hand the per-expert probabilities in (`set_router_scores`);
- recency: steps since the expert was last used in its layer;
- frequency: its long-run share of its layer's routing;
- cross-layer (optional, `cross_layer=True`): P(expert b at layer i+h | the token's experts at
  layer i) for h = 1, 2, learnt online from co-occurrence counts (`CrossLayer`). One token's
  routing is correlated from layer to layer, and a trace of expert ids alone is enough to learn
  it, so this works without router probabilities; h = 2 lets copies start a layer earlier.

Rather than weighting these by hand, the predictor keeps an online table of how often an expert in
each (router bucket, recency bucket, frequency bucket) cell was in fact used at the next visit,
with a Beta prior at the expert's own frequency. The table calibrates itself on whatever runs
through it, so nothing is tuned to one model or trace. p_base (what the visits after the next look
like, which no router score speaks of) reads a second table of (recency, frequency) cells that
counts every visit whatever its router bucket; without router scores the two tables agree.

It also scores itself: for every observed layer, precision and recall of its top-k guess.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

import hybridmoe.native.predictor_kernels as predictor_kernels
from hybridmoe.experts.plan.shape import Key
from hybridmoe.tuning import (
    AGE_EDGES,
    CROSS_LAYER_PRIOR,
    FREQ_EDGES,
    LIFT_EDGES,
    PREDICTOR_PRIOR_WEIGHT,
    PREDICTOR_WINDOW,
)


@dataclass
class PredictorStats:
    predicted: int = 0  # experts guessed (top-k per observed layer)
    correct: int = 0  # guessed and used
    actual: int = 0  # experts used

    @property
    def precision(self) -> float:
        return self.correct / self.predicted if self.predicted else 0.0

    @property
    def recall(self) -> float:
        return self.correct / self.actual if self.actual else 0.0


class CrossLayer:
    """P(expert b used at layer i+h | the token's experts at layer i), h in `horizons`.

    Counts, discounted over `window` steps like the frequency: co[h][i, a, b] = steps where a ran
    at layer i and b at layer i+h, n[h][i, a] = steps where a ran at layer i (and i+h followed).
    The score of b given the set S at layer i is the largest over a in S of the smoothed
    conditional (co[a, b] + prior * f(b)) / (n[a] + prior), f the marginal rate of b at layer i+h.
    It is not a calibrated probability: the predictor bands it and learns what each band means.

    The discount is kept as one scale per (h, layer) rather than applied to E*E counts each step:
    the true counts are co[h][i] * scale[h][i] (`counts`).
    """

    horizons = (1, 2)

    def __init__(self, n_layers: int, num_experts: int, window: int):
        L, E, H = n_layers, num_experts, len(self.horizons)
        self.keep = 1.0 - 1.0 / window if window else 1.0
        self.E = E
        # One array per kind, all horizons; co[h], n[h] and scale[h] are views of horizon h's part.
        self._co = np.zeros((H, L, E, E))  # [H, L, E, E]
        self._n = np.zeros((H, L, E))  # [H, L, E]
        self._scale = np.ones((H, L))  # [H, L]
        self.co = {h: self._co[k] for k, h in enumerate(self.horizons)}  # [L, E, E] each
        self.n = {h: self._n[k] for k, h in enumerate(self.horizons)}  # [L, E] each
        self.scale = {h: self._scale[k] for k, h in enumerate(self.horizons)}  # [L] each
        self.sets: dict[int, np.ndarray] = {}  # layer ordinal -> experts it used at this step

    def begin_step(self) -> None:
        self.sets.clear()

    def counts(self, h: int, i: int) -> tuple[np.ndarray, np.ndarray]:
        """The discounted (co [E, E], n [E]) of layer i and horizon h."""
        return self.co[h][i] * self.scale[h][i], self.n[h][i] * self.scale[h][i]

    def learn(self, i: int, used) -> None:
        """Layer ordinal i ran `used` at this step (layers arrive in model order)."""
        used = np.asarray(used, dtype=np.intp)
        for h in self.horizons:
            src = self.sets.get(i - h)
            if src is not None and len(src):
                scale = self.scale[h]
                scale[i - h] *= self.keep
                if scale[i - h] < 1e-150:  # fold the scale in before it underflows
                    self.co[h][i - h] *= scale[i - h]
                    self.n[h][i - h] *= scale[i - h]
                    scale[i - h] = 1.0
                one = 1.0 / scale[i - h]
                co = self.co[h][i - h].reshape(-1)  # a view of [E, E]
                co[(src[:, None] * self.E + used).ravel()] += one  # the pairs are distinct
                self.n[h][i - h][src] += one
        self.sets[i] = used

    def scores(self, i: int, h: int, rate: np.ndarray) -> np.ndarray:
        """Per expert of layer i+h, its probability given what layer i used at this step."""
        k = self.horizons.index(h)
        return self.scores_ahead(i, np.array([k]), rate[None])[0]

    def scores_ahead(self, i: int, ks: np.ndarray, rates: np.ndarray) -> np.ndarray:
        """`scores` for the horizons of index `ks` [H'] at once, given the rates [H', E] of their
        layers: [H', E]."""
        src, scale = self.sets[i], self._scale[ks, i][:, None, None]  # [H', 1, 1]
        f = np.minimum(rates, 1.0)[:, None, :]  # [H', 1, E]
        co = self._co[ks[:, None], i, src]  # [H', |S|, E]
        n = self._n[ks[:, None], i, src][:, :, None]  # [H', |S|, 1]
        cond = (co * scale + CROSS_LAYER_PRIOR * f) / (n * scale + CROSS_LAYER_PRIOR)
        # The strongest pull wins: the mean dilutes a strong successor by 1/|S|
        # (docs/notes/2026-11-24-measurements-in-code.md).
        return cond.max(axis=1)


_AGE = np.asarray(AGE_EDGES, dtype=float)
_FREQ = np.asarray(FREQ_EDGES, dtype=float)
_LIFT = np.asarray(LIFT_EDGES, dtype=float)
# Calibration cells: (router bucket 0-3, age bucket, frequency bucket) numbered base = (r * NA + a)
# * NF + f; with a cross-layer band b >= 1 (one per horizon and score level) the banded cell is
# base * NB + b, in a table of its own.
_NA, _NF = len(AGE_EDGES) + 1, len(FREQ_EDGES) + 1
_NB = 1 + 2 * (len(LIFT_EDGES) + 1)
ROUTER_TOP = 3  # the router bucket of the experts the router ranks among its top-k
_FREE = _NA * _NF  # (recency, frequency) cells: base % _FREE is a cell's without the router
_BASE_CELLS = 4 * _FREE


class Predictor:
    """Per (layer, expert) state in [L, E] arrays; each layer's probabilities are computed for
    all its experts at once and kept until something they depend on changes (`_stale`)."""

    window = PREDICTOR_WINDOW  # visits over which frequency is counted (0 = all history)

    def __init__(
        self,
        layers: list[int],
        num_experts: int,
        top_k: int,
        cross_layer: bool = False,
        native: bool = True,
    ):
        """`native`: run the per-visit arithmetic in C where it can be built (the same bits; the
        numpy path is the reference)."""
        self.layers, self.num_experts, self.top_k = list(layers), num_experts, top_k
        self.ordinal = {layer: i for i, layer in enumerate(self.layers)}
        L, E = len(self.layers), num_experts
        self.last_use = np.full((L, E), -(10**9), dtype=np.int64)  # [L, E] visit of last use
        self.count = np.zeros((L, E))  # [L, E] discounted uses
        self.weight = np.zeros(L)  # [L] visits counted in `count` (discounted like it)
        self.visits = np.zeros(L, dtype=np.int64)  # [L] steps observed per layer
        self.router = np.zeros((L, E), dtype=np.intp)  # [L, E] router bucket (0: no scores)
        self.band = np.zeros((L, E), dtype=np.intp)  # [L, E] cross-layer band (0: none)
        self.hits, self.trials = np.zeros(_BASE_CELLS), np.zeros(_BASE_CELLS)
        # (recency, frequency) cells over every visit, whatever the router said: p_base's
        self.free_hits, self.free_trials = np.zeros(_FREE), np.zeros(_FREE)
        self.band_hits = np.zeros(_BASE_CELLS * _NB)
        self.band_trials = np.zeros(_BASE_CELLS * _NB)
        # Per layer ordinal, kept until stale: its experts' calibration cells (`cell`; `banded`
        # where the layer has a cross-layer score) and probabilities: P (p_next), Q (p_base).
        self.cell = np.zeros((L, E), dtype=np.intp)  # [L, E]
        self.banded = np.zeros((L, E), dtype=np.intp)  # [L, E]
        self.P, self.Q = np.zeros((L, E)), np.zeros((L, E))  # [L, E] each
        self._stale_rows = set(range(L))
        # Pairs need more history than single experts (E*E counts): 4x the frequency window.
        self.cross = CrossLayer(L, E, 4 * self.window) if cross_layer else None
        self.lift: dict[int, int] = {}  # layer ordinal -> horizon of its cross-layer score
        self.stats = PredictorStats()
        self._used = (-1, None)  # (layer ordinal, experts) of the last count_use
        self.changes = 0  # bumped whenever any layer's probabilities may change
        self.row_version = np.zeros(L, dtype=np.int64)  # [L] bumped when that layer's may
        self.native = self._bind() if native else None

    def _bind(self):
        """predictor.c's kernels over this predictor's arrays, or None where they cannot run."""
        lib = predictor_kernels.library()
        if lib is None:
            return None
        edges = {"age_edges": _AGE, "freq_edges": _FREQ, "lift_edges": _LIFT}
        keep = 1.0 - 1.0 / self.window if self.window else 1.0
        constants = {
            "NA": _NA,
            "NF": _NF,
            "NB": _NB,
            "prior_w": PREDICTOR_PRIOR_WEIGHT,
            "cross_prior": CROSS_LAYER_PRIOR,
            "keep": keep,
            "cross_keep": self.cross.keep if self.cross else 1.0,
        }
        return predictor_kernels.Bound(lib, self, edges, constants)

    # ---- inputs ------------------------------------------------------------------------------
    def begin_step(self) -> None:
        """A step begins: the cross-layer signal starts from this step's first layer."""
        if self.cross is not None:
            self.cross.begin_step()
            if self.native:
                self.native.n_set[:] = 0

    def set_router_scores(self, layer: int, probs) -> None:
        """Probabilities for `layer`'s experts at its coming visit (None clears them)."""
        i = self.ordinal[layer]
        self._stale(i)
        row = self.router[i]
        if probs is None:
            row[:] = 0
            return
        probs = np.ascontiguousarray(probs, dtype=float)  # [E]
        if self.native:
            c = self.native
            c.lib.hm_pred_router(c.p, i, probs.ctypes.data, c.order_at)
            return
        k = self.top_k
        # rank < k: 3, < 2k: 2, else 1; ties broken by expert id, as a stable sort would
        order = np.argsort(-probs, kind="stable")
        row[:] = 1
        row[order[: 2 * k]] = 2
        row[order[:k]] = ROUTER_TOP

    def observe(self, layer: int, experts) -> None:
        """`layer` ran with `experts` (distinct ids) this step: learn from it, update its recency
        and frequency, then look ahead to the next layers."""
        self.count_use(layer, experts)
        self.look_ahead(layer)

    def count_use(self, layer: int, experts) -> None:
        """The part of `observe` that concerns `layer` itself: its calibration cells, recency and
        frequency (what the planner needs before it splits the layer)."""
        i = self.ordinal[layer]
        used = np.array(sorted(experts), dtype=np.intp)
        self._row(i)
        base = self.cell[i]
        self._score_guess(self.P[i], used)
        if self.native:
            c = self.native
            c.lib.hm_pred_count_use(c.p, i, c.used_row(i, used), len(used), i in self.lift)
        else:
            self._count_use(i, base, used)
        self.lift.pop(i, None)
        self._stale(i)
        self._used = (i, used)

    def _count_use(self, i: int, base: np.ndarray, used: np.ndarray) -> None:
        np.add.at(self.trials, base, 1.0)
        np.add.at(self.hits, base[used], 1.0)
        free = base % _FREE  # [E]: the same cells whatever the router said
        np.add.at(self.free_trials, free, 1.0)
        np.add.at(self.free_hits, free[used], 1.0)
        if i in self.lift:
            banded = self.banded[i]
            np.add.at(self.band_trials, banded, 1.0)
            np.add.at(self.band_hits, banded[used], 1.0)
        self.visits[i] += 1
        if self.window:  # discount old uses so the frequency follows drifting popularity
            keep = 1.0 - 1.0 / self.window
            self.count[i] *= keep
            self.weight[i] *= keep
        self.weight[i] += 1.0
        self.last_use[i, used] = self.visits[i]
        self.count[i, used] += 1.0
        self.router[i] = 0
        self.band[i] = 0

    def look_ahead(self, layer: int) -> None:
        """The rest of `observe`: learn the cross-layer pairs of what `layer` just used, then score
        layers i+1, i+2 given it (the nearer wins, since the layers arrive in order and a later
        call overwrites). Nothing to do without the cross-layer signal."""
        i = self.ordinal[layer]
        if self.cross is None or self._used[0] != i:
            return
        if self.native:
            self._look_ahead_native(i, self._used[1])
            return
        self.cross.learn(i, self._used[1])
        ahead = [(k, h) for k, h in enumerate(self.cross.horizons) if i + h < len(self.layers)]
        if not ahead:
            return
        ks, hs = (np.array(x) for x in zip(*ahead))  # [H'] each
        js = i + hs
        score = self.cross.scores_ahead(i, ks, self._rates(js))  # [H', E]
        level = np.searchsorted(_LIFT, score * self.num_experts / self.top_k, "left")
        self.band[js] = 1 + (hs[:, None] - 1) * (len(LIFT_EDGES) + 1) + level
        for h in hs.tolist():
            self.lift[i + h] = h
            self._stale(i + h)

    def _look_ahead_native(self, i: int, used: np.ndarray) -> None:
        c = self.native
        at = c.used_row(i, used)  # count_use left it there already
        c.lib.hm_pred_learn(c.p, i, at, len(used))
        self.cross.sets[i], c.n_set[i] = used, len(used)
        c.lib.hm_pred_bands(c.p, i, at, len(used), c.score_at)
        for h in self.cross.horizons:
            if i + h < len(self.layers):
                self.lift[i + h] = h
                self._stale(i + h)

    def visit(self, layer: int, experts, next_scores=None) -> None:
        """A visit of `layer` as the planner makes it: `count_use(layer, experts)`, the next
        layer's router scores (`next_scores`, where given: `set_router_scores`), `look_ahead`,
        then every layer's probabilities brought up to date (`matrices`). One C call where
        built."""
        i, L = self.ordinal[layer], len(self.layers)
        router = next_scores is not None and i + 1 < L
        if not self.native:
            self.count_use(layer, experts)
            if router:
                self.set_router_scores(self.layers[i + 1], next_scores)
            self.look_ahead(layer)
            self.matrices()
            return
        c, kernels = self.native, predictor_kernels
        used = sorted(experts)
        n = len(used)
        c.used[i, :n] = used
        flags = kernels.VISIT_BAND if i in self.lift else 0
        if router:
            c.probs[:] = next_scores
            flags |= kernels.VISIT_ROUTER
        stale = self._stale_rows  # rows left stale before (the profile's): refreshed as well
        if stale:
            flags |= kernels.VISIT_REFRESH if i in stale else 0
            c.rows[: len(stale)] = sorted(stale)
        hits = c.lib.hm_pred_visit(c.p, i, n, flags, len(stale))
        if hits < 0:  # a tie at the guess's k-th: numpy's argpartition decides, as it did
            hits = self._guess_hits(self.P[i], np.array(used))
            c.lib.hm_pred_visit(c.p, i, n, flags | kernels.VISIT_GUESSED, len(stale))
        self._score(hits, n)
        # the Python side of count_use, set_router_scores and look_ahead (C bumped row_version)
        ahead = range(i + 1, min(i + 1 + len(self.cross.horizons), L)) if self.cross else ()
        self.changes += 1 + router + len(ahead)
        self.lift.pop(i, None)
        for j in ahead:
            self.lift[j] = j - i
        if self.cross is not None:
            self.cross.sets[i] = used
        self._used = (i, used)
        stale.clear()

    def warm_start(self, counts: list[list[int]], tokens: int) -> None:
        """Frequency from activation statistics (the profile part of a trace, or a stats file)."""
        self.count[:] = np.asarray(counts, dtype=float)
        self.visits[:] = np.maximum(self.visits, tokens)
        self.weight[:] = float(tokens)
        self.recompute()

    def recompute(self) -> None:
        """Every layer's probabilities afresh when next read (after the tables changed)."""
        self._stale_rows.update(range(len(self.layers)))
        self.changes += 1
        self.row_version += 1

    # ---- outputs -----------------------------------------------------------------------------
    def p_next(self, key: Key) -> float:
        """Probability that expert key[1] is used at the next visit of layer key[0]."""
        i = self.ordinal[key[0]]
        self._row(i)
        return float(self.P[i, key[1]])

    def p_layer(self, layer: int) -> np.ndarray:
        """p_next of every expert of `layer` [E] (a view: read it, do not keep it)."""
        i = self.ordinal[layer]
        self._row(i)
        return self.P[i]

    def p_base_layer(self, layer: int) -> np.ndarray:
        """p_base of every expert of `layer` [E] (a view)."""
        i = self.ordinal[layer]
        self._row(i)
        return self.Q[i]

    def p_base(self, key: Key) -> float:
        """p_next without the cross-layer signal and the router's: what recency and frequency
        say. Both scores speak of the next visit only; the visits after it look like this."""
        i = self.ordinal[key[0]]
        self._row(i)
        return float(self.Q[i, key[1]])

    def after_visit(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """p_next of every expert of `layer` [E] as it will be once the layer's coming visit is
        counted (`count_use`), if the expert is used there and if it is not: what a plan of that
        visit needs to judge keeping an expert for the visit after, before the visit is counted.
        The calibration tables are read as they stand (the visit adds one trial to a cell)."""
        i = self.ordinal[layer]
        if self.native:
            c = self.native
            c.lib.hm_pred_after_visit(c.p, i, c.after_at)
            return c.after[0].copy(), c.after[1].copy()
        keep = 1.0 - 1.0 / self.window if self.window else 1.0
        weight = max(1.0, self.weight[i] * keep + 1.0)
        count = self.count[i] * keep  # [E]
        rate = np.stack((count + 1.0, count)) / weight  # [2, E]: used, not used
        age = np.ones_like(rate, dtype=np.int64)  # [2, E]
        age[1] = self.visits[i] + 2 - self.last_use[i]
        a = np.searchsorted(_AGE, age, "left")
        f = np.searchsorted(_FREQ, rate * self.num_experts / self.top_k, "left")
        base = a * _NF + f  # router bucket 0: the visit clears the router's scores
        prior = PREDICTOR_PRIOR_WEIGHT * np.minimum(rate, 1.0)
        p = (self.hits[base] + prior) / (self.trials[base] + PREDICTOR_PRIOR_WEIGHT)  # [2, E]
        return p[0], p[1]

    def matrices(self) -> tuple[np.ndarray, np.ndarray]:
        """(P, Q): p_next and p_base of every (layer ordinal, expert), [L, E] each, up to date."""
        if self._stale_rows:
            self._refresh(sorted(self._stale_rows))
        return self.P, self.Q

    def predict(self, layer: int, k: int | None = None) -> list[int]:
        """The k most likely experts of `layer` at its next visit, most likely first."""
        k = self.top_k if k is None else k
        return np.argsort(-self.p_layer(layer), kind="stable")[:k].tolist()

    # ---- internals ---------------------------------------------------------------------------
    def _stale(self, i: int) -> None:
        self._stale_rows.add(i)
        self.changes += 1
        self.row_version[i] += 1

    def _rates(self, i) -> np.ndarray:
        """Layer i's rates [E] (or layers i's [n, E])."""
        return self.count[i] / np.maximum(1.0, self.weight[i])[..., None]

    def _row(self, i: int) -> None:
        """Layer i's cells and probabilities, up to date."""
        if i in self._stale_rows:
            self._refresh([i])

    def _refresh(self, rows: list[int]) -> None:
        """The calibration cells and probabilities of layers `rows`, all experts at once."""
        self._stale_rows.difference_update(rows)
        if self.native:
            c = self.native
            c.rows[: len(rows)] = rows
            c.lib.hm_pred_refresh(c.p, c.rows_at, len(rows))
            return
        rate = self._rates(rows)  # [n, E]
        age = self.visits[rows, None] - self.last_use[rows] + 1  # [n, E]; 1: used last visit
        a = np.searchsorted(_AGE, age, "left")
        f = np.searchsorted(_FREQ, rate * self.num_experts / self.top_k, "left")
        free = a * _NF + f  # [n, E]
        base = self.router[rows] * _FREE + free  # [n, E]
        prior = PREDICTOR_PRIOR_WEIGHT * np.minimum(rate, 1.0)
        q = (self.hits[base] + prior) / (self.trials[base] + PREDICTOR_PRIOR_WEIGHT)
        self.cell[rows] = base
        w = PREDICTOR_PRIOR_WEIGHT
        self.Q[rows] = (self.free_hits[free] + prior) / (self.free_trials[free] + w)
        band = self.band[rows]  # [n, E]; nonzero exactly in the rows with a cross-layer score
        if band.any():
            banded = base * _NB + band
            w = PREDICTOR_PRIOR_WEIGHT
            with_band = (self.band_hits[banded] + prior) / (self.band_trials[banded] + w)
            q = np.where(band != 0, with_band, q)
            self.banded[rows] = banded
        self.P[rows] = q

    def _score_guess(self, p: np.ndarray, used: np.ndarray) -> None:
        self._score(self._guess_hits(p, used), len(used))

    def _guess_hits(self, p: np.ndarray, used: np.ndarray) -> int:
        """How many of `used` are among the top_k of p (the guess)."""
        k = min(self.top_k, len(p))
        guess = np.argpartition(-p, k - 1)[:k] if k < len(p) else np.arange(k)
        return len(set(guess.tolist()).intersection(used.tolist()))

    def _score(self, hits: int, used: int) -> None:
        self.stats.predicted += min(self.top_k, self.num_experts)
        self.stats.correct += hits
        self.stats.actual += used
