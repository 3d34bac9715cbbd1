"""The worst planner split found against the brute force, on realistic and contrived machines:
`python -m tests.split_search [N]` (N instances of each kind). The figures it prints are in
docs/benchmarks.md, "Planner split quality"."""

from __future__ import annotations

import sys

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from tests.test_planner import contrived_costs, realistic_costs, split_ratio, tight_layer

POLICIES = ["value", "hybrimoe", "lru", "lfu"]


def worst(costs, n: int):
    found = [0.0, None]

    @settings(
        max_examples=n,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        phases=[Phase.generate],
        database=None,
    )
    @given(instance=tight_layer(costs), policy=st.sampled_from(POLICIES), stage=st.booleans())
    def search(instance, policy, stage):
        ratio = split_ratio(instance, policy, stage)
        if ratio > found[0]:
            found[:] = [ratio, (instance, policy, stage)]

    search()
    return found


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
    for name, costs in (("realistic", realistic_costs), ("contrived", contrived_costs)):
        ratio, (instance, policy, stage) = worst(costs, n)
        cost, routed, residents, free, copy_busy = instance
        print(f"{name}: worst planner / brute force over {n} instances = {ratio:.4f}")
        print(
            f"  policy {policy}, staging {'on' if stage else 'off'}, {free} free slots, copy "
            f"stream busy {copy_busy * 1e6:.0f} us"
        )
        for r in routed:
            state = residents.get((0, r.expert))
            kind = "miss" if state is None else "hit" if state[0] is None else "late"
            print(
                f"  expert {r.expert}: {r.n_tokens} tokens, {kind}; cpu "
                f"{cost.t_cpu(r.n_tokens) * 1e6:.0f} us, gpu {cost.t_gpu(r.n_tokens) * 1e6:.0f} "
                f"us, copy {cost.t_copy() * 1e6:.0f} us"
            )


if __name__ == "__main__":
    main()
