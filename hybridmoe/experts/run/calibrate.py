"""Measure this machine and fit the cost model's constants: the profile `hybridmoe calibrate`
writes.

CPU: one SwiGLU expert (the function the runtime runs) over n = 1..512 tokens, for expert shapes
from 0.2 MB to beyond the last-level cache, plus the model's own shape when the profile is for a
model, once per expert format asked for (dense in the compute dtype, or GGUF blocks on the integer
kernels: the profile keeps each format's CPU constants); with CUDA, the same on the GPU (rotating
over `tuning.GPU_ROTATE_BYTES` of experts, beyond the GPU's L2, so each is read from GPU memory as
a cache miss is) and host->device copies of several sizes from pinned memory (what the runtime's
staging ring copies from) and from pageable memory, both recorded in the profile (`copy_source`,
`bw_pcie_pageable`). Some
shapes and token counts fit the constants (experts/plan/cost_fit.py `fit`); the others are held out,
and the report gives predicted vs measured time on them, so the profile's error is known.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import torch
from tqdm import tqdm

from hybridmoe.errors import UserError
from hybridmoe.experts.plan.cost_fit import Sample, fit
from hybridmoe.experts.plan.cost_model import (
    CPU_FIELDS,
    FLOAT_BYTES,
    PROFILE_VERSION,
    CostModel,
    format_name,
    quant_bytes,
)
from hybridmoe.experts.plan.shape import expert_params
from hybridmoe.experts.run.ffn import expert_ffn
from hybridmoe.experts.run.store import DTYPE_FORMAT, ExpertWeights
from hybridmoe.files import write_atomic
from hybridmoe.native import quant as kernels
from hybridmoe.paths import user_cache_dir
from hybridmoe.quant.formats import FORMATS
from hybridmoe.quant.tensor import QTensor, for_kernels
from hybridmoe.tuning import GPU_ROTATE_BYTES, ROTATE_BYTES

log = logging.getLogger("hybridmoe")

# (hidden, intermediate), from 0.2 MB to 75 MB in fp32: the per-call constant c_cpu is only
# visible on small experts and the bandwidth only on large ones, beyond the last-level cache (a fit
# on large shapes alone predicted small experts 10x too slow: docs/notes/, "Calibration shapes").
# The held-out shapes lie between them: a small, a medium and a beyond-L3 one. The model's own
# shape joins the fit when known.
FIT_SHAPES = ((256, 64), (512, 128), (1024, 256), (2048, 768), (4096, 1536))
CHECK_SHAPES = ((768, 96), (1536, 640), (3072, 1024))
QUICK_CHECK_SHAPES = ((768, 96), (3072, 1024))
# 2 and 3 tokens on every shape: on MKL they run row by row, re-reading the weights per token
# (cost_model.py, cpu_gemm_from), and the fit finds where that regime ends from them.
FIT_TOKENS = (1, 2, 3, 4, 8, 16, 32, 64, 128, 256, 512)
CHECK_TOKENS = (1, 3, 12, 48, 192)
QUICK_FIT_TOKENS = (1, 2, 3, 4, 8, 32, 128)
QUICK_CHECK_TOKENS = (1, 3, 48)


@dataclass
class Check:
    kind: str
    hidden: int
    intermediate: int
    n_tokens: int
    measured: float
    predicted: float
    format: str = ""

    @property
    def error(self) -> float:
        return self.predicted / self.measured - 1.0


@dataclass
class Calibration:
    profile: CostModel
    dtype: torch.dtype
    samples: list[Sample] = field(default_factory=list)  # the fitted ones, every format's
    checks: list[Check] = field(default_factory=list)
    model: tuple[int, int] | None = (
        None  # the (hidden, intermediate) measured with the standard shapes
    )

    def max_cpu_error(self) -> float:
        errs = [abs(c.error) for c in self.checks if c.kind == "cpu"]
        return max(errs) if errs else 0.0

    def to_json(self) -> dict:
        return {
            **self.profile.to_json(),
            "dtype": str(self.dtype).removeprefix("torch."),
            "threads": torch.get_num_threads(),
            "model_expert_shape": list(self.model) if self.model else None,
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "checks": [{**c.__dict__, "error": round(c.error, 4)} for c in self.checks],
        }

    def save(self, path: str | Path) -> None:
        """Written whole or not at all: a killed run leaves no half profile."""
        write_atomic(path, json.dumps(self.to_json(), indent=2) + "\n")


# ---- measurements ------------------------------------------------------------------------------


def _experts(
    hidden: int, inter: int, dtype, device, total_bytes: float, fmt: str | None = None
) -> list[ExpertWeights]:
    """Enough random experts to pass `total_bytes` (at least 2): dense in `dtype`, or in the blocks
    of `fmt` (copies of one, the same bytes at other addresses), in the layout the store keeps
    them in (for_kernels)."""
    if fmt in FORMATS:
        first = _experts(hidden, inter, torch.float32, "cpu", 0)[0]
        one = ExpertWeights(
            *(for_kernels(QTensor.quantize(m, fmt)) for m in (first.gate_up, first.down))
        )
        count = max(2, int(total_bytes // one.nbytes()) + 1)
        clone = lambda m: QTensor(m.data.clone(), m.fmt, m.cols)  # noqa: E731
        return [one] + [ExpertWeights(clone(one.gate_up), clone(one.down)) for _ in range(count)]
    per = expert_params(hidden, inter) * dtype.itemsize
    count = max(2, int(total_bytes // per) + 1)
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(count):
        gate_up = (torch.randn(2 * inter, hidden, generator=g) * hidden**-0.5).to(dtype)  # [2I, H]
        down = (torch.randn(hidden, inter, generator=g) * inter**-0.5).to(dtype)  # [H, I]
        out.append(ExpertWeights(gate_up.to(device), down.to(device)))
    return out


class ColdExperts:
    """Copies of one expert handed out in turn, so that a copy comes back only after the others
    (ROTATE_BYTES in all) have passed through the caches: each call streams its weights from RAM,
    as a decode step does. (Restarting the rotation per measurement timed small experts hot.)"""

    def __init__(self, hidden: int, inter: int, dtype, fmt: str | None = None):
        self.copies = _experts(hidden, inter, dtype, "cpu", ROTATE_BYTES, fmt)
        self.cursor = 0
        self.dtype = dtype  # of the tokens

    def next(self) -> ExpertWeights:
        self.cursor = (self.cursor + 1) % len(self.copies)
        return self.copies[self.cursor]


@torch.inference_mode()
def time_cpu_expert(experts: ColdExperts, n: int, reps: int) -> float:
    """Seconds of one expert call on n tokens, each call on a cold copy.

    The minimum over `reps`, not the mean: other load on the machine only ever adds time (and a
    descheduled OpenMP thread stalls a whole call), so the fastest run is the machine's speed.
    With one thread, the process's CPU time is the clock: it equals wall time on an idle machine
    and does not count the time slices other processes take on a busy one.
    """
    clock = time.process_time if torch.get_num_threads() == 1 else time.perf_counter
    x = torch.randn(n, experts.copies[0].down.shape[0]).to(experts.dtype)  # [n, H]
    expert_ffn(x, experts.next())  # warm-up: thread pool, kernel selection for this n
    times = []
    for _ in range(reps):
        w = experts.next()
        t0 = clock()
        expert_ffn(x, w)
        times.append(clock() - t0)
    return min(times)


def gpu_experts(hidden: int, inter: int, dtype, total_bytes: float) -> list[ExpertWeights]:
    """Copies of one random expert in GPU memory, `total_bytes` of them at least (and 2)."""
    per = expert_params(hidden, inter) * dtype.itemsize
    g = torch.Generator(device="cuda").manual_seed(0)
    gate_up = torch.randn(2 * inter, hidden, generator=g, device="cuda").to(dtype)  # [2I, H]
    down = torch.randn(hidden, inter, generator=g, device="cuda").to(dtype)  # [H, I]
    count = max(2, int(total_bytes // per) + 1)
    return [ExpertWeights(gate_up.clone(), down.clone()) for _ in range(count)]


@torch.inference_mode()
def time_gpu_expert(experts: list[ExpertWeights], n: int, reps: int) -> float:
    """Median seconds of one expert on the GPU (CUDA events), cold: each call takes the next of
    `experts` in turn (more bytes than the GPU's L2), so its weights come from GPU memory."""
    x = torch.randn(n, experts[0].down.shape[0], device="cuda").to(experts[0].down.dtype)
    expert_ffn(x, experts[-1])  # warm-up: kernel selection for this n
    times = []
    for i in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        expert_ffn(x, experts[i % len(experts)])
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def time_copy(nbytes: int, reps: int, pinned: bool = True) -> float:
    """Median seconds of a host->device copy of `nbytes` on a side stream, from pinned memory or
    from pageable memory (where the driver stages it through its own pinned buffer)."""
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream()
    times = []
    for _ in range(reps + 1):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            start.record(stream)
            dst.copy_(src, non_blocking=True)
            end.record(stream)
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times[1:])


# ---- the calibration run -----------------------------------------------------------------------


def _shapes(
    quick: bool, model: tuple[int, int] | None, fmt: str | None = None
) -> tuple[tuple, tuple]:
    """(fit shapes, held-out shapes): the model's own expert shape joins the fit, never the
    check. For a block format, sizes are rounded up to whole blocks, and the model's shape joins
    only where its rows fill them (where they do not, its experts are not kept in the format)."""
    block = FORMATS[fmt].block if fmt in FORMATS else 1
    fit_shapes = _in_blocks(FIT_SHAPES, block)
    check_shapes = _in_blocks(QUICK_CHECK_SHAPES if quick else CHECK_SHAPES, block)
    if model and model[0] % block == 0 and model[1] % block == 0 and model not in fit_shapes:
        fit_shapes += (model,)
    return fit_shapes, tuple(s for s in check_shapes if s != model and s not in fit_shapes)


def _in_blocks(shapes: tuple, block: int) -> tuple:
    up = lambda v: -(-v // block) * block  # noqa: E731
    return tuple(dict.fromkeys((up(h), up(i)) for h, i in shapes))


def _jobs(
    quick: bool, cuda: bool, model: tuple[int, int] | None = None, fmt: str | None = None
) -> list[tuple]:
    """(kind, role, hidden, inter, n) for every measurement, fit ones first."""
    fit_n, check_n = (QUICK_FIT_TOKENS, QUICK_CHECK_TOKENS) if quick else (FIT_TOKENS, CHECK_TOKENS)
    fit_shapes, check_shapes = _shapes(quick, model, fmt)
    kinds = ("cpu", "gpu") if cuda else ("cpu",)
    jobs = []
    for kind in kinds:
        jobs += [(kind, "fit", h, i, n) for h, i in fit_shapes for n in fit_n]
        # The held-out token counts are fitted on the smallest and the last shape (the model's when
        # known): the check then tests other shapes only.
        extra = dict.fromkeys((fit_shapes[0], fit_shapes[-1]))
        jobs += [(kind, "fit", h, i, n) for h, i in extra for n in check_n if n not in fit_n]
        jobs += [(kind, "check", h, i, n) for h, i in check_shapes for n in check_n]
    if cuda:  # copies of the fit shapes' sizes and a few more, from pinned and pageable memory
        for kind in ("copy", "copy_pageable"):
            jobs += [(kind, "fit", h, i, 0) for h, i in fit_shapes + ((512, 256), (4096, 1536))]
            jobs += [(kind, "check", h, i, 0) for h, i in check_shapes]
    return jobs


def _sample(
    kind: str, hidden: int, inter: int, n: int, fmt: str, seconds: float, weight: float = 1.0
) -> Sample:
    """A measurement of an expert in format `fmt` (its bytes: the format's bytes per weight)."""
    params = expert_params(hidden, inter)
    return Sample(
        kind, n, seconds, bytes=params * quant_bytes(fmt), flops=2.0 * params * n, weight=weight
    )


def _weight(hidden: int, inter: int, model: tuple[int, int] | None) -> float:
    """The model's own shape counts as much as all the standard ones together: the profile is for
    it, and effective bandwidth varies by shape more than the roofline can follow
    (docs/notes/2026-11-24-measurements-in-code.md)."""
    return float(len(FIT_SHAPES)) if model == (hidden, inter) else 1.0


def _measure_cpu(jobs: list[tuple], dtype, rounds: int, bar, fmt: str) -> list[float]:
    """Seconds per CPU job, the minimum over `rounds` rounds that each visit every job once, so
    that a change of load on the machine affects fitted and held-out points alike."""
    pools = {}
    for _, _, h, i, _ in jobs:
        if (h, i) not in pools:
            pools[(h, i)] = ColdExperts(h, i, dtype, fmt)
    best = [float("inf")] * len(jobs)
    for _ in range(rounds):
        for j, (_, _, h, i, n) in enumerate(jobs):
            bar.set_postfix_str(f"cpu {fmt} {h}x{i} n={n}")
            # Small experts take microseconds, where one preemption is a large error: more tries.
            reps = int(min(8, 1 + 2e6 // (expert_params(h, i) * quant_bytes(fmt))))
            best[j] = min(best[j], time_cpu_expert(pools[(h, i)], n, reps))
            bar.update()
    return best


def _measure_device(job: tuple, dtype, reps: int) -> float:
    """Seconds of a GPU job: a dense expert in `dtype`, or a copy of one's bytes."""
    kind, _, h, i, n = job
    if kind in ("copy", "copy_pageable"):
        return time_copy(expert_params(h, i) * dtype.itemsize, reps, pinned=kind == "copy")
    reps = max(reps, 2)
    return time_gpu_expert(gpu_experts(h, i, dtype, GPU_ROTATE_BYTES), n, reps)


def calibrate(
    dtype: torch.dtype = torch.float32,
    quick: bool = False,
    progress: bool = True,
    cuda: bool | None = None,
    model: tuple[int, int] | None = None,
    formats: tuple[str, ...] | None = None,
) -> Calibration:
    """Measure, fit on the fit set, check on the held-out set, for experts in each of `formats`
    (default: dense in `dtype`; tokens are always in `dtype`). `model`: the (hidden, intermediate)
    of the experts the profile is for, measured along with the standard shapes. The profile's
    constants are the first format's, and `cpu_formats` holds every format's CPU constants."""
    cuda = torch.cuda.is_available() if cuda is None else cuda
    formats = _formats(formats, dtype)
    rounds = 5 if quick else 7  # minimum over rounds: 3 let one busy spell through (39% off, once)
    jobs = {f: _jobs(quick, cuda and i == 0, model, f) for i, f in enumerate(formats)}
    runs = sum(len([j for j in js if j[0] == "cpu"]) * rounds for js in jobs.values())
    bar = tqdm(
        total=runs + len([j for j in jobs[formats[0]] if j[0] != "cpu"]),
        desc="calibrating",
        unit="run",
        file=sys.stderr,
        disable=not progress,
        leave=False,
    )
    measured = [_calibrate_format(f, jobs[f], dtype, rounds, model, bar) for f in formats]
    bar.close()
    profile = measured[0][0]
    profile.cpu_formats = {
        f: {k: getattr(p, k) for k in CPU_FIELDS} for f, (p, _, _) in zip(formats, measured)
    }
    samples = [s for _, fitted, _ in measured for s in fitted]
    checks = [c for _, _, held in measured for c in held]
    return Calibration(profile, dtype, samples, checks, model)


def _formats(formats: tuple[str, ...] | None, dtype: torch.dtype) -> tuple[str, ...]:
    """The formats to measure, by the engine's names; a clear error for one it cannot keep."""
    dense = DTYPE_FORMAT[dtype]
    names = tuple(dict.fromkeys(format_name(f) for f in formats)) if formats else (dense,)
    for name in names:
        if name in FLOAT_BYTES and name != dense:
            raise UserError(
                f"--formats {name}: dense experts are kept in the compute dtype ({dense}); give "
                f"--dtype for {name} experts"
            )
        if name not in FLOAT_BYTES and name not in FORMATS:
            raise UserError(
                f"--formats {name}: experts are kept in {', '.join([*FLOAT_BYTES, *FORMATS])}"
            )
        if name in FORMATS and kernels.library() is None:
            raise UserError(
                f"--formats {name}: measuring block formats needs the native quantiser (a C "
                "compiler and an AVX2 CPU)"
            )
    return names


def _calibrate_format(fmt: str, jobs: list[tuple], dtype, rounds: int, model, bar) -> tuple:
    """(profile, fitted samples, checks) of experts in `fmt` on the CPU (the GPU and copies, when
    among the jobs, with dense experts in `dtype`)."""
    cpu_jobs = [j for j in jobs if j[0] == "cpu"]
    seconds = dict(zip(cpu_jobs, _measure_cpu(cpu_jobs, dtype, rounds, bar, fmt)))
    for job in jobs:
        if job[0] != "cpu":
            bar.set_postfix_str(f"{job[0]} {job[2]}x{job[3]} n={job[4]}")
            seconds[job] = _measure_device(job, dtype, rounds)
            bar.update()
    kept = {"cpu": fmt, "gpu": DTYPE_FORMAT[dtype], "copy": DTYPE_FORMAT[dtype]}
    fitted = [
        _sample(k, h, i, n, kept[k], seconds[(k, r, h, i, n)], _weight(h, i, model))
        for k, r, h, i, n in jobs
        if r == "fit"
    ]
    profile = fit_profile(fitted)
    if any(j[0] == "gpu" for j in jobs):  # GPU experts were timed cold, rotating over this much
        profile.gpu_rotate_bytes = GPU_ROTATE_BYTES
    checks = []
    for job in (j for j in jobs if j[1] == "check"):
        k, _, h, i, n = job
        s = _sample(k, h, i, n, kept[k], seconds[job])
        checks.append(Check(k, h, i, n, s.seconds, predict(profile, s), kept[k]))
    return profile, fitted, checks


def fit_profile(samples: list[Sample]) -> CostModel:
    """The cost model's fit (experts/plan/cost_fit.py `fit`): the CPU's batched and row-by-row
    regimes with this machine's cache sizes; GPU and copies when measured."""
    return fit(samples, name="calibrated", caches=cpu_caches(torch.get_num_threads()))


def cpu_caches(
    threads: int, root: str | Path = "/sys/devices/system/cpu/cpu0/cache"
) -> tuple[float, ...]:
    """Bytes of each data cache level from L2 out, as `threads` threads see them: a private
    level counts once per thread (up to its instances), a shared one once. () where Linux's sysfs
    does not say (re-reads are then costed as from RAM). L1 is left out: an expert never fits it."""
    sizes = {}
    for index in sorted(Path(root).glob("index[0-9]*")):
        try:
            level, kind = int((index / "level").read_text()), (index / "type").read_text().strip()
            size = _parse_bytes((index / "size").read_text().strip())
            sharing = _count_cpus((index / "shared_cpu_list").read_text().strip())
        except (OSError, ValueError):
            continue
        if level >= 2 and kind in ("Data", "Unified"):
            instances = max(1, (os.cpu_count() or 1) // sharing)
            sizes[level] = size * max(1, min(threads, instances))
    return tuple(float(sizes[k]) for k in sorted(sizes))


def _parse_bytes(text: str) -> int:
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    return int(text[:-1]) * units[text[-1].upper()] if text[-1:].upper() in units else int(text)


def _count_cpus(cpu_list: str) -> int:
    """'0-3,8' -> 5."""
    count = 0
    for part in cpu_list.split(","):
        lo, _, hi = part.partition("-")
        count += int(hi or lo) - int(lo) + 1
    return count


def predict(profile: CostModel, s: Sample) -> float:
    """The profile's time for a measured sample (its own bytes and flops): CostModel's own
    formulas."""
    costed = profile.sized(s.bytes, s.flops, s.n_tokens)
    if s.kind == "copy":
        return costed.t_copy()
    if s.kind == "copy_pageable":
        return s.bytes / profile.bw_pcie_pageable + profile.c_copy_pageable
    return costed.t_cpu(s.n_tokens) if s.kind == "cpu" else costed.t_gpu(s.n_tokens)


# ---- where profiles live -----------------------------------------------------------------------


def default_profile_path(dtype: torch.dtype, model: tuple[int, int] | None = None) -> Path:
    """Per dtype, thread count and expert shape: all three change the CPU's time per expert."""
    name = str(dtype).removeprefix("torch.")
    shape = f"{model[0]}x{model[1]}-" if model else ""
    return user_cache_dir() / f"calibration-{shape}{name}-{torch.get_num_threads()}threads.json"


def load_or_calibrate(
    path: str | Path | None,
    dtype: torch.dtype,
    progress: bool = True,
    model: tuple[int, int] | None = None,
    fmt: str | None = None,
) -> CostModel:
    """The profile at `path`; without one, the cached profile of this machine for experts of shape
    `model` (hidden, intermediate), with the CPU's figures for experts in `fmt` (default: dense in
    `dtype`) measured on first use and added to it."""
    if path is not None:
        return CostModel.load(path)
    fmt = format_name(fmt or DTYPE_FORMAT[dtype])
    cached = default_profile_path(dtype, model)
    data = _cached(cached)
    if data is not None and fmt in data.get("cpu_formats", {}):
        return CostModel.from_json(data)
    log.warning(
        "measuring this machine's expert speed for %s experts once (cached in %s); `hybridmoe "
        "calibrate` does a longer run",
        fmt,
        cached,
    )
    result = calibrate(dtype, quick=True, progress=progress, model=model, formats=(fmt,))
    if data is not None:  # the formats measured before stay; the profile's own constants too
        data["cpu_formats"] = {**data["cpu_formats"], **result.profile.cpu_formats}
        data["checks"] = data.get("checks", []) + result.to_json()["checks"]
    else:
        data = result.to_json()
    try:
        write_atomic(cached, json.dumps(data, indent=2) + "\n")
    except OSError as e:
        log.warning("could not cache the calibration in %s (%s)", cached, e)
    return CostModel.from_json(data)


def _cached(path: Path) -> dict | None:
    """The cached profile's JSON, or None where there is none, it is broken, or of an older
    version (measured again)."""
    try:
        data = json.loads(path.read_text())
        CostModel.from_json(data)
    except Exception:
        return None
    return data if data.get("version") == PROFILE_VERSION else None
