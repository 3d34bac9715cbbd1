"""How long one routed expert takes on the CPU, on the GPU, and to copy over PCIe.

The formulas are those of shared/DESIGN.md ("cost model"):

    t_cpu(n) = max(bytes / bw_cpu, flops(n) / f_cpu) + c_cpu
    t_gpu(n) = max(bytes / bw_gpu, flops(n) / f_gpu) + c_gpu
    t_copy   = bytes / bw_pcie + c_copy
    t_act(n) = 2 * (hidden * n * act_bytes / bw_pcie + c_act)   # activations GPU->CPU and back

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
        if n == 1 and self.bw_cpu_one:
            c = self.c_cpu if self.c_cpu_one is None else self.c_cpu_one
            return self.expert_bytes / self.bw_cpu_one + c
        return max(self.expert_bytes / self.bw_cpu, n * self.flops_per_token / self.f_cpu) + self.c_cpu

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

    def without_gpu(self) -> "CostModel":
        return replace(self, bw_gpu=0.0, f_gpu=0.0, c_gpu=0.0, bw_pcie=0.0, c_copy=0.0, c_act=0.0)

    # ---- persistence -------------------------------------------------------------------------
    def to_json(self) -> dict:
        return {"format": "hybridmoe-cost-profile", "version": 1, **asdict(self)}

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=2) + "\n")

    @classmethod
    def from_json(cls, data: dict) -> "CostModel":
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


def _fit_roofline(b: np.ndarray, fl: np.ndarray, t: np.ndarray, one: np.ndarray | None = None,
                  weight: np.ndarray | None = None) -> tuple[float, float, float, float, float]:
    """Least squares for t = max(b/bw, fl/f) + c, in relative error (times span decades).

    Rows where `one` is set (single-token CPU calls) follow t = b/bw_one + c_one instead: one token
    runs a matrix-vector kernel that streams weights faster than the batched (GEMM) kernel and
    starts ~30 us sooner (measured: 256x64 fp32, 21 us at n = 1, 53 us at n = 2). One fit over every
    shape: the constants are set by the small experts, where bytes do not hide them, and the
    bandwidths by the large ones. Given r = bw/f the model is linear in (1/bw, c, 1/bw_one, c_one),
    so r is found by a grid search and the rest by non-negative least squares.
    Returns (bw, f, c, bw_one, c_one); bw_one = c_one = 0 without single-token rows.
    """
    one = np.zeros_like(t, dtype=bool) if one is None else one
    many = ~one
    w = (1.0 if weight is None else np.sqrt(weight)) / t  # squared in the sum: weight per sample

    def solve(r: float) -> tuple[float, float, np.ndarray]:
        x = np.where(many, np.maximum(b, fl * r), 0.0)
        cols = [x, many * 1.0] + ([np.where(one, b, 0.0), one * 1.0] if one.any() else [])
        a = np.stack(cols, axis=1)
        coef = _nnls(a * w[:, None], t * w)
        return float(np.sum((a @ coef - t) ** 2 * w**2)), r, coef

    if not many.any():
        best = solve(1.0)
    else:  # a coarse grid over eight decades, then a fine one around its best (0.3% steps)
        best = min((solve(r) for r in np.logspace(-4, 4, 161)), key=lambda e: e[0])
        best = min((solve(r) for r in best[1] * np.logspace(-0.05, 0.05, 41)), key=lambda e: e[0])
    coef = best[2]
    if (many.any() and coef[0] <= 0) or (one.any() and coef[2] <= 0):
        raise UserError("the calibration samples do not grow with the expert size; measure again with more tokens")
    bw = 1.0 / coef[0] if many.any() else 1.0 / coef[2]  # only single-token rows: one bandwidth for all
    bw_one, c_one = (1.0 / coef[2], float(coef[3])) if one.any() else (0.0, 0.0)
    return bw, bw / best[1], float(coef[1]) if many.any() else c_one, bw_one, c_one


def _nnls(a: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares a @ coef = y with every coefficient >= 0 (seconds per byte, seconds per call):
    the best unconstrained solution over each subset of free columns, the others held at 0. Exact,
    and cheap for the four columns of the cost model."""
    k = a.shape[1]
    best, best_err = np.zeros(k), float(np.sum(y**2))
    for mask in range(1, 2**k):
        free = [j for j in range(k) if mask >> j & 1]
        sol, *_ = np.linalg.lstsq(a[:, free], y, rcond=None)
        if (sol < 0).any():
            continue
        coef = np.zeros(k)
        coef[free] = sol
        err = float(np.sum((a @ coef - y) ** 2))
        if err < best_err:
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
        one_token: bool = True) -> CostModel:
    """Turn measured samples into a CostModel. Samples without bytes/flops take them from `shape`.

    With `one_token`, single-token CPU samples get their own bandwidth (`bw_cpu_one`) in the same fit.
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
        return b, fl, np.array([s.seconds for s in rows], dtype=float), np.array([s.weight for s in rows])

    cpu = arrays("cpu")
    if cpu is None:
        raise UserError("calibration has no CPU samples; every machine needs them, measure the CPU first")
    ones = np.array([s.n_tokens == 1 for s in samples if s.kind == "cpu"])
    bw_cpu, f_cpu, c_cpu, bw_one, c_one = _fit_roofline(*cpu[:3], one=ones if one_token else None, weight=cpu[3])
    model = CostModel(bw_cpu=bw_cpu, f_cpu=f_cpu, c_cpu=c_cpu, bw_cpu_one=bw_one, c_cpu_one=c_one, name=name)
    gpu, copy = arrays("gpu"), arrays("copy")
    if gpu is not None and copy is not None:
        model.bw_gpu, model.f_gpu, model.c_gpu, _, _ = _fit_roofline(*gpu[:3], weight=gpu[3])
        model.bw_pcie, model.c_copy = _fit_linear(copy[0], copy[2])
    return model.for_expert(shape, quant) if shape else model
