"""Which experts a layer will use at its next visit, as a probability per (layer, expert).

Three signals, as in shared/DESIGN.md ("predictor"):

- router: the engine may apply the *next* layer's router to the current hidden state (the residual
  stream moves slowly) and hand the per-expert probabilities in (`set_router_scores`);
- recency: steps since the expert was last used in its layer;
- frequency: its long-run share of its layer's routing.

Rather than weighting these by hand, the predictor keeps an online table of how often an expert in
each (router bucket, recency bucket, frequency bucket) cell was in fact used at the next visit,
with a Beta prior at the expert's own frequency. The table calibrates itself on whatever runs
through it, so nothing is tuned to one model or trace.

It also scores itself: for every observed layer, precision and recall of its top-k guess.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

Key = tuple[int, int]

_AGE_EDGES = (1, 2, 3, 5, 9, 17)  # steps since last use -> bucket 0..6 (6 = older or never)
_FREQ_EDGES = (0.25, 0.5, 1.0, 2.0, 4.0)  # rate / (top_k / num_experts) -> bucket 0..5
_PRIOR_WEIGHT = 4.0  # pseudo-observations at the expert's own frequency


def _bucket(x: float, edges) -> int:
    return bisect.bisect_left(edges, x)


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


class Predictor:
    # Visits over which frequency is counted (0 = all history). 128 measured on synthetic traces:
    # 1-1.5% faster where popularity drifts, within 1% where it does not; 32 hurt without drift.
    window = 128

    def __init__(self, layers: list[int], num_experts: int, top_k: int):
        self.layers, self.num_experts, self.top_k = list(layers), num_experts, top_k
        self.ordinal = {layer: i for i, layer in enumerate(self.layers)}
        L, E = len(self.layers), num_experts
        self.last_use = [[-(10**9)] * E for _ in range(L)]
        self.count = [[0.0] * E for _ in range(L)]
        self.weight = [0.0] * L  # visits counted in `count` (discounted like it)
        self.visits = [0] * L  # steps observed per layer
        self.router: dict[int, list[int]] = {}  # layer ordinal -> rank of each expert by router score
        self._p: dict[int, list[float]] = {}  # layer ordinal -> p_next of each expert, until it changes
        self.hits: dict[tuple, float] = {}
        self.trials: dict[tuple, float] = {}
        self.stats = PredictorStats()

    # ---- inputs ------------------------------------------------------------------------------
    def set_router_scores(self, layer: int, probs) -> None:
        """Probabilities for `layer`'s experts at its coming visit (None clears them)."""
        i = self.ordinal[layer]
        self._p.pop(i, None)
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
        """`layer` ran with `experts` (ids) this step: learn from it, then update recency/frequency."""
        i = self.ordinal[layer]
        used = set(experts)
        self._score_guess(i, used)
        trials, hits = self.trials, self.hits
        for e in range(self.num_experts):
            cell = self._cell(i, e)
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
        self._p.pop(i, None)

    def warm_start(self, counts: list[list[int]], tokens: int) -> None:
        """Frequency from activation statistics (the profile part of a trace, or a stats file)."""
        for i, row in enumerate(counts):
            self.count[i] = [float(c) for c in row]
            self.visits[i] = max(self.visits[i], tokens)
            self.weight[i] = float(tokens)
        self._p.clear()

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

    def predict(self, layer: int, k: int | None = None) -> list[int]:
        """The k most likely experts of `layer` at its next visit, most likely first."""
        k = self.top_k if k is None else k
        p = self.p_layer(layer)
        return sorted(range(self.num_experts), key=lambda e: -p[e])[:k]

    def age(self, key: Key) -> int:
        i = self.ordinal[key[0]]
        return self.visits[i] - self.last_use[i][key[1]]

    # ---- internals ---------------------------------------------------------------------------
    def _estimate(self, i: int, e: int) -> float:
        cell = self._cell(i, e)
        prior = min(1.0, self._rate(i, e))
        return (self.hits.get(cell, 0.0) + _PRIOR_WEIGHT * prior) / (self.trials.get(cell, 0.0) + _PRIOR_WEIGHT)

    def _rate(self, i: int, e: int) -> float:
        return self.count[i][e] / max(1.0, self.weight[i])

    def _cell(self, i: int, e: int) -> tuple:
        age = self.visits[i] - self.last_use[i][e] + 1  # 1 = used at the previous visit
        rel = self.count[i][e] / max(1.0, self.weight[i]) * self.num_experts / self.top_k
        return (self._router_bucket(i, e), bisect.bisect_left(_AGE_EDGES, age), bisect.bisect_left(_FREQ_EDGES, rel))

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
