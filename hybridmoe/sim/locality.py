"""How much a trace's routing repeats from one token to the next: the share of a token's experts
(per layer) that the same request's previous token also used. It is the reuse an expert cache can
catch at all without prediction, so it says how much a trace favours caching."""

from __future__ import annotations

from hybridmoe.experts.plan.trace_format import TraceLine


def consecutive_overlap(lines: list[TraceLine]) -> float:
    """Mean over tokens and layers of |E(t) & E(t-1)| / |E(t)|, within each request (req; None is
    one request); 0.0 when no request has two tokens."""
    previous: dict[object, TraceLine] = {}
    shared = total = 0
    for line in lines:
        before = previous.get(line.req)
        if before is not None:
            for now, then in zip(line.layers, before.layers):
                shared += len(set(now) & set(then))
                total += len(now)
        previous[line.req] = line
    return shared / total if total else 0.0
