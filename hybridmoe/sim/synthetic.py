"""Synthetic routing traces with known skew and locality, for tuning policies without overfitting
the one real trace we keep for reporting.

Per layer, expert popularity is Zipf(`skew`) over a random permutation; at each token, each expert
the layer used at the previous token is kept with probability `locality`, the rest of the top-k is
drawn by popularity without replacement. Every `drift` tokens a fraction of the popularity order is
reshuffled (topic changes), which a static placement cannot follow.

Cross-layer correlation (`cross` > 0): real routing of one token is correlated from layer to layer
(the residual stream moves slowly). Each expert of layer l-1 has `fanout` random successors in
layer l; the non-kept part of layer l is drawn from the mixture (1 - cross) * popularity + cross *
(successors of the token's layer l-1 experts, each equally). `cross=0` gives exactly the traces of
before (the successor tables use their own random stream).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hybridmoe.experts.plan.trace_format import TraceLine


@dataclass
class SynthConfig:
    layers: int = 16
    experts: int = 64
    top_k: int = 8
    tokens: int = 300
    skew: float = 1.0  # Zipf exponent of popularity within a layer
    locality: float = 0.4  # chance a previous-token expert is chosen again
    drift: int = 0  # tokens between popularity reshuffles (0 = never)
    drift_fraction: float = 0.3
    cross: float = (
        0.0  # weight of the previous layer's successors in the draw (0 = independent layers)
    )
    fanout: int = 4  # successors per expert in the next layer
    seed: int = 0


def successors(cfg: SynthConfig) -> np.ndarray:
    """[layers, experts, experts]: row (l, a) is the draw distribution that expert a of layer l-1
    gives layer l (uniform over its `fanout` successors); row 0 is unused."""
    rng = np.random.default_rng([cfg.seed, 1])
    succ = np.zeros((cfg.layers, cfg.experts, cfg.experts))
    for layer in range(1, cfg.layers):
        for a in range(cfg.experts):
            succ[layer, a, rng.choice(cfg.experts, size=cfg.fanout, replace=False)] = (
                1.0 / cfg.fanout
            )
    return succ


def generate(cfg: SynthConfig) -> list[TraceLine]:
    rng = np.random.default_rng(cfg.seed)
    base = 1.0 / np.arange(1, cfg.experts + 1) ** cfg.skew
    order = [rng.permutation(cfg.experts) for _ in range(cfg.layers)]
    succ = successors(cfg) if cfg.cross > 0 else None
    prev: list[list[int]] = [[] for _ in range(cfg.layers)]
    lines = []
    for t in range(cfg.tokens):
        if cfg.drift and t and t % cfg.drift == 0:
            order = [_reshuffle(o, cfg.drift_fraction, rng) for o in order]
        layers = []
        for layer in range(cfg.layers):
            pop = np.empty(cfg.experts)
            pop[order[layer]] = base
            if succ is not None and layer > 0:
                pop = (1 - cfg.cross) * pop / pop.sum() + cfg.cross * succ[layer, layers[-1]].mean(
                    axis=0
                )
            kept = [e for e in prev[layer] if rng.random() < cfg.locality]
            ids = _draw(pop, kept, cfg.top_k, rng)
            layers.append(ids)
            prev[layer] = ids
        lines.append(TraceLine(t + 1, layers))
    return lines


def _draw(pop: np.ndarray, kept: list[int], k: int, rng) -> list[int]:
    p = pop.copy()
    p[kept] = 0.0
    need = k - len(kept)
    rest = rng.choice(len(p), size=need, replace=False, p=p / p.sum()) if need > 0 else []
    return sorted(int(e) for e in list(kept) + list(rest))


def _reshuffle(order: np.ndarray, fraction: float, rng) -> np.ndarray:
    order = order.copy()
    n = max(2, int(len(order) * fraction))
    idx = rng.choice(len(order), size=n, replace=False)
    order[idx] = order[rng.permutation(idx)]
    return order
