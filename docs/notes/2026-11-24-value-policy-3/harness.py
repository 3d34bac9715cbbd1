"""Scratch harness of docs/notes/2026-11-24-value-policy-3.md: the untried ideas of issue 15
item 3 as patches of ValuePolicy, value's tok/s (and with hybrimoe and static their ratios) on the
tuning traces of round two (two demo traces with OLMoE-1B-7B's sizes, two synthetic OLMoE-shaped
traces), planning charged as `bench policy-goals` charges it. From the repository root:

    H=docs/notes/2026-11-24-value-policy-3/harness.py
    python $H base                      # value as it is, with hybrimoe and static
    python $H base --value-only         # value alone (hybrimoe and static do not change)
    python $H ahead=2 --value-only      # (a) background copies only for the next k layers
    python $H gate=1 --value-only       # (a) a background copy must pay for its DRAM traffic
    python $H cgate=1 --value-only      # (a) the same, precision calibrated by p bucket
    python $H nobg=1 --value-only       # no background copies at all
    python $H quota=0.5 --value-only    # (b) per-layer quotas, mix of frequency and uniform
    python $H stay=4 --value-only       # (c) a demand copy's gain over H visits
    python $H hazard=20 --value-only    # (c) reuse distance from the age hazard, K visits
    python $H weight=0.5 --value-only   # a demand copy's gain weighed less
    python $H gate=1 --value-only --held   # the held-out traces
"""

import math
import sys

import numpy as np

from hybridmoe.bench.policy_goals import OLMOE, demo_layout
from hybridmoe.experts.plan import planner as planner_module
from hybridmoe.experts.plan.cache import placement
from hybridmoe.experts.plan.policies import ValuePolicy
from hybridmoe.experts.plan.profiles import get_profile
from hybridmoe.experts.plan.trace_format import read_trace
from hybridmoe.sim.shapes import get_shape
from hybridmoe.sim.simulator import SimConfig, simulate
from hybridmoe.sim.synthetic import SynthConfig, generate

OLMOE_SHAPE = get_shape("olmoe-1b-7b")
DEMO = demo_layout("olmoe-1b-7b")
TUNING = {
    "chat": lambda: (read_trace("docs/traces/demo-chat-travel_400tok.jsonl"), DEMO),
    "sm299": lambda: (read_trace("docs/traces/demo-smollm2-e16k8_299tok.jsonl"), DEMO),
    "syn1": lambda: (
        generate(SynthConfig(tokens=300, skew=1.0, locality=0.4, drift=60, seed=1, cross=0.5)),
        OLMOE_SHAPE,
    ),
    "syn2": lambda: (
        generate(SynthConfig(tokens=300, skew=0.7, locality=0.5, seed=2)),
        OLMOE_SHAPE,
    ),
}
HELD = {
    "olmoe": lambda: (read_trace(OLMOE.split("=")[0]), OLMOE_SHAPE),
    "code": lambda: (read_trace("docs/traces/demo-code-csv_400tok.jsonl"), DEMO),
    "longctx": lambda: (read_trace("docs/traces/demo-longctx-architecture_300tok.jsonl"), DEMO),
    "serve": lambda: (read_trace("docs/traces/demo-serve-4concurrent.jsonl"), DEMO),
    "sm63": lambda: (read_trace("docs/traces/demo-smollm2-e16k8_63tok.jsonl"), DEMO),
}

# ---- (a) look-ahead: background candidates only from the next k layers ------------------------
_background = ValuePolicy.background


def ahead(k):
    def background(self, layer, now, plan):
        d = self.planner.distances()
        for key in _background(self, layer, now, plan):
            if d[self.planner.ordinal[key[0]]] <= k:
                yield key

    ValuePolicy.background = background


# ---- (b) per-layer quotas from the statistics part ----------------------------------------------
def quota(mix):
    """Each layer's slots: `mix` of the frequency placement's count, the rest uniform."""
    warm = ValuePolicy.warm_start

    def warm_start(self, stats):
        warm(self, stats)
        keys = placement("frequency", self.cache.slots, self.planner.layers, self.E, stats)
        freq = np.bincount([self.planner.ordinal[k[0]] for k in keys], minlength=self.L)
        share = mix * freq + (1 - mix) * self.cache.slots / self.L
        q = np.floor(share).astype(int)
        for i in np.argsort(-(share - q))[: self.cache.slots - q.sum()]:
            q[i] += 1
        self._quotas = q
        _QUOTAS[:] = [q, self.planner.ordinal]

    def _quota(self, layer):
        return int(self._quotas[self.planner.ordinal[layer]])

    def row_scores(self, i, now):
        layer = self.planner.layers[i]
        return np.array([self.keep_score((layer, e), now) for e in range(self.E)])

    ValuePolicy.partition = True
    ValuePolicy.warm_start, ValuePolicy._quota, ValuePolicy.row_scores = (
        warm_start,
        _quota,
        row_scores,
    )
    ValuePolicy.default_placement = "frequency"
    planner_module.placement = placed_by_quota


_QUOTAS = []


def placed_by_quota(kind, slots, layers, num_experts, stats):
    """Each layer's most used experts, as many as its quota (the cache starts at the quotas)."""
    q, ordinal = _QUOTAS
    keys = placement(kind, len(layers) * num_experts, layers, num_experts, stats)
    taken = np.zeros(len(layers), dtype=int)
    out = []
    for k in keys:
        i = ordinal[k[0]]
        if taken[i] < q[i]:
            out.append(k)
            taken[i] += 1
    return out


# ---- (c) admission by expected uses over the stay (H visits) rather than the next one -----------
def stay(h):
    def admit_gain(self, key, victim, now):
        view = self._view()
        _, Q = self.predictor.matrices()

        def uses(k, used):
            return view.p_after(k, used) + (h - 1) * Q[self.planner.ordinal[k[0]], k[1]]

        lost = uses(victim, False) if victim is not None else 0.0
        return view.saving * (uses(key, True) - lost)

    ValuePolicy.admit_gain = admit_gain


# ---- (a') a background copy is worth its DRAM: measured precision x saving vs overlap cost ------
def gate(scale):
    """Queue a background copy only if (prefetches used + 1) / (issued + 2), times the seconds a
    hit saves, beats `scale` x the CPU time its DRAM traffic adds (its overlap with this layer's
    CPU experts times 1 - 1/slowdown)."""
    bg, worth = ValuePolicy.background, ValuePolicy.worth

    def background(self, layer, now, plan):
        self._plan = plan
        return bg(self, layer, now, plan)

    def worth2(self, key, victim, now):
        if not worth(self, key, victim, now):
            return False
        s, plan = self.planner.stats, self._plan
        precision = (s.prefetches_used + 1) / (s.prefetches_issued + 2)
        start = max(now, self.planner.copy_free)
        overlap = max(0.0, min(start + self.cost.t_copy(), plan.cpu_finish) - start)
        cost = overlap * (1 - 1 / self.planner.times.slowdown)
        return precision * self.cost.hit_saving(1) > scale * cost

    ValuePolicy.background, ValuePolicy.worth = background, worth2


# ---- (c') reuse distance from the calibration tables' hazard by age, not a geometric 1/q --------
def hazard(K):
    """The visits after the next one until an expert's next use: R(a) = 1 + (1 - h(a)) R(a + 1),
    h(a) the calibrated probability of use at a visit where its age is a (router bucket 0, its
    frequency bucket), over K visits and 1/h beyond. D = d + L (1 - p) R."""
    from hybridmoe.experts.plan import predictor as pm

    def reuse(pred, rows, cols, offset):
        rate = pred.count[rows, cols] / np.maximum(1.0, pred.weight[rows])  # [n]
        f = np.searchsorted(pm._FREQ, rate * pred.num_experts / pred.top_k, "left")
        age0 = pred.visits[rows] - pred.last_use[rows, cols] + offset  # [n]
        ages = np.minimum(age0, 10**6)[:, None] + np.arange(K)  # [n, K]
        base = np.searchsorted(pm._AGE, ages, "left") * pm._NF + f[:, None]
        w = pm.PREDICTOR_PRIOR_WEIGHT
        h = (pred.hits[base] + w * np.minimum(rate, 1.0)[:, None]) / (pred.trials[base] + w)
        R = 1.0 / np.maximum(h[:, -1], 1e-3)
        for j in range(K - 1, -1, -1):
            R = 1.0 + (1.0 - h[:, j]) * R
        return R

    def distance(self, key, now, arrive=None):
        i = self.planner.ordinal[key[0]]
        d = self._distances(np.array([i]), np.array([key[1]]), now, arrive)
        return float(d[0])

    def _distances(self, rows, cols, now, arrive=None):
        P, _ = self.predictor.matrices()
        d = self.planner.distances()[rows]
        t = self.planner.layer_period
        if arrive is not None and t > 0:
            d = d + self.L * (arrive > now + d * t)
        p = np.maximum(P[rows, cols], 1e-3)
        return d + self.L * (1.0 - p) * reuse(self.predictor, rows, cols, 2)

    def _residents_by(self, position, here, p_not):
        P, _ = self.predictor.matrices()
        mask, pinned = self.cache.mask, self.cache.pinned_mask
        flat = np.flatnonzero(mask & ~pinned)  # [n]
        rows, cols = np.divmod(flat, self.E)
        p = P[rows, cols].copy()
        mine = rows == here
        p[mine] = p_not[cols[mine]]
        R = reuse(self.predictor, rows, cols, 2)
        if mine.any():
            R[mine] = reuse(self.predictor, rows[mine], cols[mine], 3)
        d = self.planner.distances(position)[rows]
        return flat, -(d + self.L * (1.0 - np.maximum(p, 1e-3)) * R)

    ValuePolicy.distance, ValuePolicy._distances = distance, _distances
    ValuePolicy._residents_by = _residents_by


# ---- (a'') the same, each copy's chance of use during its stay calibrated by its p bucket ------
def cgate(scale, edges=(0.2, 0.4, 0.6, 0.8)):
    """As `gate`, with the precision of the background copies issued at the candidate's p_next
    bucket: a copy counts as used if it is routed before it is evicted."""
    bg, worth, on_use, on_insert = (
        ValuePolicy.background,
        ValuePolicy.worth,
        ValuePolicy.on_use,
        ValuePolicy.on_insert,
    )

    def background(self, layer, now, plan):
        self._plan = plan
        if not hasattr(self, "_pending"):
            self._pending, self._out = {}, np.zeros((len(edges) + 1, 2))  # [B, used/resolved]
        return bg(self, layer, now, plan)

    def worth2(self, key, victim, now):
        if not worth(self, key, victim, now):
            return False
        b = int(np.searchsorted(edges, self.predictor.p_next(key)))
        used, resolved = self._out[b]
        precision = (used + 1) / (resolved + 2)
        start = max(now, self.planner.copy_free)
        overlap = max(0.0, min(start + self.cost.t_copy(), self._plan.cpu_finish) - start)
        cost = overlap * (1 - 1 / self.planner.times.slowdown)
        if precision * self.cost.hit_saving(1) > scale * cost:
            self._pending[key] = b
            return True
        return False

    def on_use2(self, layer, routed, now):
        on_use(self, layer, routed, now)
        for r in routed:
            b = getattr(self, "_pending", {}).pop((layer, r.expert), None)
            if b is not None:
                self._out[b] += 1

    def on_insert2(self, key, victim, now):
        on_insert(self, key, victim, now)
        b = getattr(self, "_pending", {}).pop(victim, None)
        if b is not None:
            self._out[b, 1] += 1

    ValuePolicy.background, ValuePolicy.worth = background, worth2
    ValuePolicy.on_use, ValuePolicy.on_insert = on_use2, on_insert2


# ---- no background copies at all (what prefetching is worth) ------------------------------------
def nobg(_):
    ValuePolicy.background = lambda self, layer, now, plan: ()


# ---- what a demand copy leaves, weighed less (value_weight below 1; round one tried 2 and 4) ----
def weight(x):
    gain = ValuePolicy.admit_gain

    def admit_gain(self, key, victim, now):
        return x * gain(self, key, victim, now)

    ValuePolicy.admit_gain = admit_gain


def tok_s(lines, shape, policy, budget):
    cost = get_profile("rtx4090-ddr5").for_expert(shape.experts, "q4")
    r = simulate(lines, shape, cost, SimConfig(policy=policy, budget=budget))
    return r.tokens_per_s, r


def score(traces, others=True):
    vh, vs = [], []
    for name, make in traces.items():
        lines, shape = make()
        for budget in ("0.1", "0.25"):
            v, r = tok_s(lines, shape, "value", budget)
            if not others:
                print(
                    f"  {name} {budget} value {v:.2f} hit {r.hit_rate:.3f} prefetch "
                    f"{r.prefetches_per_token:.1f} precision {r.prefetch_precision:.2f}"
                )
                continue
            vh.append(v / tok_s(lines, shape, "hybrimoe", budget)[0])
            vs.append(v / tok_s(lines, shape, "static", budget)[0])
            print(
                f"  {name} {budget} value {v:.1f} hit {r.hit_rate:.3f} copies "
                f"{r.copies_per_token:.1f} prefetch {r.prefetches_per_token:.1f} "
                f"÷ hybrimoe {vh[-1]:.3f} ÷ static {vs[-1]:.3f}"
            )

    def geo(xs):
        return math.exp(sum(map(math.log, xs)) / len(xs))

    if others:
        print(f"geometric mean: value ÷ hybrimoe {geo(vh):.4f}, value ÷ static {geo(vs):.4f}")


if __name__ == "__main__":
    args = sys.argv[1:]
    traces = HELD if "--held" in args else TUNING
    for arg in args:
        name, _, x = arg.partition("=")
        if name in ("ahead", "quota", "stay", "gate", "hazard", "weight", "cgate", "nobg"):
            globals()[name](int(x) if name in ("ahead", "hazard") else float(x))
    print(" ".join(args))
    score(traces, others="--value-only" not in args)
