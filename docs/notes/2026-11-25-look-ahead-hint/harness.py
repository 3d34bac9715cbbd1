"""Scratch harness of docs/notes/2026-11-25-look-ahead-hint.md: value (and hybrimoe) with and
without the traces' look-ahead hint, and ways of using it, as patches; tok/s, hit rate and the
predictor's top-k recall on the hinted tuning traces (the two demo traces marked "(tuning)",
OLMoE-1B-7B's sizes), planning charged as `bench policy-goals` charges it. From the repository
root:

    H=docs/notes/2026-11-25-look-ahead-hint/harness.py
    python $H base                  # hints off and on, value and hybrimoe
    python $H qfree=1               # p_base (q, the later visits) without the router bucket
    python $H slack=0.25            # value's background slack, in copies (tuning: 1)
    python $H cand=8                # value's background candidates per layer (tuning: 4)
    python $H qfree=1 hinted=0      # keys the hint ranks top-k: slack 0 copies (others keep 1)
    python $H numpy=1               # the predictor's numpy path (must equal the C one)
    python $H base --held           # the held-out demo traces
"""

import math
import sys

import numpy as np

from hybridmoe import tuning
from hybridmoe.bench.policy_goals import demo_layout
from hybridmoe.experts.plan import predictor as predictor_module
from hybridmoe.experts.plan.policies import ValuePolicy
from hybridmoe.experts.plan.profiles import get_profile
from hybridmoe.experts.plan.trace_format import read_trace
from hybridmoe.native import predictor_kernels
from hybridmoe.sim.simulator import SimConfig, simulate

DEMO = demo_layout("olmoe-1b-7b")
TUNING = ["demo-chat-travel_400tok", "demo-smollm2-e16k8_299tok"]
HELD = [
    "demo-code-csv_400tok",
    "demo-longctx-architecture_300tok",
    "demo-serve-4concurrent",
    "demo-smollm2-e16k8_63tok",
]
P = predictor_module.Predictor
_NA, _NF = predictor_module._NA, predictor_module._NF


def numpy_path():
    predictor_kernels.library = lambda: None


# ---- q without the router bucket: the later visits read the marginal over router buckets ------
_count_use, _refresh = P._count_use, P._refresh


def _count_use_qfree(self, i, base, used):
    _count_use(self, i, base, used)
    base0 = base % (_NA * _NF)  # the same (age, frequency) cell, router bucket 0
    hinted = base != base0
    if hinted.any():
        np.add.at(self.trials, base0[hinted], 1.0)
        np.add.at(self.hits, base0[used][hinted[used]], 1.0)


def _refresh_qfree(self, rows):
    _refresh(self, rows)
    base0 = self.cell[rows] % (_NA * _NF)  # [n, E]
    rate = self._rates(rows)
    prior = predictor_module.PREDICTOR_PRIOR_WEIGHT * np.minimum(rate, 1.0)
    w = predictor_module.PREDICTOR_PRIOR_WEIGHT
    self.Q[rows] = (self.hits[base0] + prior) / (self.trials[base0] + w)


def qfree():
    numpy_path()
    P._count_use, P._refresh = _count_use_qfree, _refresh_qfree


# ---- hinted background copies: keys the hint ranks top-k may run `hinted` copies further ------
def hinted_background(hinted_slack):
    from hybridmoe.experts.plan.planner import Planner

    old = Planner._background

    def _background(self, layer, now, plan):
        if self.policy.name != "value":  # the others keep their rule
            return old(self, layer, now, plan)
        base = plan.makespan + (self.gap if self.policy.copies_in_gap else 0.0)
        t = self.cost.t_copy()
        end = base - self.policy.background_slack * t
        end_hinted = base - hinted_slack * t
        router = self.predictor.router
        if self.copy_free > now and self.copy_free >= max(end, end_hinted):
            return
        protect = self.protected(now, plan)
        for key in self.policy.background(layer, now, plan):
            top = router[self.ordinal[key[0]], key[1]] == 3
            if self.copy_free > now and self.copy_free >= (end_hinted if top else end):
                if self.copy_free >= max(end, end_hinted):
                    break
                continue
            if key in self.cache or key in protect:
                continue
            ok, victim = self.policy.make_room(key, protect, now, self.cache.free_count())
            if not ok or not self.policy.worth(key, victim, now):
                continue
            self._issue(key[0], key[1], ("evict", victim), now, plan.prefetches)
            protect.add(key)
            self._prefetched.add(key)
            self.stats.prefetches_issued += 1

    Planner._background = _background


def main(args):
    opts = dict(a.split("=") for a in args if "=" in a)
    if opts.get("numpy") or opts.get("qfree"):
        numpy_path()
    if opts.get("qfree"):
        qfree()
    if "slack" in opts:
        ValuePolicy.background_slack = float(opts["slack"])
    if "hinted" in opts:
        hinted_background(float(opts["hinted"]))
    if "cand" in opts:
        tuning.VALUE_CANDIDATES_PER_LAYER = int(opts["cand"])
    cost = get_profile("rtx4090-ddr5").for_expert(DEMO.experts, "q4")
    ratios = {False: [], True: []}
    for name in HELD if "--held" in args else TUNING:
        lines = read_trace(f"docs/traces/{name}.jsonl")
        for budget in ("0.1", "0.25"):
            out = {}
            for hints in (False, True):
                for policy in ("hybrimoe", "value"):
                    cfg = SimConfig(policy=policy, budget=budget, router_hints=hints)
                    out[policy, hints] = simulate(lines, DEMO, cost, cfg)
            for hints in (False, True):
                v, h = out["value", hints], out["hybrimoe", hints]
                ratios[hints].append(v.tokens_per_s / h.tokens_per_s)
                print(
                    f"{name} {budget} hints={hints:d}: value {v.tokens_per_s:.2f} tok/s hit "
                    f"{v.hit_rate:.3f} recall {v.predictor_recall:.3f} prefetch "
                    f"{v.prefetches_per_token:.1f}/{v.prefetch_precision:.2f} | hybrimoe "
                    f"{h.tokens_per_s:.2f} hit {h.hit_rate:.3f} | value/hybrimoe "
                    f"{v.tokens_per_s / h.tokens_per_s:.4f}",
                    flush=True,
                )
    for hints, r in ratios.items():
        gm = math.exp(sum(map(math.log, r)) / len(r))
        print(f"geometric mean value/hybrimoe, hints={hints:d}: {gm:.4f}")


if __name__ == "__main__":
    main(sys.argv[1:])
