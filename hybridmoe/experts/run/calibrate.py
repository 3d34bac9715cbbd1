"""Measure this machine and fit the cost model's constants: the profile `hybridmoe calibrate`
writes.

CPU: one SwiGLU expert (the function the runtime runs) over n = 1..512 tokens, for expert shapes
from 0.2 MB to beyond the last-level cache, plus the model's own shape when the profile is for a
model; with CUDA, the same on the GPU (rotating over `tuning.GPU_ROTATE_BYTES` of experts, beyond
the GPU's L2, so each is read from GPU memory as a cache miss is) and host->device copies of several
sizes from pinned memory (what the runtime's staging ring copies from) and from pageable memory,
both recorded in the profile (`copy_source`, `bw_pcie_pageable`). Some
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

from hybridmoe.experts.plan.cost_fit import Sample, fit
from hybridmoe.experts.plan.cost_model import PROFILE_VERSION, CostModel
from hybridmoe.experts.plan.shape import expert_params
from hybridmoe.experts.run.ffn import expert_ffn
from hybridmoe.experts.run.store import ExpertWeights
from hybridmoe.files import write_atomic
from hybridmoe.paths import user_cache_dir
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

    @property
    def error(self) -> float:
        return self.predicted / self.measured - 1.0


@dataclass
class Calibration:
    profile: CostModel
    dtype: torch.dtype
    samples: list[Sample] = field(default_factory=list)
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


def _experts(hidden: int, inter: int, dtype, device, total_bytes: float) -> list[ExpertWeights]:
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

    def __init__(self, hidden: int, inter: int, dtype):
        self.copies = _experts(hidden, inter, dtype, "cpu", ROTATE_BYTES)
        self.cursor = 0

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
    x = torch.randn(n, experts.copies[0].down.shape[0]).to(experts.copies[0].down.dtype)  # [n, H]
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


def _shapes(quick: bool, model: tuple[int, int] | None) -> tuple[tuple, tuple]:
    """(fit shapes, held-out shapes): the model's own expert shape joins the fit,
    never the check."""
    fit_shapes = FIT_SHAPES + ((model,) if model and model not in FIT_SHAPES else ())
    check_shapes = tuple(s for s in (QUICK_CHECK_SHAPES if quick else CHECK_SHAPES) if s != model)
    return fit_shapes, check_shapes


def _jobs(quick: bool, cuda: bool, model: tuple[int, int] | None = None) -> list[tuple]:
    """(kind, role, hidden, inter, n) for every measurement, fit ones first."""
    fit_n, check_n = (QUICK_FIT_TOKENS, QUICK_CHECK_TOKENS) if quick else (FIT_TOKENS, CHECK_TOKENS)
    fit_shapes, check_shapes = _shapes(quick, model)
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
    kind: str, hidden: int, inter: int, n: int, dtype, seconds: float, weight: float = 1.0
) -> Sample:
    params = expert_params(hidden, inter)
    return Sample(
        kind, n, seconds, bytes=params * dtype.itemsize, flops=2.0 * params * n, weight=weight
    )


def _weight(hidden: int, inter: int, model: tuple[int, int] | None) -> float:
    """The model's own shape counts as much as all the standard ones together: the profile is for
    it, and effective bandwidth varies by shape more than the roofline can follow
    (docs/notes/2026-11-24-measurements-in-code.md)."""
    return float(len(FIT_SHAPES)) if model == (hidden, inter) else 1.0


def _measure_cpu(jobs: list[tuple], dtype, rounds: int, bar) -> list[float]:
    """Seconds per CPU job, the minimum over `rounds` rounds that each visit every job once, so
    that a change of load on the machine affects fitted and held-out points alike."""
    pools = {}
    for _, _, h, i, _ in jobs:
        if (h, i) not in pools:
            pools[(h, i)] = ColdExperts(h, i, dtype)
    best = [float("inf")] * len(jobs)
    for _ in range(rounds):
        for j, (_, _, h, i, n) in enumerate(jobs):
            bar.set_postfix_str(f"cpu {h}x{i} n={n}")
            # Small experts take microseconds, where one preemption is a large error: more tries.
            reps = int(min(8, 1 + 2e6 // (expert_params(h, i) * dtype.itemsize)))
            best[j] = min(best[j], time_cpu_expert(pools[(h, i)], n, reps))
            bar.update()
    return best


def _measure_device(job: tuple, dtype, reps: int) -> float:
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
) -> Calibration:
    """Measure, fit on the fit set, check on the held-out set. `model`: the (hidden, intermediate)
    of the experts the profile is for, measured along with the standard shapes."""
    cuda = torch.cuda.is_available() if cuda is None else cuda
    rounds = 5 if quick else 7  # minimum over rounds: 3 let one busy spell through (39% off, once)
    jobs = _jobs(quick, cuda, model)
    cpu_jobs = [j for j in jobs if j[0] == "cpu"]
    device_jobs = [j for j in jobs if j[0] != "cpu"]
    bar = tqdm(
        total=len(cpu_jobs) * rounds + len(device_jobs),
        desc="calibrating",
        unit="run",
        file=sys.stderr,
        disable=not progress,
        leave=False,
    )
    seconds = dict(zip(cpu_jobs, _measure_cpu(cpu_jobs, dtype, rounds, bar)))
    for job in device_jobs:
        bar.set_postfix_str(f"{job[0]} {job[2]}x{job[3]} n={job[4]}")
        seconds[job] = _measure_device(job, dtype, rounds)
        bar.update()
    bar.close()
    fit_samples = [
        _sample(k, h, i, n, dtype, seconds[(k, r, h, i, n)], _weight(h, i, model))
        for k, r, h, i, n in jobs
        if r == "fit"
    ]
    profile = fit_profile(fit_samples)
    if cuda:
        profile.gpu_rotate_bytes = GPU_ROTATE_BYTES
    checks = []
    for job in jobs:
        if job[1] == "check":
            s = _sample(job[0], job[2], job[3], job[4], dtype, seconds[job])
            checks.append(Check(job[0], job[2], job[3], job[4], s.seconds, predict(profile, s)))
    return Calibration(profile, dtype, fit_samples, checks, model)


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
) -> CostModel:
    """The profile at `path`; without one, the cached profile of this machine for experts of shape
    `model` (hidden, intermediate), measured on first use."""
    if path is not None:
        return CostModel.load(path)
    cached = default_profile_path(dtype, model)
    if cached.exists():
        try:
            if json.loads(cached.read_text()).get("version") == PROFILE_VERSION:
                return CostModel.load(cached)
        except Exception:
            pass  # a broken cache file, or one of an older format, is measured again below
    log.warning(
        "measuring this machine's expert speed once (cached in %s); `hybridmoe calibrate` does a "
        "longer run",
        cached,
    )
    result = calibrate(dtype, quick=True, progress=progress, model=model)
    try:
        result.save(cached)
    except OSError as e:
        log.warning("could not cache the calibration in %s (%s)", cached, e)
    return result.profile
