"""Scratch harness of docs/notes/2026-11-25-staging-and-layer-budgets.md: value with background
staging copies that are not admitted, and with layer-aware budgets, as patches of the code at
this note's base commit; value's tok/s and value ÷ hybrimoe on the demo traces marked "(tuning)"
(OLMoE-1B-7B's sizes, `rtx4090-ddr5`, Q4, planning charged), as `bench policy-goals` runs them.
From the repository root:

    H=docs/notes/2026-11-25-staging-and-layer-budgets/harness.py
    python $H base                        # value as it is
    python $H ring=2 inside=1 slack=0     # a staging ring of 2 buffers, counted in the budget
    python $H ring=1 slack=0 promote=1    # a used staged key is then admitted (buffer swapped)
    python $H ring=2 inside=0 slack=0     # a ring of 2 outside the budget (an upper bound)
    python $H skew=0.5                    # layer-aware budgets: hard quotas by warm-up skew, mix 0.5
    python $H floor=0.5                   # soft: one pool, a layer under half its quota keeps its own
    python $H ... --held                  # the held-out demo traces
    python $H ... --olmoe                 # the OLMoE trace (no hint: staging uses p_next)
"""

import math
import sys

import numpy as np

from hybridmoe.bench.policy_goals import OLMOE, demo_layout
from hybridmoe.experts.plan import planner as planner_module
from hybridmoe.experts.plan.policies import Policy, ValuePolicy
from hybridmoe.experts.plan.predictor import ROUTER_TOP
from hybridmoe.experts.plan.profiles import get_profile
from hybridmoe.experts.plan.trace_format import read_trace
from hybridmoe.sim import simulator as sim_module
from hybridmoe.sim.shapes import get_shape
from hybridmoe.sim.simulator import SimConfig, simulate

TUNING = ["demo-chat-travel_400tok", "demo-smollm2-e16k8_299tok"]
HELD = [
    "demo-code-csv_400tok",
    "demo-longctx-architecture_300tok",
    "demo-serve-4concurrent",
    "demo-smollm2-e16k8_63tok",
]
Planner = planner_module.Planner
COUNT = {"staged": 0, "used": 0, "promoted": 0}


# ---- (1) staging copies that are not admitted ----------------------------------------------
def staging(ring: int, slack: float, inside: bool, top: int, promote: bool):
    """After value's background copies, while the copy stream would start a copy `slack`
    copy-times before the next layer's plan, copy up to `ring` of the next layer's predicted keys
    (those the hint ranks top-k, else the `top` likeliest by p_next) that are not resident into
    staging buffers: nothing is evicted; the buffer serves the next layer as a copy in flight
    would (a late hit) and is dropped after it. `inside`: the ring's buffers come out of the
    cache's slots. `promote`: a staged key that ran on the GPU is then admitted as a demand copy
    would be (its buffer swapped with the victim's slot: no copy), if the policy's gain is >= 0."""
    old_init, old_bg, old_classify, old_prepare = (
        Planner.__init__,
        Planner._background,
        Planner._classify,
        Planner.prepare,
    )

    def __init__(self, *a, **k):
        old_init(self, *a, **k)
        self._staged, self._lent = {}, []

    def _background(self, layer, now, plan):
        old_bg(self, layer, now, plan)
        if self.policy.name != "value":
            return
        o = self.ordinal[layer] + 1
        if o >= len(self.layers):
            return  # the hint speaks of the next layer of this step only
        nxt = self.layers[o]
        deadline = plan.makespan + self.gap - slack * self.cost.t_copy()
        row = self.predictor.router[o]
        if (row == ROUTER_TOP).any():
            wanted = np.flatnonzero(row == ROUTER_TOP)
        else:
            P, _ = self.predictor.matrices()
            wanted = np.argsort(-P[o], kind="stable")[:top]
        P, _ = self.predictor.matrices()
        wanted = sorted(wanted.tolist(), key=lambda e: (-P[o, e], e))
        for e in wanted:
            if len(self._staged) >= ring or max(now, self.copy_free) >= deadline:
                break
            key = (nxt, e)
            if key in self.cache or key in self._staged:
                continue
            copy = self._issue(nxt, e, "stage", now, plan.prefetches)
            self._staged[key] = copy.ready
            COUNT["staged"] += 1

    def _classify(self, layer, routed, now, plan):
        staged = {k: t for k, t in self._staged.items() if k[0] == layer}
        self._staged = {k: t for k, t in self._staged.items() if k[0] != layer}
        for r in routed:
            key = (layer, r.expert)
            if key in staged and key not in self.cache:
                self.cache.ready_at[key] = staged[key]  # lent for this plan only
                self._lent.append(key)
                COUNT["used"] += 1
        return old_classify(self, layer, routed, now, plan)

    def prepare(self, plan, predicted=None):
        ran = {r.expert for r in plan.gpu_copied}
        for key in self._lent:
            if key not in self.cache.slot_of:
                ready = self.cache.ready_at.pop(key)
                if promote and key[1] in ran:
                    _promote(self, key, ready, plan)
        self._lent = []
        return old_prepare(self, plan, predicted)

    def _promote(self, key, ready, plan):
        protect = self.protected(plan.now, plan)
        ok, victim = self.policy.make_room(key, protect, plan.now, self.cache.free_count())
        if ok and self.policy.admit_gain(key, victim, plan.now) >= 0.0:
            self.cache.insert(key, ready, evict=victim)
            self.policy.on_insert(key, victim, plan.now)
            COUNT["promoted"] += 1

    Planner.__init__, Planner._background = __init__, _background
    Planner._classify, Planner.prepare = _classify, prepare
    if inside:
        old_make = sim_module.make_planner

        def make_planner(cost, layers, num_experts, top_k, slots, policy, *a, **k):
            if policy.name == "value":
                slots = max(slots - ring, 0)
            return old_make(cost, layers, num_experts, top_k, slots, policy, *a, **k)

        sim_module.make_planner = make_planner


# ---- (2) layer-aware budgets ----------------------------------------------------------------
_plain_placement_box = []


def _plain_placement(*a):
    return _plain_placement_box[0](*a)


def layer_budgets(mix: float, power: float):
    """value's cache as per-layer quotas: each layer's share mixes uniform (1 - mix) with its
    routing skew on the warm-up half (mix): the share of the layer's uses its top-q experts
    took, q the uniform quota, minus q/E (what a uniform router would give), to the `power`;
    the cache starts at the quotas (frequency placement within each layer)."""
    old_warm = ValuePolicy.warm_start

    def warm_start(self, stats):
        old_warm(self, stats)
        counts = np.asarray(stats.counts, dtype=float)  # [L, E]
        q = max(1, self.cache.slots // self.L)
        top = -np.sort(-counts, axis=1)[:, :q].sum(axis=1) / np.maximum(counts.sum(axis=1), 1)
        skew = np.maximum(top - q / self.E, 1e-6) ** power
        share = (1 - mix) / self.L + mix * skew / skew.sum()
        raw = share * self.cache.slots
        quota = np.floor(raw).astype(int)
        for i in np.argsort(-(raw - quota), kind="stable")[: self.cache.slots - quota.sum()]:
            quota[i] += 1
        self._quotas = {layer: int(quota[i]) for i, layer in enumerate(self.planner.layers)}

    def _quota(self, layer):
        return self._quotas[layer]

    ValuePolicy.warm_start, ValuePolicy._quota = warm_start, _quota
    ValuePolicy.partition = True
    old_place = planner_module.placement

    def placement(kind, slots, layers, num_experts, stats):
        keys = old_place(kind, slots, layers, num_experts, stats)
        pol = _current.get("policy")
        if pol is None or pol.name != "value" or stats is None:
            return keys
        out = []
        for layer in layers:
            i = layers.index(layer)
            order = np.argsort(-np.asarray(stats.counts[i], dtype=float), kind="stable")
            out += [(layer, int(e)) for e in order[: pol._quotas[layer]]]
        return out

    _plain_placement_box.append(old_place)
    planner_module.placement = placement
    old_place_fn = planner_module.place

    def place(planner, kind, stats):
        _current["policy"] = planner.policy
        return old_place_fn(planner, kind, stats)

    planner_module.place = place


_current = {}


def layer_floors(mix: float, frac: float):
    """Layer-aware budgets, soft: value's cache stays one pool, but a layer holding no more than
    `frac` of its skew quota (layer_budgets' quotas, mix `mix`) loses no resident to another
    layer's key (its own keys may still replace them)."""
    layer_budgets(mix, 1.0)
    ValuePolicy.partition = False
    planner_module.placement = _plain_placement

    def floor_ok(self, victim, layer):
        i = self.planner.ordinal[victim[0]]
        held = int(self.cache.mask[i].sum())
        return victim[0] == layer or held > frac * self._quotas[victim[0]]

    def _victim(self, keys, protect, now):
        layer = _current.get("key", (None,))[0]
        for k in self._ranking(now):
            if k not in protect and k in self.cache and k not in self.cache.pinned:
                if floor_ok(self, k, layer):
                    return k
        return None

    def make_room(self, key, protect, now, free, taken=0):
        _current["key"] = key
        try:
            return Policy.make_room(self, key, protect, now, free, taken)
        finally:
            _current.pop("key", None)

    def rooms(self, layer, protect, now, free):
        yield from [None] * free
        for k in self._ranking(now):
            if k in self.cache and k not in self.cache.pinned and k not in protect:
                if floor_ok(self, k, layer):
                    protect.add(k)
                    yield k

    ValuePolicy._victim, ValuePolicy.make_room, ValuePolicy.rooms = _victim, make_room, rooms


def main(args):
    opts = dict(a.split("=") for a in args if "=" in a)
    if "ring" in opts:
        staging(
            int(opts["ring"]),
            float(opts.get("slack", 0)),
            opts.get("inside", "1") == "1",
            int(opts.get("top", 8)),
            opts.get("promote", "0") == "1",
        )
    if "floor" in opts:
        layer_floors(float(opts.get("mix", 1)), float(opts["floor"]))
    elif "skew" in opts:
        layer_budgets(float(opts["skew"]), float(opts.get("power", 1)))
    demo = demo_layout("olmoe-1b-7b")
    if "--olmoe" in args:
        path, _, shape = OLMOE.partition("=")
        runs = [("olmoe-1b-7b_299tok", path, get_shape(shape))]
    else:
        names = HELD if "--held" in args else TUNING
        runs = [(n, f"docs/traces/{n}.jsonl", demo) for n in names]
    ratios, values = [], []
    for name, path, shape in runs:
        lines = read_trace(path)
        cost = get_profile("rtx4090-ddr5").for_expert(shape.experts, "q4")
        for budget in ("0.1", "0.25"):
            out = {}
            for policy in ("hybrimoe", "value"):
                COUNT.update(staged=0, used=0, promoted=0)
                out[policy] = simulate(lines, shape, cost, SimConfig(policy=policy, budget=budget))
            v, h = out["value"], out["hybrimoe"]
            ratios.append(v.tokens_per_s / h.tokens_per_s)
            values.append(v.tokens_per_s)
            print(
                f"{name} {budget}: value {v.tokens_per_s:.2f} tok/s hit {v.hit_rate:.3f} "
                f"slots {v.slots} staged {COUNT['staged']} used {COUNT['used']} "
                f"promoted {COUNT['promoted']} | hybrimoe "
                f"{h.tokens_per_s:.2f} | value/hybrimoe {ratios[-1]:.4f}",
                flush=True,
            )
    gm = math.exp(sum(map(math.log, ratios)) / len(ratios))
    print(f"geometric mean value/hybrimoe: {gm:.4f}; value tok/s: {values}")


if __name__ == "__main__":
    main(sys.argv[1:])
