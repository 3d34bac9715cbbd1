"""Next-visit prediction from expert ids alone (no router hint), judged offline: for every token
of a trace's second half and every MoE layer, the top-k of each scorer against the experts the
layer used (batch 1: precision = recall). Everything is learnt online from the tokens before
(the first half, then the second half as it goes), as the planner's predictor learns.

    python docs/notes/2026-12-06-value-policy-4/predict.py TRACE [TRACE...]
"""

import sys

import numpy as np

from hybridmoe.experts.plan.trace_format import read_trace

WINDOW = 128
PRIOR = 2.0


def sets_of(path):
    lines = read_trace(path)
    return [[np.array(sorted(ids)) for ids in line.layers] for line in lines]


def study(path, E=None):
    toks = sets_of(path)
    T, L = len(toks), len(toks[0])
    E = E or 1 + max(int(s.max()) for t in toks for s in t)
    k = len(toks[0][0])
    keep = 1 - 1 / WINDOW
    cnt = np.zeros((L, E))
    w = np.zeros(L)
    last = np.full((L, E), -(10**6))
    co1 = np.zeros((L, E, E))  # co1[li, a, b]: a at layer li, b at layer li+1, same token
    n1 = np.zeros((L, E))
    co2 = np.zeros((L, E, E))
    n2 = np.zeros((L, E))
    coT = np.zeros((L, E, E))  # a at layer li token t-1, b at layer li token t
    nT = np.zeros((L, E))
    keep4 = 1 - 1 / (4 * WINDOW)
    names = [
        "freq",
        "last",
        "freq+last",
        "cross1 max",
        "cross1 NB",
        "cross1 NB+last",
        "cross1+2 NB",
        "cross1+2 NB+last",
        "prevtok NB",
        "all NB",
        "current-like",
        "NB/4+last",
        "NB/2+last",
        "NB/|S|+last",
        "max+last",
        "logit",
    ]
    wlog = np.zeros(7)
    hits = {n: 0 for n in names}
    total = 0
    start = T // 2
    for t in range(T):
        for li in range(L):
            used = toks[t][li]
            if t >= start:
                f = cnt[li] / max(w[li], 1)
                lf = np.log(np.maximum(f, 1e-4))
                lastb = (last[li] == t - 1).astype(float)

                def cond(co, n, src, f=f):
                    return (co[src] + PRIOR * f) / (n[src][:, None] + PRIOR)

                sc = {}
                sc["freq"] = f
                sc["last"] = lastb + 1e-6 * f
                sc["freq+last"] = f + lastb
                if li >= 1:
                    c1 = cond(co1[li - 1], n1[li - 1], toks[t][li - 1])
                    sc["cross1 max"] = c1.max(0)
                    nb1 = np.log(np.maximum(c1, 1e-6)).sum(0) - len(c1) * lf
                else:
                    sc["cross1 max"] = f
                    nb1 = 0
                nb2 = 0
                if li >= 2:
                    c2 = cond(co2[li - 2], n2[li - 2], toks[t][li - 2])
                    nb2 = np.log(np.maximum(c2, 1e-6)).sum(0) - len(c2) * lf
                nbt = 0
                if t >= 1:
                    cT = cond(coT[li], nT[li], toks[t - 1][li])
                    nbt = np.log(np.maximum(cT, 1e-6)).sum(0) - len(cT) * lf
                sc["cross1 NB"] = lf + nb1
                sc["cross1 NB+last"] = lf + nb1 + 2 * lastb
                sc["cross1+2 NB"] = lf + nb1 + nb2
                sc["cross1+2 NB+last"] = lf + nb1 + nb2 + 2 * lastb
                sc["prevtok NB"] = lf + nbt
                sc["all NB"] = lf + nb1 + nb2 + nbt
                sc["current-like"] = np.maximum(sc["cross1 max"], 0) + 0.5 * lastb
                sc["NB/4+last"] = lf + nb1 / 4 + 2 * lastb
                sc["NB/2+last"] = lf + nb1 / 2 + 2 * lastb
                sc["NB/|S|+last"] = lf + nb1 / max(1, len(toks[t][li - 1])) + 2 * lastb
                m1 = sc["cross1 max"]
                sc["max+last"] = np.log(np.maximum(m1, 1e-4)) + 2 * lastb
                age = np.minimum(t - last[li], 64)
                X = np.stack(
                    [
                        np.ones(E),
                        lf,
                        nb1 + 0 * lf,
                        nb2 + 0 * lf,
                        lastb,
                        np.log(age),
                        np.log(np.maximum(m1, 1e-4)),
                    ],
                    1,
                )
                sc["logit"] = X @ wlog
                for n in names:
                    top = np.argsort(-sc[n], kind="stable")[:k]
                    hits[n] += len(np.intersect1d(top, used))
                total += len(used)
            if True:
                # online logistic regression (SGD), every visit, from the first token
                f = cnt[li] / max(w[li], 1)
                lf = np.log(np.maximum(f, 1e-4))
                lastb = (last[li] == t - 1).astype(float)
                nb1 = nb2 = 0 * lf
                m1 = f
                if li >= 1 and n1[li - 1].any():
                    src = toks[t][li - 1]
                    c1 = (co1[li - 1][src] + PRIOR * f) / (n1[li - 1][src][:, None] + PRIOR)
                    nb1 = np.log(np.maximum(c1, 1e-6)).sum(0) - len(c1) * lf
                    m1 = c1.max(0)
                if li >= 2 and n2[li - 2].any():
                    src = toks[t][li - 2]
                    c2 = (co2[li - 2][src] + PRIOR * f) / (n2[li - 2][src][:, None] + PRIOR)
                    nb2 = np.log(np.maximum(c2, 1e-6)).sum(0) - len(c2) * lf
                age = np.minimum(t - last[li], 64)
                X = np.stack(
                    [np.ones(E), lf, nb1, nb2, lastb, np.log(age), np.log(np.maximum(m1, 1e-4))], 1
                )
                y = np.zeros(E)
                y[used] = 1
                pr = 1 / (1 + np.exp(-np.clip(X @ wlog, -30, 30)))
                wlog += 0.01 * X.T @ (y - pr) / E
            # learn
            cnt[li] *= keep
            w[li] = w[li] * keep + 1
            cnt[li, used] += 1
            last[li, used] = t
            if li >= 1:
                src = toks[t][li - 1]
                co1[li - 1] *= keep4
                n1[li - 1] *= keep4
                co1[li - 1][np.ix_(src, used)] += 1
                n1[li - 1][src] += 1
            if li >= 2:
                src = toks[t][li - 2]
                co2[li - 2] *= keep4
                n2[li - 2] *= keep4
                co2[li - 2][np.ix_(src, used)] += 1
                n2[li - 2][src] += 1
            if t >= 1:
                src = toks[t - 1][li]
                coT[li] *= keep4
                nT[li] *= keep4
                coT[li][np.ix_(src, used)] += 1
                nT[li][src] += 1
    print(path.rsplit("/", 1)[-1], f"E={E} k={k} L={L} T={T}")
    for n in names:
        print(f"  {n:18s} {hits[n] / total:.3f}")


if __name__ == "__main__":
    for p in sys.argv[1:]:
        study(p)
