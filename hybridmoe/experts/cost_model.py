"""How long one routed expert takes on the CPU, on the GPU, and to copy over PCIe.

The formulas are those of shared/DESIGN.md ("cost model"):

    t_cpu(n) = max(bytes / bw_cpu, flops(n) / f_cpu) + c_cpu
    t_gpu(n) = max(bytes / bw_gpu, flops(n) / f_gpu) + c_gpu
    t_copy   = bytes / bw_pcie + c_copy
    t_act(n) = 2 * (hidden * n * act_bytes / bw_pcie + c_act)   # activations GPU->CPU and back

The CPU's kernels refine t_cpu (measured, fitted by `fit()`; named profiles keep the plain form):
below `cpu_gemm_from` tokens the weights are streamed once per token, the first pass from RAM and the
others from the caches (`t_rows`); from it on, streaming and arithmetic overlap only in part
(`cpu_overlap`, 1 = the max above, 0 = their sum).

A `CostModel` is the hardware constants plus the geometry of one expert (its bytes in the chosen
quantisation, its flops per token). Constants come from `fit()` over measured samples (the
calibration run, experts/calibrate.py) or from a named profile (experts/profiles.py); a profile is
saved and loaded as JSON.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np

from hybridmoe.errors import UserError
from hybridmoe.experts.store import ExpertShape

# Bytes per weight of each expert format. GGUF block formats carry a scale per block:
# Q8_0 = 34 bytes per 32 weights, Q4_K = 144 bytes per 256 weights (4.5 bits), Q6_K = 210 per 256.
QUANT_BYTES = {
    "fp32": 4.0,
    "bf16": 2.0,
    "fp16": 2.0,
    "fp8": 1.0,
    "int8": 1.0,
    "q8": 34 / 32,
    "q6": 210 / 256,
    "q5": 176 / 256,
    "q4": 144 / 256,
    "int4": 0.5,
}


def quant_bytes(quant: str) -> float:
    if quant not in QUANT_BYTES:
        raise UserError(f"unknown quantisation {quant!r}; use one of {', '.join(QUANT_BYTES)}")
    return QUANT_BYTES[quant]


# 2: the CPU's row-by-row regime, cache re-reads and overlap (cpu_gemm_from, cpu_caches, cpu_overlap).
PROFILE_VERSION = 2


@dataclass
class CostModel:
    """Hardware constants (bytes/s, flop/s, s) plus the geometry of the expert being costed."""

    bw_cpu: float  # effective bytes/s one expert streams from RAM with all CPU threads
    f_cpu: float  # flop/s of the CPU expert kernel
    c_cpu: float  # fixed seconds per CPU expert call (dispatch, thread wake-up)
    bw_gpu: float = 0.0  # 0 = no GPU
    f_gpu: float = 0.0
    c_gpu: float = 0.0
    bw_pcie: float = 0.0
    c_copy: float = 0.0
    c_act: float = 0.0  # fixed seconds per activation transfer (one direction)
    name: str = ""
    # Effective CPU bandwidth per quantisation when it differs from bw_cpu (dequantisation costs).
    bw_cpu_by_quant: dict[str, float] = field(default_factory=dict)
    # One token runs a matrix-vector kernel that streams weights faster than the batched (GEMM)
    # kernel does at small n (measured: 1536x640 fp32, 1 thread: 0.69 ms at n=1, 1.1-1.6 ms at
    # n=2..12); 0 = no separate figure, bw_cpu for every n. Set by experts/calibrate.py.
    bw_cpu_one: float = 0.0
    # That kernel's fixed seconds per call (it skips the GEMM's set-up); used with bw_cpu_one.
    # None (profiles written before it existed) = c_cpu.
    c_cpu_one: float | None = None
    # Below this many tokens the CPU works row by row, one matrix-vector pass per token (measured,
    # MKL 2024.2 on AMD EPYC, fp32, 1 thread: 3072x1024 takes 1.9, 3.9, 5.4 ms at n = 1, 2, 3 and
    # 3.2 ms at n = 4; a 768x96 expert, which stays in L2, 61, 81, 88 and 83 us). 2 = only n = 1.
    cpu_gemm_from: int = 2
    # Where the passes after the first re-read the weights from: [capacity bytes, bytes/s] per cache
    # level, innermost first (bandwidth 0 = not measured, as the next level out), then RAM at
    # bw_cpu_reread (0 = bw_cpu_one); plus a fixed cost per pass.
    cpu_caches: list[list[float]] = field(default_factory=list)
    bw_cpu_reread: float = 0.0
    c_cpu_reread: float = 0.0
    # Share of the smaller of (streaming, arithmetic) that the batched kernel hides behind the larger:
    # 1 = the roofline's max, 0 = their sum (measured, fp32, 1 thread: 3072x1024 at n = 4..256 is
    # 2.51 ms + 0.170 ms per token within 2%, where the max is off by up to 30%).
    cpu_overlap: float = 1.0
    # Geometry, filled in by for_expert():
    expert_bytes: float = 0.0
    flops_per_token: float = 0.0
    hidden: int = 0
    act_bytes: float = 2.0  # activations travel as bf16
    quant: str = "bf16"

    @property
    def has_gpu(self) -> bool:
        return self.bw_gpu > 0 and self.bw_pcie > 0

    def for_expert(self, shape: ExpertShape, quant: str = "bf16") -> "CostModel":
        """A copy of these constants costing one expert of `shape` stored as `quant`."""
        params = shape.params_per_expert()
        bw = self.bw_cpu_by_quant.get(quant, self.bw_cpu)
        return replace(
            self,
            bw_cpu=bw,
            expert_bytes=params * quant_bytes(quant),
            flops_per_token=2.0 * params,  # one multiply-add per weight per token
            hidden=shape.hidden,
            quant=quant,
        )

    def t_cpu(self, n: int) -> float:
        if self.bw_cpu_one and n < self.cpu_gemm_from:
            return self.t_rows(n)
        stream, compute = self.expert_bytes / self.bw_cpu, n * self.flops_per_token / self.f_cpu
        return stream + compute - self.cpu_overlap * min(stream, compute) + self.c_cpu

    def t_rows(self, n: int) -> float:
        """n matrix-vector passes: the first streams the expert from RAM, the others re-read it."""
        c = self.c_cpu if self.c_cpu_one is None else self.c_cpu_one
        first = self.expert_bytes / self.bw_cpu_one + c
        return first + (n - 1) * (self.t_reread(self.expert_bytes) + self.c_cpu_reread) if n > 1 else first

    def t_reread(self, nbytes: float) -> float:
        """Seconds to stream `nbytes` again, from the innermost cache level that holds them all, else
        from RAM: a stream larger than a cache evicts itself before it comes round again (measured:
        3072x1024 fp32, 37.7 MB, re-reads at 21 GB/s next to 19 GB/s from RAM, with a 32 MB L3)."""
        fits = [bw for capacity, bw in self.cpu_caches if nbytes <= capacity]
        bw = next((bw for bw in fits if bw > 0), 0.0) or self.bw_cpu_reread or self.bw_cpu_one
        return nbytes / bw

    def t_gpu(self, n: int) -> float:
        if not self.has_gpu:
            return math.inf
        return max(self.expert_bytes / self.bw_gpu, n * self.flops_per_token / self.f_gpu) + self.c_gpu

    def t_copy(self) -> float:
        if not self.has_gpu:
            return math.inf
        return self.expert_bytes / self.bw_pcie + self.c_copy

    def t_act(self, n: int) -> float:
        """Round trip of n tokens' activations between GPU and CPU (0 without a GPU)."""
        if not self.has_gpu or n == 0:
            return 0.0
        return 2.0 * (self.hidden * n * self.act_bytes / self.bw_pcie + self.c_act)

    def hit_saving(self, n: int = 1) -> float:
        """Seconds a GPU hit saves over running the expert on the CPU."""
        return max(0.0, self.t_cpu(n) - self.t_gpu(n)) if self.has_gpu else 0.0

    def sized(self, expert_bytes: float, flops: float, n_tokens: int) -> "CostModel":
        """This model for one call of `n_tokens` on an expert of `expert_bytes` costing `flops`."""
        return replace(self, expert_bytes=expert_bytes, flops_per_token=flops / max(n_tokens, 1))

    def without_gpu(self) -> "CostModel":
        return replace(self, bw_gpu=0.0, f_gpu=0.0, c_gpu=0.0, bw_pcie=0.0, c_copy=0.0, c_act=0.0)

    # ---- persistence -------------------------------------------------------------------------
    def to_json(self) -> dict:
        return {"format": "hybridmoe-cost-profile", "version": PROFILE_VERSION, **asdict(self)}

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=2) + "\n")

    @classmethod
    def from_json(cls, data: dict) -> "CostModel":
        """Version 1 profiles load too: the fields they lack default to the formulas they were fitted for."""
        known = {f for f in cls.__dataclass_fields__}
        missing = [k for k in ("bw_cpu", "f_cpu", "c_cpu") if k not in data]
        if data.get("format") != "hybridmoe-cost-profile" or missing:
            raise UserError("this file is not a hybridmoe cost profile; write one with `hybridmoe calibrate --out FILE`")
        return cls(**{k: v for k, v in data.items() if k in known})

    @classmethod
    def load(cls, path: str | Path) -> "CostModel":
        try:
            data = json.loads(Path(path).read_text())
        except FileNotFoundError:
            raise UserError(f"cost profile {path} does not exist; write it with `hybridmoe calibrate --out {path}`")
        except json.JSONDecodeError:
            raise UserError(f"cost profile {path} is not valid JSON; write it again with `hybridmoe calibrate`")
        return cls.from_json(data)


# ---- fitting ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sample:
    """One measurement: `kind` is "cpu", "gpu" or "copy"; bytes/flops are of the expert measured."""

    kind: str
    n_tokens: int
    seconds: float
    bytes: float = 0.0
    flops: float = 0.0  # total flops of the call (all n tokens); 0 = derive from the geometry
    weight: float = 1.0  # its say in the fit: more for the shape the profile is for


# Token counts up to which the fit looks for the row-by-row regime's end: those kernels serve a few rows.
ROWS_UP_TO = 16


def _fit_cpu(b: np.ndarray, fl: np.ndarray, n: np.ndarray, t: np.ndarray, w: np.ndarray,
             caches: tuple[float, ...]) -> dict:
    """CostModel's CPU fields fitted to calls of `b` bytes, `fl` flops and `n` tokens taking `t` s.

    Each candidate end of the row-by-row regime (a measured token count up to ROWS_UP_TO) splits
    the samples in two, fitted apart (`_fit_split`). The end kept is the best by the Bayesian
    information criterion: a row regime with re-reads has more constants, and must improve the fit
    by more than their count's worth to keep them (on timings made by the generator of
    tests/test_cost_model_regimes.py with 3% noise, it found the true end 399 times in 400). The constants of each regime are
    set by the small experts, where bytes do not hide them, and the bandwidths by the large ones.
    """
    ends = [1] if not (n == 1).any() else \
        [2] + [int(v) for v in np.unique(n) if 2 < v <= ROWS_UP_TO and len(np.unique(n[n >= v])) >= 3]
    best = None
    for end in ends:
        fields = _fit_split(b, fl, n, t, w, caches, end)
        if fields is None:
            continue
        m = CostModel(**fields)
        err = sum((wi * (m.sized(bi, fi, ni).t_cpu(int(ni)) - ti)) ** 2
                  for bi, fi, ni, ti, wi in zip(b, fl, n, t, w))
        constants = 4 + 2 * (end > 1) + (len(m.cpu_caches) + 2) * (end > 2)  # batched; first pass; re-reads
        bic = len(t) * math.log(max(err, 1e-300) / len(t)) + constants * math.log(len(t))
        if best is None or bic < best[1]:
            best = (fields, bic)
    if best is None:
        raise UserError("the calibration samples do not grow with the expert size; measure again with more tokens")
    return best[0]


def _fit_split(b: np.ndarray, fl: np.ndarray, n: np.ndarray, t: np.ndarray, w: np.ndarray,
               caches: tuple[float, ...], end: int) -> dict | None:
    """The rows regime (n < end, `_fit_rows`) and the batched one (`_fit_batched`) fitted apart;
    None when either shows no bandwidth (time does not grow with bytes)."""
    few = n < end
    fields = {"cpu_gemm_from": end}
    for part, fitter in ((~few, lambda m: _fit_batched(b[m], fl[m], t[m], w[m], np.linspace(0.0, 1.0, 11))),
                         (few, lambda m: _fit_rows(b[m], n[m], t[m], w[m], caches))):
        if part.any():
            more = fitter(part)
            if more is None:
                return None
            fields.update(more)
    if "bw_cpu" not in fields:  # single-token samples only: one bandwidth for every n
        fields.update(bw_cpu=fields["bw_cpu_one"], f_cpu=fields["bw_cpu_one"], c_cpu=fields["c_cpu_one"])
    return fields


def _fit_batched(b: np.ndarray, fl: np.ndarray, t: np.ndarray, w: np.ndarray, overlaps: np.ndarray) -> dict | None:
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
        best = min((solve(best[1] * np.logspace(-span, span, 41), o) for o in np.unique(near)), key=lambda e: e[0])
    err, r, overlap, inv_bw, c = best
    if inv_bw <= 0:
        return None
    fields = {"bw_cpu": 1.0 / inv_bw, "f_cpu": 1.0 / (inv_bw * r), "c_cpu": c, "cpu_overlap": round(overlap, 4)}
    return {k: float(v) for k, v in fields.items()}


def _line_fit(x: np.ndarray, t: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
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


def _fit_rows(b: np.ndarray, n: np.ndarray, t: np.ndarray, w: np.ndarray, caches: tuple[float, ...]) -> dict | None:
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
    fields = {"bw_cpu_one": float(1.0 / coef[0]), "c_cpu_one": float(coef[1]),
              "cpu_caches": [[float(cap), bw] for cap, bw in zip(bounds[1:], bws)],
              "bw_cpu_reread": bws[-1] if bws else 0.0, "c_cpu_reread": float(coef[-1]) if extra.any() else 0.0}
    return fields


def _nnls(a: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares a @ coef = y with every coefficient >= 0 (seconds per byte, seconds per call):
    the best unconstrained solution over each subset of free columns, the others held at 0. Exact,
    and cheap for the few columns of the cost model. Larger subsets first, so that a tie (columns
    that one expert shape cannot tell apart) keeps every column's share, as plain least squares does."""
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
        raise UserError("copy times do not grow with the bytes copied; measure copies of several sizes")
    return 1.0 / inv_bw, max(c, 0.0)


def fit(samples: list[Sample], shape: ExpertShape | None = None, quant: str = "bf16", name: str = "calibrated",
        caches: tuple[float, ...] = ()) -> CostModel:
    """Turn measured samples into a CostModel. Samples without bytes/flops take them from `shape`.

    Single-token CPU samples get their own bandwidth (`bw_cpu_one`) in the same
    fit, and so do the few-token ones when they run row by row. `caches`: the capacities in bytes
    of the CPU's cache levels (experts/calibrate.py reads them), where re-read passes find weights.
    """
    if not samples:
        raise UserError("no calibration samples were given; run `hybridmoe calibrate` to measure them")

    def arrays(kind):
        rows = [s for s in samples if s.kind == kind]
        if not rows:
            return None
        params = shape.params_per_expert() if shape else 0
        b = np.array([s.bytes or params * quant_bytes(quant) for s in rows], dtype=float)
        fl = np.array([s.flops or 2.0 * params * s.n_tokens for s in rows], dtype=float)
        if not b.all():
            raise UserError("calibration samples need their expert bytes, or pass the expert shape to fit()")
        t = np.array([s.seconds for s in rows], dtype=float)
        w = np.sqrt(np.array([s.weight for s in rows], dtype=float)) / t  # squared in the sum: relative error
        return b, fl, np.array([s.n_tokens for s in rows]), t, w

    cpu = arrays("cpu")
    if cpu is None:
        raise UserError("calibration has no CPU samples; every machine needs them, measure the CPU first")
    model = CostModel(name=name, **_fit_cpu(*cpu, caches=caches))
    gpu, copy = arrays("gpu"), arrays("copy")
    if gpu is not None and copy is not None:
        b, fl, _, t, w = gpu
        g = _fit_batched(b, fl, t, w, overlaps=np.array([1.0]))  # t_gpu is the roofline's max
        if g is None:
            raise UserError("the GPU calibration samples do not grow with the expert size; measure again")
        model.bw_gpu, model.f_gpu, model.c_gpu = g["bw_cpu"], g["f_cpu"], g["c_cpu"]
        model.bw_pcie, model.c_copy = _fit_linear(copy[0], copy[3])
    return model.for_expert(shape, quant) if shape else model
