"""The predictor as it was written first, per (layer, expert) in plain Python: the reference the
vectorised one (hybridmoe/experts/plan/predictor.py) must agree with (tests/test_predictor.py).

Which experts a layer will use at its next visit, as a probability per (layer, expert).

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
through it, so nothing is tuned to one model or trace.

It also scores itself: for every observed layer, precision and recall of its top-k guess.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np

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
    """

    horizons = (1, 2)

    def __init__(self, n_layers: int, num_experts: int, window: int):
        L, E = n_layers, num_experts
        self.keep = 1.0 - 1.0 / window if window else 1.0
        self.co = {h: np.zeros((L, E, E)) for h in self.horizons}  # [L, E, E]
        self.n = {h: np.zeros((L, E)) for h in self.horizons}  # [L, E]
        self.sets: dict[int, list[int]] = {}  # layer ordinal -> experts it used at this step

    def begin_step(self) -> None:
        self.sets.clear()

    def learn(self, i: int, used: list[int]) -> None:
        """Layer ordinal i ran `used` at this step (layers arrive in model order)."""
        for h in self.horizons:
            src = self.sets.get(i - h)
            if src:
                co, n = self.co[h][i - h], self.n[h][i - h]
                co *= self.keep
                n *= self.keep
                co[np.ix_(src, used)] += 1.0
                n[src] += 1.0
        self.sets[i] = list(used)

    def scores(self, i: int, h: int, rate) -> np.ndarray:
        """Per expert of layer i+h, its probability given what layer i used at this step."""
        src = self.sets[i]
        f = np.minimum(np.asarray(rate, dtype=float), 1.0)  # [E]
        cond = (self.co[h][i][src] + CROSS_LAYER_PRIOR * f) / (
            self.n[h][i][src, None] + CROSS_LAYER_PRIOR
        )  # [|S|, E]
        # The strongest pull wins: the mean dilutes a strong successor by 1/|S|
        # (docs/notes/2026-11-24-measurements-in-code.md).
        return cond.max(axis=0)


class Predictor:
    window = PREDICTOR_WINDOW  # visits over which frequency is counted (0 = all history)

    def __init__(self, layers: list[int], num_experts: int, top_k: int, cross_layer: bool = False):
        self.layers, self.num_experts, self.top_k = list(layers), num_experts, top_k
        self.ordinal = {layer: i for i, layer in enumerate(self.layers)}
        L, E = len(self.layers), num_experts
        self.last_use = [[-(10**9)] * E for _ in range(L)]
        self.count = [[0.0] * E for _ in range(L)]
        self.weight = [0.0] * L  # visits counted in `count` (discounted like it)
        self.visits = [0] * L  # steps observed per layer
        self.router: dict[
            int, list[int]
        ] = {}  # layer ordinal -> rank of each expert by router score
        self._p: dict[
            int, list[float]
        ] = {}  # layer ordinal -> p_next of each expert, until it changes
        self._base: dict[int, list[float]] = {}  # the same without the cross-layer signal
        self.hits: dict[tuple, float] = {}
        self.trials: dict[tuple, float] = {}
        # Pairs need more history than single experts (E*E counts): 4x the frequency window.
        self.cross = CrossLayer(L, E, 4 * self.window) if cross_layer else None
        self.lift: dict[
            int, tuple[int, list[float]]
        ] = {}  # layer ordinal -> (h, cross-layer score per expert)
        self.stats = PredictorStats()

    # ---- inputs ------------------------------------------------------------------------------
    def begin_step(self) -> None:
        """A step begins: the cross-layer signal starts from this step's first layer."""
        if self.cross is not None:
            self.cross.begin_step()

    def set_router_scores(self, layer: int, probs) -> None:
        """Probabilities for `layer`'s experts at its coming visit (None clears them)."""
        i = self.ordinal[layer]
        self._p.pop(i, None)
        self._base.pop(i, None)
        if probs is None:
            self.router.pop(i, None)
        else:
            probs = [float(p) for p in probs]
            order = sorted(range(len(probs)), key=lambda e: -probs[e])
            rank = [0] * len(probs)
            for r, e in enumerate(order):
                rank[e] = r
            self.router[i] = rank

    def observe(self, layer: int, experts) -> None:
        """`layer` ran with `experts` (ids) this step: learn from it,
        then update recency/frequency."""
        i = self.ordinal[layer]
        used = set(experts)
        self._score_guess(i, used)
        trials, hits = self.trials, self.hits
        for e in range(self.num_experts):
            for cell in self._cells(i, e):
                trials[cell] = trials.get(cell, 0.0) + 1.0
                if e in used:
                    hits[cell] = hits.get(cell, 0.0) + 1.0
        self.visits[i] += 1
        if self.window:  # discount old uses so the frequency follows drifting popularity
            keep = 1.0 - 1.0 / self.window
            self.count[i] = [c * keep for c in self.count[i]]
            self.weight[i] *= keep
        self.weight[i] += 1.0
        for e in used:
            self.last_use[i][e] = self.visits[i]
            self.count[i][e] += 1.0
        self.router.pop(i, None)
        self.lift.pop(i, None)
        self._p.pop(i, None)
        self._base.pop(i, None)
        if self.cross is not None:
            self._look_ahead(i, sorted(used))

    def _look_ahead(self, i: int, used: list[int]) -> None:
        """Learn from this token's layer i, then score layers i+1, i+2 given it (the nearer wins,
        since the layers arrive in order and a later call overwrites)."""
        self.cross.learn(i, used)
        for h in self.cross.horizons:
            j = i + h
            if j < len(self.layers):
                rate = [self._rate(j, e) for e in range(self.num_experts)]
                self.lift[j] = (h, self.cross.scores(i, h, rate).tolist())
                self._p.pop(j, None)
                self._base.pop(j, None)

    def warm_start(self, counts: list[list[int]], tokens: int) -> None:
        """Frequency from activation statistics (the profile part of a trace, or a stats file)."""
        for i, row in enumerate(counts):
            self.count[i] = [float(c) for c in row]
            self.visits[i] = max(self.visits[i], tokens)
            self.weight[i] = float(tokens)
        self._p.clear()
        self._base.clear()

    # ---- outputs -----------------------------------------------------------------------------
    def p_next(self, key: Key) -> float:
        """Probability that expert key[1] is used at the next visit of layer key[0]."""
        return self.p_layer(key[0])[key[1]]

    def p_layer(self, layer: int) -> list[float]:
        """p_next of every expert of `layer`; cached until that layer is observed again."""
        i = self.ordinal[layer]
        p = self._p.get(i)
        if p is None:
            p = self._p[i] = [self._estimate(i, e) for e in range(self.num_experts)]
        return p

    def p_base(self, key: Key) -> float:
        """p_next without the cross-layer signal and the router's: what recency and frequency
        say. Both scores speak of the next visit only; the visits after it look like this."""
        i = self.ordinal[key[0]]
        p = self._base.get(i)
        if p is None:
            p = self._base[i] = [self._estimate(i, e, cross=False) for e in range(self.num_experts)]
        return p[key[1]]

    def predict(self, layer: int, k: int | None = None) -> list[int]:
        """The k most likely experts of `layer` at its next visit, most likely first."""
        k = self.top_k if k is None else k
        p = self.p_layer(layer)
        return sorted(range(self.num_experts), key=lambda e: -p[e])[:k]

    # ---- internals ---------------------------------------------------------------------------
    def _estimate(self, i: int, e: int, cross: bool = True) -> float:
        cell = self._cells(i, e)[-1 if cross else 0]
        prior = min(1.0, self._rate(i, e))
        return (self.hits.get(cell, 0.0) + PREDICTOR_PRIOR_WEIGHT * prior) / (
            self.trials.get(cell, 0.0) + PREDICTOR_PRIOR_WEIGHT
        )

    def _rate(self, i: int, e: int) -> float:
        return self.count[i][e] / max(1.0, self.weight[i])

    def _cells(self, i: int, e: int) -> list[tuple]:
        """The calibration cells this (layer, expert) falls in now: its recency/frequency/router
        cell, first the same cell whatever the router said (p_base reads it), and last that cell
        split by the cross-layer band when there is one (all are learnt, so p_base stays
        calibrated on every layer)."""
        base = self._cell(i, e)
        band = self._cross_bucket(i, e)
        free = ("any router",) + base[1:]
        return [free, base, base + (band,)] if band else [free, base]

    def _cell(self, i: int, e: int) -> tuple:
        age = self.visits[i] - self.last_use[i][e] + 1  # 1 = used at the previous visit
        rel = self.count[i][e] / max(1.0, self.weight[i]) * self.num_experts / self.top_k
        return (
            self._router_bucket(i, e),
            bisect.bisect_left(AGE_EDGES, age),
            bisect.bisect_left(FREQ_EDGES, rel),
        )

    def _cross_bucket(self, i: int, e: int) -> int:
        """0: no cross-layer score for this visit; else one band per (horizon, score level)."""
        got = self.lift.get(i)
        if got is None:
            return 0
        h, score = got
        level = bisect.bisect_left(LIFT_EDGES, score[e] * self.num_experts / self.top_k)
        return 1 + (h - 1) * (len(LIFT_EDGES) + 1) + level

    def _router_bucket(self, i: int, e: int) -> int:
        ranks = self.router.get(i)
        if ranks is None:
            return 0
        rank = ranks[e]
        return 3 if rank < self.top_k else 2 if rank < 2 * self.top_k else 1

    def _score_guess(self, i: int, used: set[int]) -> None:
        guess = self.predict(self.layers[i])
        self.stats.predicted += len(guess)
        self.stats.correct += len(used.intersection(guess))
        self.stats.actual += len(used)
