"""Scratch harness of docs/notes/2026-12-06-value-policy-4.md: value (and hybrimoe) tok/s as
`bench policy-goals` runs them (rtx4090-ddr5, Q4, planning charged, fair protocol), with each
idea as a patch. From the repository root:

    H=docs/notes/2026-12-06-value-policy-4/harness.py
    python $H base [--held|--syn|--olmoe] [--no-hints] [--hyb]   # value as it is (--hyb: hybrimoe)
    python $H logit              # p_next from an online logistic regression (lr=X, h1, norouter)
    python $H gate=next          # cost-aware gate on background copies (gate=stay: over the stay)
    python $H logit gate=next    # both
    python $H bounds             # belady and the oracle, free and charged value's planning

Default traces: the two demo tuning traces; --held the four held-out demo traces; --syn the two
synthetic OLMoE-shaped tuning traces; --olmoe the OLMoE trace.
"""

import math
import sys
import time

import numpy as np

from hybridmoe.bench.policy_goals import OLMOE, demo_layout
from hybridmoe.experts.plan.profiles import get_profile
from hybridmoe.experts.plan.trace_format import read_trace
from hybridmoe.sim.shapes import get_shape
from hybridmoe.sim.simulator import SimConfig, simulate

TUNING = ["demo-chat-travel_400tok", "demo-smollm2-e16k8_299tok"]
HELD = [
    "demo-code-csv_400tok",
    "demo-longctx-architecture_300tok",
    "demo-serve-4concurrent",
    "demo-smollm2-e16k8_63tok",
]
SYN = [
    "tokens=300,skew=1.0,locality=0.4,drift=60,seed=1,cross=0.5",
    "tokens=300,skew=0.7,locality=0.5,seed=2",
]


def traces(argv):
    if "--syn" in argv:
        return ["syn:" + c for c in SYN]
    if "--olmoe" in argv:
        return [OLMOE]
    if "--held" in argv:
        return [f"docs/traces/{t}.jsonl" for t in HELD]
    return [f"docs/traces/{t}.jsonl" for t in TUNING]


def synthetic(spec):
    from hybridmoe.sim.synthetic import SynthConfig, generate

    kw = {}
    for part in spec.split(","):
        k, v = part.split("=")
        kw[k] = float(v) if "." in v else int(v)
    return generate(SynthConfig(**kw))


def run_one(trace, budget, policy, hints=True):
    if trace.startswith("syn:"):
        shape, lines = get_shape("olmoe-1b-7b"), synthetic(trace[4:])
    else:
        path, _, shape_name = trace.partition("=")
        shape = get_shape(shape_name) if shape_name else demo_layout("olmoe-1b-7b")
        lines = read_trace(path)
    cost = get_profile("rtx4090-ddr5").for_expert(shape.experts, "q4")
    return simulate(lines, shape, cost, SimConfig(policy=policy, budget=budget, router_hints=hints))


def main(argv):
    hints = "--no-hints" not in argv
    pols = ["value"] + (["hybrimoe"] if "--hyb" in argv else [])
    logs = []
    for t in traces(argv):
        for b in ("0.1", "0.25"):
            t0 = time.time()
            row = {}
            for p in pols:
                r = run_one(t, b, p, hints)
                row[p] = r
            v = row["value"]
            msg = (
                f"{t.rsplit('/', 1)[-1][:32]:32s} {b:5s} value {v.tokens_per_s:7.2f} "
                f"hit {v.hit_rate:.3f} prec {v.predictor_precision:.3f} "
                f"rec {v.predictor_recall:.3f}"
                f" copies {v.copies_per_token:.1f} bg {v.prefetches_per_token:.1f}/"
                f"{v.prefetch_precision:.2f}"
            )
            if "hybrimoe" in row:
                msg += f" hyb {row['hybrimoe'].tokens_per_s:7.2f}"
            logs.append(math.log(v.tokens_per_s))
            print(msg, f"({time.time() - t0:.0f}s)", flush=True)
    print("geomean value tok/s", math.exp(sum(logs) / len(logs)))


# ---- patches -------------------------------------------------------------------------------
def numpy_only():
    """The predictor's and value's numpy path (the reference; the same decisions as the C)."""
    from hybridmoe.experts.plan import predictor as pm

    init = pm.Predictor.__init__

    def __init__(self, *a, native=True, **k):
        init(self, *a, native=False, **k)

    pm.Predictor.__init__ = __init__


def logistic(lr=0.01, router=True, horizons=(1, 2), keep_table=False):
    """p_next of a layer with a cross-layer score (its previous layer or the one before ran in this
    step) from an online logistic regression instead of the banded calibration cells: features
    [1, log frequency, the naive-Bayes log-likelihood ratio of the token's experts at layer j - h
    (and at j - h - 1 where counted), used at the last visit, log age, log of the max conditional
    (today's cross-layer score), the router bucket one-hot]; one weight vector per horizon h,
    trained by SGD at each visit of a row it predicted (lr / E per visit). p_base is unchanged."""
    from hybridmoe.experts.plan import predictor as pm
    from hybridmoe.tuning import CROSS_LAYER_PRIOR

    P = pm.Predictor
    old_init, old_count, old_look, old_refresh = P.__init__, P.count_use, P.look_ahead, P._refresh
    NF = 10

    def __init__(self, *a, **k):
        old_init(self, *a, **k)
        L, E = len(self.layers), self.num_experts
        self._w = {h: np.zeros(NF) for h in (1, 2)}
        self._nb = np.zeros((L, 2, E))  # [j, (nb of j-h, nb of j-h-1), E]
        self._mx = np.ones((L, E))
        self._X = {}  # row -> (h, X [E, NF]) as last predicted

    def _cond(self, h, i, j):
        cross = self.cross
        src = cross.sets.get(i)
        f = np.minimum(self._rates(j), 1.0)
        if src is None or not len(src):
            return None
        co, n = cross.counts(h, i)
        return (co[src] + CROSS_LAYER_PRIOR * f) / (n[src][:, None] + CROSS_LAYER_PRIOR)

    def look_ahead(self, layer):
        old_look(self, layer)
        i = self.ordinal[layer]
        if self.cross is None or self._used[0] != i:
            return
        for h in horizons:
            j = i + h
            if j >= len(self.layers):
                continue
            f = np.minimum(self._rates(j), 1.0)
            lf = np.log(np.maximum(f, 1e-4))
            c = _cond(self, h, i, j)
            self._nb[j, 0] = np.log(np.maximum(c, 1e-6)).sum(0) - len(c) * lf
            self._mx[j] = c.max(0)
            self._nb[j, 1] = 0.0
            if h == 1 and i - 1 >= 0 and 2 in self.cross.horizons:
                c2 = _cond(self, 2, i - 1, j)
                if c2 is not None:
                    self._nb[j, 1] = np.log(np.maximum(c2, 1e-6)).sum(0) - len(c2) * lf
            self._stale(j)

    def count_use(self, layer, experts):
        i = self.ordinal[layer]
        self._row(i)
        if i in self.lift and i in self._X:
            h, X = self._X.pop(i)
            y = np.zeros(self.num_experts)
            y[list(experts)] = 1.0
            p = 1.0 / (1.0 + np.exp(-np.clip(X @ self._w[h], -30, 30)))
            self._w[h] += lr * X.T @ (y - p) / self.num_experts
        self._X.pop(i, None)
        old_count(self, layer, experts)

    def _refresh(self, rows):
        old_refresh(self, rows)
        for j in rows:
            h = self.lift.get(j)
            if h is None or h not in horizons:
                self._X.pop(j, None)
                continue
            f = self._rates(j)
            lf = np.log(np.maximum(np.minimum(f, 1.0), 1e-4))
            age = np.minimum(self.visits[j] - self.last_use[j] + 1, 64)
            r = self.router[j]
            X = np.stack(
                [
                    np.ones_like(lf),
                    lf,
                    self._nb[j, 0],
                    self._nb[j, 1],
                    (age == 1).astype(float),
                    np.log(age),
                    np.log(np.maximum(self._mx[j], 1e-4)),
                    (r == 1).astype(float) * router,
                    (r == 2).astype(float) * router,
                    (r == 3).astype(float) * router,
                ],
                1,
            )
            self._X[j] = (h, X)
            if not keep_table:
                self.P[j] = 1.0 / (1.0 + np.exp(-np.clip(X @ self._w[h], -30, 30)))

    P.__init__, P.count_use, P.look_ahead, P._refresh = __init__, count_use, look_ahead, _refresh


def gate(kind="next", hinted_too=False):
    """Cost-aware background admission: a background copy only if what it is worth beats the CPU
    time it takes through shared DRAM at the stream's current load: its overlap with this layer's
    CPU experts (the stream's backlog decides when it starts) x (1 - 1/slowdown). Worth: `next`,
    (p_next(key) - p_next(victim)) x the seconds a hit saves; `stay`, the hits expected over its
    stay, saving x D_victim / D_key (capped at 8) minus the victim's p_next x saving. Keys the
    look-ahead hint ranks top-k pass unless `hinted_too`."""
    from hybridmoe.experts.plan import planner as pm
    from hybridmoe.experts.plan.policies import ValuePolicy
    from hybridmoe.experts.plan.predictor import ROUTER_TOP

    Pl, V = pm.Planner, ValuePolicy
    old_bg, old_worth = Pl._background, V.worth
    COUNT = {"asked": 0, "gated": 0}

    def _background(self, layer, now, plan):
        self._gate_plan = plan
        return old_bg(self, layer, now, plan)

    def worth(self, key, victim, now):
        if not old_worth(self, key, victim, now):
            return False
        pl = self.planner
        plan = getattr(pl, "_gate_plan", None)
        if plan is None:
            return True
        pr = self.predictor
        i = pr.ordinal[key[0]]
        if not hinted_too and pr.router[i, key[1]] == ROUTER_TOP:
            return True
        COUNT["asked"] += 1
        tm = pl.times
        start = max(now, pl.copy_free)
        overlap = max(0.0, min(start + tm.copy, plan.cpu_finish) - start)
        cost = overlap * (1.0 - 1.0 / tm.slowdown)
        saving = max(0.0, tm.cpu(1) - tm.gpu(1))
        pv = pr.p_next(victim) if victim is not None else 0.0
        if kind == "next":
            value = (pr.p_next(key) - pv) * saving
        else:
            dk = self.distance(key, now)
            dv = self.distance(victim, now) if victim is not None else 8 * dk
            value = (min(8.0, dv / max(dk, 1e-3)) - pv) * saving
        if value >= cost:
            return True
        COUNT["gated"] += 1
        return False

    Pl._background, V.worth = _background, worth
    return COUNT


def bounds():
    from hybridmoe import tuning

    for t in [OLMOE] + [f"docs/traces/{t}.jsonl" for t in TUNING]:
        for b in ("0.1", "0.25"):
            out = {
                p: run_one(t, b, p).tokens_per_s for p in ("hybrimoe", "value", "belady", "oracle")
            }
            for p in ("belady", "oracle"):
                tuning.PLANNER_US[p] = tuning.PLANNER_US["value"]
                out[p + "@value's planning"] = run_one(t, b, p).tokens_per_s
                del tuning.PLANNER_US[p]
            h = out["hybrimoe"]
            cells = " ".join(f"{k} {v:.1f} ({v / h:.3f})" for k, v in out.items())
            print(t.rsplit("/", 1)[-1][:28], b, cells, flush=True)


if __name__ == "__main__":
    args = sys.argv[1:]
    if "bounds" in args:
        bounds()
        sys.exit()
    if "logit" in args or any(a.startswith("lr=") for a in args):
        numpy_only()
        kw = {}
        for a in args:
            if a.startswith("lr="):
                kw["lr"] = float(a[3:])
            if a == "norouter":
                kw["router"] = False
            if a == "h1":
                kw["horizons"] = (1,)
        logistic(**kw)
    count = None
    for a in args:
        if a.startswith("gate="):
            count = gate(a[5:], "hinted" in args)
    main(args)
    if count:
        print(count)
