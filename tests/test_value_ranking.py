"""The value policy's rankings in C (predictor.c: hm_rank, hm_rank_head, hm_value_background,
hm_value_view) give the numpy reference's order, ties included; a narrowed ranking, the background
keys of some layers only, and the hinted ones, are the full ones filtered."""

from __future__ import annotations

import numpy as np
import pytest

import hybridmoe.native.predictor_kernels as predictor_kernels
from hybridmoe.bench.planner import routed_steps
from hybridmoe.experts.plan.cache import parse_budget
from hybridmoe.experts.plan.planner import make_planner
from hybridmoe.experts.plan.policies import make_policy
from hybridmoe.experts.plan.predictor import Predictor
from hybridmoe.experts.plan.profiles import get_profile
from hybridmoe.experts.plan.ranked import Ranked, rank, rank_head
from hybridmoe.sim.shapes import get_shape

L, E = 6, 16


def native():
    """A predictor's bound kernels (the rankings' scratch arrays are sized by L * E)."""
    if predictor_kernels.library() is None:
        pytest.fail("the predictor's C kernels did not build (no C compiler?)")
    return Predictor(list(range(L)), E, 4).native


def tied(rng, n):
    """n distinct flat keys in random order and scores with many ties."""
    flat = rng.permutation(L * E)[:n].astype(np.int64)
    return flat, rng.integers(0, 4, n) / 4.0


@pytest.mark.parametrize("seed", range(20))
def test_rank_orders_by_score_then_key(seed):
    rng = np.random.default_rng(seed)
    flat, scores = tied(rng, int(rng.integers(1, L * E)))
    want = sorted(range(len(flat)), key=lambda j: (scores[j], flat[j]))
    c = native()
    assert rank(flat, scores).tolist() == want
    assert rank(flat, scores, c).tolist() == want
    for first in (1, 5, 16, len(flat) + 3):
        assert rank_head(flat, scores, first, c).tolist() == want[:first]


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("with_c", [True, False], ids=["c", "numpy"])
def test_a_narrowed_ranking_is_the_rest_filtered(seed, with_c):
    rng = np.random.default_rng(seed)
    flat, scores = tied(rng, int(rng.integers(1, L * E)))
    c = native() if with_c else None
    ids = np.arange(100, 100 + L)
    full = list(Ranked(flat, scores, ids, E, c))
    assert full == [(100 + f // E, f % E) for f in flat[rank(flat, scores)]]
    read = int(rng.integers(0, len(full) + 1))
    wanted = rng.random(L * E) < 0.3  # [L*E] by flat key
    ranked = Ranked(flat, scores, ids, E, c)
    head = [next(ranked) for _ in range(read)]
    rest = list(ranked.narrow(lambda f: wanted[f]))
    assert head == full[:read]
    assert rest == [k for k in full[read:] if wanted[(k[0] - 100) * E + k[1]]]


def _planner(with_c, monkeypatch):
    if not with_c:
        monkeypatch.setattr(predictor_kernels, "library", lambda: None)
    shape = get_shape("olmoe-1b-7b")
    e, n = shape.experts, shape.num_moe_layers
    cost = get_profile("rtx4090-ddr5").for_expert(e, "q4")
    steps, hints = routed_steps(shape, 1, 40, seed=5)
    slots = parse_budget("0.1", cost.expert_bytes * e.num_experts * n, cost.expert_bytes)
    layers = list(e.moe_layers)
    planner = make_planner(
        cost, layers, e.num_experts, e.top_k, slots, make_policy("value"), profile=steps[:16]
    )
    monkeypatch.undo()
    return planner, layers, steps, hints


def _orders(with_c, monkeypatch):
    """Every background order value's policy gives over 24 steps, read to the end, and its keys
    the look-ahead hint ranks top-k (what the planner asks for past the usual deadline)."""
    planner, layers, steps, hints = _planner(with_c, monkeypatch)
    assert (planner.predictor.native is not None) == with_c
    out, clock = [], 0.0
    for s in range(16, 40):
        planner.begin_step()
        for o, routed in enumerate(steps[s]):
            plan = planner.plan(layers[o], routed, now=clock, defer=True)
            full = list(planner.policy.background(layers[o], clock, plan))
            if with_c:  # the distances it ranked by, bit for bit
                _check_distances(planner, full, clock)
            rows = np.flatnonzero(np.random.default_rng(s * 100 + o).random(len(layers)) < 0.2)
            some = list(planner.policy.background_in(rows, layers[o], clock, plan))
            assert some == [k for k in full if planner.ordinal[k[0]] in rows]
            hinted = list(planner._hinted_keys(layers[o], clock, plan))
            router = planner.predictor.router
            assert hinted == [k for k in full if router[planner.ordinal[k[0]], k[1]] == 3]
            out += [full, hinted]
            planner.prepare(plan, hints[s][o] if s % 2 else None)
            planner.complete(plan)
            clock = plan.makespan
    return out


def _check_distances(planner, keys, now):
    """hm_value_background's distances of `keys` (its last call's) are numpy's, bit for bit."""
    policy, v = planner.policy, planner.policy._kernels()
    rows = np.array([planner.ordinal[k[0]] for k in keys], dtype=np.intp)
    cols = np.array([k[1] for k in keys], dtype=np.intp)
    arrive = max(now, planner.copy_free) + planner.cost.t_copy()
    want = policy._distances(rows, cols, now, arrive)
    assert v.D[: len(keys)].tobytes() == want.tobytes()


def test_background_candidates_in_c_are_numpys(monkeypatch):
    if predictor_kernels.library() is None:
        pytest.fail("the predictor's C kernels did not build (no C compiler?)")
    with_c, reference = _orders(True, monkeypatch), _orders(False, monkeypatch)
    assert sum(map(len, with_c)) > 1000  # orders of some length were compared
    assert sum(map(len, with_c[1::2])) > 20  # hinted keys among them
    assert with_c == reference
