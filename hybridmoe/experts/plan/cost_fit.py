"""Fitting the cost model's constants to measured calls (the samples `hybridmoe calibrate` takes).

CPU samples decide, by the Bayesian information criterion, where the row-by-row regime of few
tokens ends (`_fit_cpu`); each regime is then a small least-squares problem in relative error.
GPU samples fit the roofline's max, copies a line in the bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from hybridmoe.errors import UserError
from hybridmoe.experts.plan.cost_model import CostModel, quant_bytes
from hybridmoe.experts.plan.shape import ExpertShape
from hybridmoe.tuning import ROWS_UP_TO


@dataclass(frozen=True)
class Sample:
    """One measurement: `kind` is "cpu", "gpu", "copy" (host->device from pinned memory) or
    "copy_pageable" (from pageable memory); bytes/flops are of the expert measured."""

    kind: str
    n_tokens: int
    seconds: float
    bytes: float = 0.0
    flops: float = 0.0  # total flops of the call (all n tokens); 0 = derive from the geometry
    weight: float = 1.0  # its say in the fit: more for the shape the profile is for


def _fit_cpu(
    b: np.ndarray,
    fl: np.ndarray,
    n: np.ndarray,
    t: np.ndarray,
    w: np.ndarray,
    caches: tuple[float, ...],
) -> dict:
    """CostModel's CPU fields fitted to calls of `b` bytes, `fl` flops and `n` tokens taking `t` s.

    Each candidate end of the row-by-row regime (a measured token count up to ROWS_UP_TO) splits
    the samples in two, fitted apart (`_fit_split`). The end kept is the best by the Bayesian
    information criterion: a row regime with re-reads has more constants, and must improve the fit
    by more than their count's worth to keep them (on timings made by the generator of
    tests/test_cost_model_regimes.py with 3% noise, it found the true end 399 times in 400). The
    constants of each regime are set by the small experts, where bytes do not hide them, and the
    bandwidths by the large ones.
    """
    ends = (
        [1]
        if not (n == 1).any()
        else [2]
        + [int(v) for v in np.unique(n) if 2 < v <= ROWS_UP_TO and len(np.unique(n[n >= v])) >= 3]
    )
    best = None
    for end in ends:
        fields = _fit_split(b, fl, n, t, w, caches, end)
        if fields is None:
            continue
        m = CostModel(**fields)
        err = sum(
            (wi * (m.sized(bi, fi, ni).t_cpu(int(ni)) - ti)) ** 2
            for bi, fi, ni, ti, wi in zip(b, fl, n, t, w)
        )
        constants = (
            4 + 2 * (end > 1) + (len(m.cpu_caches) + 2) * (end > 2)
        )  # batched; first pass; re-reads
        bic = len(t) * math.log(max(err, 1e-300) / len(t)) + constants * math.log(len(t))
        if best is None or bic < best[1]:
            best = (fields, bic)
    if best is None:
        raise UserError(
            "the calibration samples do not grow with the expert size; measure again with more "
            "tokens"
        )
    return best[0]


def _fit_split(
    b: np.ndarray,
    fl: np.ndarray,
    n: np.ndarray,
    t: np.ndarray,
    w: np.ndarray,
    caches: tuple[float, ...],
    end: int,
) -> dict | None:
    """The rows regime (n < end, `_fit_rows`) and the batched one (`_fit_batched`) fitted apart;
    None when either shows no bandwidth (time does not grow with bytes)."""
    few = n < end
    fields = {"cpu_gemm_from": end}
    for part, fitter in (
        (~few, lambda m: _fit_batched(b[m], fl[m], t[m], w[m], np.linspace(0.0, 1.0, 11))),
        (few, lambda m: _fit_rows(b[m], n[m], t[m], w[m], caches)),
    ):
        if part.any():
            more = fitter(part)
            if more is None:
                return None
            fields.update(more)
    if "bw_cpu" not in fields:  # single-token samples only: one bandwidth for every n
        fields.update(
            bw_cpu=fields["bw_cpu_one"], f_cpu=fields["bw_cpu_one"], c_cpu=fields["c_cpu_one"]
        )
    return fields


def _fit_batched(
    b: np.ndarray, fl: np.ndarray, t: np.ndarray, w: np.ndarray, overlaps: np.ndarray
) -> dict | None:
    """t = s + a - overlap * min(s, a) + c, s = b/bw, a = fl/f: least squares in relative error.

    Given r = bw/f and the overlap, t is linear in (1/bw, c): a grid over r (eight decades) and
    the overlaps, then finer grids around the best, each point solved in closed form.
    Returns {bw_cpu, f_cpu, c_cpu, cpu_overlap}; None when time does not grow with bytes."""

    def solve(rs: np.ndarray, overlap: float):
        s, a = b[None, :], fl[None, :] * rs[:, None]  # [R, samples] each, in bytes
        inv_bw, c, err = _line_fit(s + a - overlap * np.minimum(s, a), t, w)
        i = int(np.argmin(err))
        return err[i], rs[i], overlap, inv_bw[i], c[i]

    best = min((solve(np.logspace(-4, 4, 161), o) for o in overlaps), key=lambda e: e[0])
    step = overlaps[1] - overlaps[0] if len(overlaps) > 1 else 0.0
    near = np.clip(best[2] + np.linspace(-step, step, 21), overlaps[0], overlaps[-1])
    for span in (0.05, 0.002):  # +-12% in 0.25% steps, then +-0.5% in 0.01% steps
        best = min(
            (solve(best[1] * np.logspace(-span, span, 41), o) for o in np.unique(near)),
            key=lambda e: e[0],
        )
    err, r, overlap, inv_bw, c = best
    if inv_bw <= 0:
        return None
    fields = {
        "bw_cpu": 1.0 / inv_bw,
        "f_cpu": 1.0 / (inv_bw * r),
        "c_cpu": c,
        "cpu_overlap": round(overlap, 4),
    }
    return {k: float(v) for k, v in fields.items()}


def _line_fit(
    x: np.ndarray, t: np.ndarray, w: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For each row of x [R, samples]: the k, c >= 0 minimising sum((w * (k x + c - t))^2).
    Returns k, c and that error, each [R]."""
    u, v, y = x * w, w, t * w  # [R, S], [S], [S]
    uu, uv, vv = (u * u).sum(1), u @ v, float(v @ v)
    uy, vy = u @ y, float(v @ y)
    det = uu * vv - uv * uv
    with np.errstate(divide="ignore", invalid="ignore"):
        k = np.where(det > 0, (vv * uy - uv * vy) / det, 0.0)
        c = np.where(det > 0, (uu * vy - uv * uy) / det, vy / vv)
        k_alone = np.where(uu > 0, uy / uu, 0.0)
    k, c = np.where(c < 0, k_alone, k), np.maximum(c, 0.0)  # a negative constant is pinned at 0
    err = ((k[:, None] * u + c[:, None] * v - y) ** 2).sum(1)
    return k, c, err


def _fit_rows(
    b: np.ndarray, n: np.ndarray, t: np.ndarray, w: np.ndarray, caches: tuple[float, ...]
) -> dict | None:
    """t = b/bw_one + c_one + (n - 1) * (re-read of b + c_reread), by non-negative least squares.

    Each re-read comes from the innermost cache level that holds the whole expert, else from RAM,
    as CostModel.t_reread has it; the RAM re-reads get their own bandwidth (the first pass also
    carries the call's start-up). All of it is linear in the inverse bandwidths and the constants.
    Returns CostModel's fields; None when the first pass's time does not grow with the bytes."""
    extra = (n - 1).astype(float)
    bounds = [0.0, *sorted(caches)] if extra.any() else [0.0]  # one pass each: nothing is re-read
    rereads = [extra * b * ((b > lo) & (b <= hi)) for lo, hi in zip(bounds, bounds[1:])]
    rereads += [extra * b * (b > bounds[-1])] if extra.any() else []  # from RAM
    a = np.stack([b, np.ones_like(b), *rereads] + ([extra] if extra.any() else []), axis=1)
    coef = _nnls(a * w[:, None], t * w)
    if coef[0] <= 0:
        return None
    # Per level: not measured (no expert re-read from it) = 0; measured at no cost = 1 PB/s.
    bws = [float(1.0 / max(k, 1e-15)) if col.any() else 0.0 for k, col in zip(coef[2:-1], rereads)]
    fields = {
        "bw_cpu_one": float(1.0 / coef[0]),
        "c_cpu_one": float(coef[1]),
        "cpu_caches": [[float(cap), bw] for cap, bw in zip(bounds[1:], bws)],
        "bw_cpu_reread": bws[-1] if bws else 0.0,
        "c_cpu_reread": float(coef[-1]) if extra.any() else 0.0,
    }
    return fields


def _nnls(a: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares a @ coef = y with every coefficient >= 0 (seconds per byte, seconds per call):
    the best unconstrained solution over each subset of free columns, the others held at 0. Exact,
    and cheap for the few columns of the cost model. Larger subsets first, so that a tie (columns
    that one expert shape cannot tell apart) keeps every column's share, as plain least squares
    does."""
    k = a.shape[1]
    best, best_err = np.zeros(k), float(np.sum(y**2))
    tie = 1e-9 * best_err
    for mask in range(2**k - 1, 0, -1):
        free = [j for j in range(k) if mask >> j & 1]
        sol, *_ = np.linalg.lstsq(a[:, free], y, rcond=None)
        if (sol < 0).any():
            continue
        coef = np.zeros(k)
        coef[free] = sol
        err = float(np.sum((a @ coef - y) ** 2))
        if err < best_err - tie:
            best, best_err = coef, err
    return best


def _fit_linear(b: np.ndarray, t: np.ndarray) -> tuple[float, float]:
    """t = b/bw + c, least squares; returns (bw, c)."""
    a = np.stack([b, np.ones_like(b)], axis=1)
    (inv_bw, c), *_ = np.linalg.lstsq(a, t, rcond=None)
    if inv_bw <= 0:
        raise UserError(
            "copy times do not grow with the bytes copied; measure copies of several sizes"
        )
    return 1.0 / inv_bw, max(c, 0.0)


def fit(
    samples: list[Sample],
    shape: ExpertShape | None = None,
    quant: str = "bf16",
    name: str = "calibrated",
    caches: tuple[float, ...] = (),
) -> CostModel:
    """Turn measured samples into a CostModel. Samples without bytes/flops take them from `shape`.

    Single-token CPU samples get their own bandwidth (`bw_cpu_one`) in the same
    fit, and so do the few-token ones when they run row by row. `caches`: the capacities in bytes
    of the CPU's cache levels (experts/run/calibrate.py reads them), where re-read passes find
    weights.
    """
    if not samples:
        raise UserError(
            "no calibration samples were given; run `hybridmoe calibrate` to measure them"
        )

    def arrays(kind):
        rows = [s for s in samples if s.kind == kind]
        if not rows:
            return None
        params = shape.params_per_expert() if shape else 0
        b = np.array([s.bytes or params * quant_bytes(quant) for s in rows], dtype=float)
        fl = np.array([s.flops or 2.0 * params * s.n_tokens for s in rows], dtype=float)
        if not b.all():
            raise UserError(
                "calibration samples need their expert bytes, or pass the expert shape to fit()"
            )
        t = np.array([s.seconds for s in rows], dtype=float)
        w = (
            np.sqrt(np.array([s.weight for s in rows], dtype=float)) / t
        )  # squared in the sum: relative error
        return b, fl, np.array([s.n_tokens for s in rows]), t, w

    cpu = arrays("cpu")
    if cpu is None:
        raise UserError(
            "calibration has no CPU samples; every machine needs them, measure the CPU first"
        )
    model = CostModel(name=name, **_fit_cpu(*cpu, caches=caches))
    gpu, copy = arrays("gpu"), arrays("copy")
    if gpu is not None and copy is not None:
        b, fl, _, t, w = gpu
        g = _fit_batched(b, fl, t, w, overlaps=np.array([1.0]))  # t_gpu is the roofline's max
        if g is None:
            raise UserError(
                "the GPU calibration samples do not grow with the expert size; measure again"
            )
        model.bw_gpu, model.f_gpu, model.c_gpu = g["bw_cpu"], g["f_cpu"], g["c_cpu"]
        model.bw_pcie, model.c_copy = _fit_linear(copy[0], copy[3])
        model.copy_source = "pinned"
        pageable = arrays("copy_pageable")
        if pageable is not None:
            model.bw_pcie_pageable, model.c_copy_pageable = _fit_linear(pageable[0], pageable[3])
    return model.for_expert(shape, quant) if shape else model
