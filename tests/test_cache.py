"""The GPU expert cache: budgets, placements, statistics files and slot bookkeeping."""

from __future__ import annotations

import pytest

from hybridmoe.errors import UserError
from hybridmoe.experts.plan.cache import ExpertCache, parse_budget, placement
from hybridmoe.experts.plan.stats import ExpertStats, read_stats, write_stats


def test_parse_budget_bytes_and_fractions():
    total, one = 1000 * 4e6, 4e6  # 1000 experts of 4 MB
    assert parse_budget("0.1", total, one) == 100
    assert parse_budget(0.25, total, one) == 250
    assert parse_budget("1", total, one) == 1000
    assert parse_budget("6GB", total, one) == 1000  # more than everything: capped
    assert parse_budget("400MB", total, one) == 100
    assert parse_budget("1GiB", total, one) == 268  # 1073741824 / 4e6
    assert parse_budget("0", total, one) == 0
    for bad in ("six", "12", "-1GB", "1.5XB"):
        with pytest.raises(UserError):
            parse_budget(bad, total, one)


def stats_example() -> ExpertStats:
    s = ExpertStats(layers=[3, 4], num_experts=4, tokens=10)
    s.counts = [[1, 9, 0, 5], [7, 2, 8, 3]]
    return s


def test_placements():
    s = stats_example()
    assert placement("frequency", 3, [3, 4], 4, s) == [(3, 1), (4, 2), (4, 0)]
    assert placement("uniform", 3, [3, 4], 4, s) == [(3, 1), (3, 3), (4, 2)]
    assert placement("front-loading", 5, [3, 4], 4, s) == [(3, 1), (3, 3), (3, 0), (3, 2), (4, 2)]
    assert placement("uniform", 2, [3, 4], 4, None) == [(3, 0), (4, 0)]
    with pytest.raises(UserError):
        placement("frequency", 2, [3, 4], 4, None)
    with pytest.raises(UserError):
        placement("random", 2, [3, 4], 4, s)


def test_stats_file_round_trip_and_errors(tmp_path):
    path = tmp_path / "stats.json"
    write_stats(path, stats_example())
    back = read_stats(path)
    assert back.counts == stats_example().counts and back.layers == [3, 4] and back.tokens == 10
    assert back.counts[back.layers.index(4)][2] == 8
    (tmp_path / "x.json").write_text('{"format": "other"}')
    with pytest.raises(UserError):
        read_stats(tmp_path / "x.json")
    with pytest.raises(UserError):
        read_stats(tmp_path / "missing.json")


def test_cache_slots_pins_and_in_flight_copies():
    c = ExpertCache(3)
    c.place([(0, 1)], pinned=True)
    c.insert((0, 2), ready_at=5.0)
    assert (
        c.is_ready((0, 1), 0.0)
        and (0, 2) in c
        and not c.is_ready((0, 2), 4.9)
        and c.is_ready((0, 2), 5.0)
    )
    slot = c.insert((1, 1), ready_at=1.0)
    assert c.free_count() == 0
    assert c.insert((1, 2), ready_at=2.0, evict=(1, 1)) == slot  # the victim's slot is reused
    assert set(c.dynamic()) == {(0, 2), (1, 2)}
    with pytest.raises(AssertionError):
        c.remove((0, 1))  # pinned
    with pytest.raises(AssertionError):
        c.insert((2, 2), ready_at=0.0)  # full, no victim
    c.check()
    assert len(c) == 3
