"""The predictor's cross-layer signal, checked against references computed another way."""

from __future__ import annotations

import numpy as np
import pytest

from hybridmoe.experts.plan.predictor import CrossLayer, Predictor, PredictorStats
from hybridmoe.sim.synthetic import SynthConfig, generate, successors

L, E, K = 4, 32, 4


def planted(tokens, seed, cross=0.8):
    cfg = SynthConfig(
        layers=L,
        experts=E,
        top_k=K,
        tokens=tokens,
        skew=1.0,
        locality=0.3,
        cross=cross,
        fanout=1,
        seed=seed,
    )
    return cfg, generate(cfg)


def precision_on_second_half(lines, cross_layer):
    p = Predictor(list(range(L)), E, K, cross_layer=cross_layer)
    for t, line in enumerate(lines):
        if t == len(lines) // 2:
            p.stats = PredictorStats()  # learn on the first half, score on the second
        p.begin_step()
        for i, ids in enumerate(line.layers):
            p.observe(i, ids)
    return p.stats.precision


def test_cross_layer_counts_equal_the_co_occurrences_counted_directly():
    _, lines = planted(120, seed=4)
    cross = CrossLayer(L, E, window=0)  # no discount: plain counts
    for line in lines:
        cross.begin_step()
        for i, ids in enumerate(line.layers):
            cross.learn(i, ids)
    for h in (1, 2):
        for i in range(L - h):
            ref = np.zeros((E, E))
            for line in lines:
                ref[np.ix_(line.layers[i], line.layers[i + h])] += 1
            assert np.array_equal(cross.co[h][i], ref)
            assert np.array_equal(cross.n[h][i], ref.sum(axis=1) / K)


def test_cross_layer_finds_the_planted_successor_of_frequent_experts():
    cfg, lines = planted(600, seed=5)
    truth = successors(cfg).argmax(axis=2)  # [L, E]: the one successor each expert has
    cross = CrossLayer(L, E, window=0)
    for line in lines:
        cross.begin_step()
        for i, ids in enumerate(line.layers):
            cross.learn(i, ids)
    n, co = cross.n[1], cross.co[1]
    seen = [(i, a) for i in range(L - 1) for a in range(E) if n[i, a] >= 30]
    # co-occurrences beyond what b's own frequency explains: n(a) * (P(b | a) - P(b))
    excess = [co[i, a] - n[i, a] * co[i].sum(axis=0) / n[i].sum() for i, a in seen]
    found = sum(int(np.argmax(x)) == truth[i + 1, a] for x, (i, a) in zip(excess, seen))
    assert len(seen) > 20 and found / len(seen) > 0.9


def test_cross_layer_predictor_beats_frequency_and_recency_alone_on_planted_correlation():
    gains = []
    for seed in (1, 2, 3):
        _, lines = planted(600, seed)
        gains.append(precision_on_second_half(lines, True) - precision_on_second_half(lines, False))
    assert min(gains) > 0.0 and sum(gains) / len(gains) > 0.01


def test_cross_layer_predictor_costs_little_without_correlation():
    _, lines = planted(600, seed=6, cross=0.0)
    assert precision_on_second_half(lines, True) > precision_on_second_half(lines, False) - 0.01


def test_p_base_ignores_the_cross_layer_signal():
    _, lines = planted(200, seed=7)
    with_x, without = (
        Predictor(list(range(L)), E, K, cross_layer=True),
        Predictor(list(range(L)), E, K),
    )
    for line in lines:
        with_x.begin_step()
        without.begin_step()
        for i, ids in enumerate(line.layers):
            with_x.observe(i, ids)
            without.observe(i, ids)
    with_x.begin_step()
    without.begin_step()
    with_x.observe(0, lines[0].layers[0])
    without.observe(0, lines[0].layers[0])
    # Layer 1 now has a cross-layer score in one predictor only; their base estimates agree.
    assert with_x.lift and not without.lift
    assert all(abs(with_x.p_base((1, e)) - without.p_next((1, e))) < 1e-12 for e in range(E))


def test_vectorised_predictor_equals_the_per_expert_reference():
    """Every probability, at every layer after every observation, as the plain-Python predictor
    it replaced computes it (tests/reference_predictor.py), router scores and cross-layer signal
    included."""
    from tests.reference_predictor import Predictor as Reference

    _, lines = planted(160, seed=8)
    rng = np.random.default_rng(8)
    fast = Predictor(list(range(L)), E, K, cross_layer=True)
    slow = Reference(list(range(L)), E, K, cross_layer=True)
    fast.warm_start([[t % 3 for t in range(E)]] * L, 10)
    slow.warm_start([[t % 3 for t in range(E)]] * L, 10)
    for line in lines:
        fast.begin_step()
        slow.begin_step()
        for i, ids in enumerate(line.layers):
            if i + 1 < L and rng.random() < 0.5:
                probs = rng.dirichlet(np.full(E, 0.3))
                fast.set_router_scores(i + 1, probs)
                slow.set_router_scores(i + 1, probs)
            fast.observe(i, ids)
            slow.observe(i, ids)
            for j in range(L):
                np.testing.assert_allclose(fast.p_layer(j), slow.p_layer(j), rtol=1e-9)
                np.testing.assert_allclose(
                    fast.p_base_layer(j), [slow.p_base((j, e)) for e in range(E)], rtol=1e-9
                )
            assert fast.predict(i) == slow.predict(i)
    assert vars(fast.stats) == vars(slow.stats)


def test_the_c_kernels_give_the_numpy_paths_bits():
    """Every array the predictor keeps, after every visit (router scores, cross-layer pairs, a
    discount that folds), and after_visit, from predictor.c and from numpy: equal bit for bit."""
    _, lines = planted(200, seed=5)
    rng = np.random.default_rng(5)
    fast = Predictor(list(range(L)), E, K, cross_layer=True)
    plain = Predictor(list(range(L)), E, K, cross_layer=True, native=False)
    assert fast.native is not None, "the predictor's C kernels did not build (no C compiler?)"
    for p in (fast, plain):
        p.cross.keep = 1e-3  # a short memory, so that the pairs' scale folds often
        if p.native:
            p.native.struct.cross_keep = p.cross.keep
        p.warm_start([[t % 3 for t in range(E)]] * L, 10)
    names = ("P", "Q", "count", "weight", "last_use", "router", "band", "hits", "trials")
    names += ("band_hits", "band_trials", "free_hits", "free_trials")
    for line in lines:
        for p in (fast, plain):
            p.begin_step()
        for i, ids in enumerate(line.layers):
            probs = rng.dirichlet(np.full(E, 0.3)) if rng.random() < 0.5 else None
            for j in (0, 1):
                np.testing.assert_array_equal(fast.after_visit(i)[j], plain.after_visit(i)[j])
            for p in (fast, plain):
                if i + 1 < L:
                    p.set_router_scores(i + 1, probs)
                p.observe(i, ids)
                p.matrices()
            for name in names:
                np.testing.assert_array_equal(getattr(fast, name), getattr(plain, name), name)
            for h in fast.cross.horizons:
                np.testing.assert_array_equal(fast.cross.co[h], plain.cross.co[h])
                np.testing.assert_array_equal(fast.cross.scale[h], plain.cross.scale[h])
    assert vars(fast.stats) == vars(plain.stats)


@pytest.mark.parametrize("cross_layer", [True, False], ids=["cross-layer", "without"])
def test_a_visit_in_one_c_call_gives_the_numpy_paths_bits(cross_layer):
    """Predictor.visit (the planner's: count_use, the next router's scores, look_ahead, matrices)
    as one call of predictor.c's hm_pred_visit and as numpy's steps: every array, version, count
    and score of the guess equal after every visit, ties of the guess included (warm-started
    counts make many equal probabilities)."""
    _, lines = planted(200, seed=11)
    rng = np.random.default_rng(11)
    fast = Predictor(list(range(L)), E, K, cross_layer=cross_layer)
    plain = Predictor(list(range(L)), E, K, cross_layer=cross_layer, native=False)
    assert fast.native is not None, "the predictor's C kernels did not build (no C compiler?)"
    for p in (fast, plain):
        if cross_layer:
            p.cross.keep = 1e-3  # a short memory, so that the pairs' scale folds often
            if p.native:
                p.native.struct.cross_keep = p.cross.keep
        p.warm_start([[t % 2 for t in range(E)]] * L, 10)
    names = ("P", "Q", "cell", "count", "weight", "last_use", "router", "band", "hits", "trials")
    names += ("band_hits", "band_trials", "free_hits", "free_trials", "row_version")
    for t, line in enumerate(lines):
        for p in (fast, plain):
            p.begin_step()
        for i, ids in enumerate(line.layers):
            probs = rng.dirichlet(np.full(E, 0.3)) if rng.random() < 0.5 else None
            if t % 7 == 0:  # stale rows before the visit, as the profile leaves them
                for p in (fast, plain):
                    p.recompute()
            elif t % 3 == 0:  # one stale row, maybe the visit's own or one it changes
                j = int(rng.integers(L))
                for p in (fast, plain):
                    p._stale(j)
            for p in (fast, plain):
                p.visit(i, ids, probs)
            for name in names:
                np.testing.assert_array_equal(getattr(fast, name), getattr(plain, name), name)
            assert (fast.changes, fast.lift) == (plain.changes, plain.lift)
            assert not fast._stale_rows and not plain._stale_rows
            if cross_layer:
                for h in fast.cross.horizons:
                    np.testing.assert_array_equal(fast.cross.co[h], plain.cross.co[h])
                    np.testing.assert_array_equal(fast.cross.scale[h], plain.cross.scale[h])
    assert vars(fast.stats) == vars(plain.stats)
    assert fast.stats.predicted > 0


def test_after_visit_is_what_counting_the_visit_gives():
    """after_visit, made before a visit, against the probabilities count_use leaves after it:
    equal but for the one trial the visit adds to each calibration cell it touched."""
    rng = np.random.default_rng(3)
    L, E, k = 4, 16, 4
    predictor = Predictor(list(range(L)), E, k, cross_layer=True)
    for t in range(150):
        predictor.begin_step()
        for layer in range(L):
            if t % 3 == 0:
                predictor.set_router_scores(layer, rng.random(E))
            predictor.observe(layer, rng.choice(E, k, replace=False))
    for _ in range(40):
        predictor.begin_step()
        for layer in range(L):
            used = rng.choice(E, k, replace=False)
            p_used, p_not = predictor.after_visit(layer)
            predictor.count_use(layer, used)
            trials = predictor.trials.min()
            mask = np.isin(np.arange(E), used)
            after = predictor.p_layer(layer)
            assert np.abs(np.where(mask, p_used, p_not) - after).max() <= 1.0 / (trials + 4.0)
            predictor.look_ahead(layer)


@pytest.mark.parametrize("native", [True, False], ids=["c-kernels", "numpy"])
def test_p_base_does_not_hear_the_router_and_p_next_does(native):
    """Two predictors see the same visits, one with router scores for every layer but the first:
    p_base (the visits after the next) is the same bits in both, since it counts every visit in
    (recency, frequency) cells whatever the router said; p_next differs where scores were given."""
    _, lines = planted(120, seed=9)
    rng = np.random.default_rng(9)
    scored = Predictor(list(range(L)), E, K, cross_layer=True, native=native)
    plain = Predictor(list(range(L)), E, K, cross_layer=True, native=native)
    differs = 0
    for line in lines:
        for p in (scored, plain):
            p.begin_step()
        for i, ids in enumerate(line.layers):
            if i + 1 < L:
                scored.set_router_scores(i + 1, rng.dirichlet(np.full(E, 0.3)))
            for p in (scored, plain):
                p.observe(i, ids)
            P1, Q1 = scored.matrices()
            P0, Q0 = plain.matrices()
            np.testing.assert_array_equal(Q1, Q0)
            differs += int((P1 != P0).any())
    assert differs > len(lines)  # the router moved p_next on most visits
